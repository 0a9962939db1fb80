"""Prefill attention over a paged prefix: the per-sequence reference vs a per-token float64
oracle, the tiled Triton kernel and the CPU's AMX kernel (bfloat16) vs the reference; whole
prompts, chunks over a cached prefix, one-token and empty chunks, GQA ratios 1/3/4/8, every
dtype, shuffled block tables."""

import pytest
import torch

from kernels.cpu import ops as cpu_ops
from tests.kernels.conftest import (
    BLOCK_SIZE,
    DEVICE,
    DTYPES,
    GQA,
    assert_close,
    gpu,
    make_cache,
    naive_attention,
    randn,
    requires_cuda,
    shuffled_block_tables,
)
from tests.kernels.ops import CPU, prefill_attention, prefill_attention_ref

# (chunk lengths, total lengths): whole prompts, one token, an empty chunk, one block, chunks
# over a cached prefix (crossing block boundaries), one token over a prefix
Q_LENS, TOTALS = [5, 1, 0, 16, 7, 17, 1], [5, 1, 3, 16, 40, 33, 20]


def prefill_case(heads, kv_heads, head_dim, dtype, seed, q_lens=Q_LENS, totals=TOTALS, num_blocks=40, device=DEVICE):
    kv_layer = make_cache(kv_heads, head_dim, dtype, seed, num_blocks=num_blocks, device=device)[:, 1]
    table = shuffled_block_tables(totals, seed=seed, num_blocks=num_blocks, device=device)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    query = randn(int(cu[-1]), heads, head_dim, dtype=dtype, seed=seed + 1, device=device)
    return query, kv_layer, table, cu, torch.tensor(totals, dtype=torch.int32, device=device)


@pytest.mark.parametrize("heads, kv_heads", GQA)
def test_prefill_reference_matches_per_token_oracle(heads, kv_heads):
    query, kv_layer, table, cu, seq_lens = prefill_case(heads, kv_heads, 32, torch.float32, 5)
    out = prefill_attention_ref(query, kv_layer, table, cu, seq_lens, 0.2)
    for i, (q_len, total) in enumerate(zip(Q_LENS, TOTALS)):
        start = int(cu[i])
        want = naive_attention(query[start:start + q_len], kv_layer, table[i], list(range(total - q_len, total)), 0.2)
        torch.testing.assert_close(out[start:start + q_len].double().cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", GQA)
def test_prefill_triton_matches_reference(heads, kv_heads, dtype):
    query, kv_layer, table, cu, seq_lens = prefill_case(heads, kv_heads, 64, dtype, 7)
    want = prefill_attention_ref(query, kv_layer, table, cu, seq_lens, 0.125)
    assert_close(prefill_attention(query, kv_layer, table, cu, seq_lens, 0.125, force_triton=True), want, dtype)


@pytest.mark.parametrize("head_dim", [32, 80, 128])
def test_prefill_triton_other_head_dims(head_dim):
    query, kv_layer, table, cu, seq_lens = prefill_case(4, 2, head_dim, torch.bfloat16, 8)
    want = prefill_attention_ref(query, kv_layer, table, cu, seq_lens, head_dim ** -0.5)
    got = prefill_attention(query, kv_layer, table, cu, seq_lens, head_dim ** -0.5, force_triton=True, max_query_len=17)
    assert_close(got, want, torch.bfloat16)


@pytest.mark.parametrize("force_triton", [False, True])
def test_prefill_reads_a_strided_query_from_a_fused_qkv(force_triton):
    query, kv_layer, table, cu, seq_lens = prefill_case(4, 2, 32, torch.float32, 9)
    qkv = torch.cat([query.reshape(query.shape[0], -1), randn(query.shape[0], 128, seed=9)], dim=-1)
    strided = qkv[:, :128].view(query.shape[0], 4, 32)
    want = prefill_attention_ref(query, kv_layer, table, cu, seq_lens, 0.2)
    got = prefill_attention(strided, kv_layer, table, cu, seq_lens, 0.2, force_triton=force_triton)
    assert_close(got, want, torch.float32)


def test_prefill_all_empty_and_bad_shapes():
    query, kv_layer, table, cu, seq_lens = prefill_case(4, 2, 32, torch.float32, 10, [0, 0], [3, 0])
    for force_triton in (False, True):
        empty = prefill_attention(query, kv_layer, table, cu, seq_lens, 0.2, force_triton=force_triton)
        assert empty.shape == (0, 4, 32)
    with pytest.raises(ValueError, match="cu_query_lens"):
        prefill_attention(query, kv_layer, table, cu[:2], seq_lens, 0.2)


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    """Whether a compiled CPU kernel ran, per call."""
    calls, real = [], cpu_ops.prefill_attention

    def spy(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_ops, "prefill_attention", spy)
    return calls


# Long chunks cross several 16-query and 32-key blocks; the others are Q_LENS' edge cases.
AMX_Q_LENS, AMX_TOTALS = Q_LENS + [100, 64, 33], TOTALS + [100, 300, 97]


@pytest.mark.parametrize(("dtype", "path"), [(torch.bfloat16, "amx"), (torch.bfloat16, "avx512"),
                                             (torch.float32, "avx512")])
# The AVX-512 kernel takes up to 3 heads of a group at once: ratios 5 and 7 split as 3 + 2 and
# 3 + 3 + 1. Its bfloat16 Q^T moves in 16 pairs of dims at a time: 48 and 80 dims end mid-way.
@pytest.mark.parametrize("heads, kv_heads", GQA + [(10, 2), (7, 1)])
@pytest.mark.parametrize("head_dim", [32, 48, 64, 80, 96, 128])
def test_prefill_cpu_kernels_match_reference(heads, kv_heads, head_dim, dtype, path, kernel_calls, monkeypatch):
    """The compiled CPU kernels (bfloat16 on AMX where the CPU has it, bfloat16 and float32 on
    AVX-512) against the per-sequence reference, with the cache's unused rows poisoned with NaN:
    keys past a sequence's end must not reach any output. path "avx512" hides AMX, so that CPUs
    with it test the AVX-512 bfloat16 kernel too."""
    if path == "avx512":
        real_ready = cpu_ops._ready
        monkeypatch.setattr(cpu_ops, "_ready", lambda lib, name: name != "amx_attention" and real_ready(lib, name))
    # the backend's own probe: which kernel (if any) this machine's build runs for these
    expected = CPU.lib is not None and cpu_ops.prefill_kernel(CPU.lib, dtype, head_dim) is not None
    query, kv_layer, table, cu, seq_lens = prefill_case(heads, kv_heads, head_dim, dtype, 12,
                                                        AMX_Q_LENS, AMX_TOTALS, num_blocks=80, device="cpu")
    for row, total in enumerate(AMX_TOTALS):
        last = table[row, (total - 1) // BLOCK_SIZE]
        kv_layer[last, :, total % BLOCK_SIZE or BLOCK_SIZE:] = float("nan")
    want = prefill_attention_ref(query, kv_layer, table, cu, seq_lens, head_dim ** -0.5)
    got = prefill_attention(query, kv_layer, table, cu, seq_lens, head_dim ** -0.5)
    assert kernel_calls == [expected]
    assert got.dtype == dtype and not got.isnan().any()
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_cpu_kernels_reject_out_of_range_tables(dtype):
    """The kernels read the cache directly: a block id past the cache or a chunk longer than its
    sequence is refused before anything is read (the reference fails on the former too)."""
    query, kv_layer, table, cu, seq_lens = prefill_case(4, 2, 64, dtype, 13, device="cpu")
    bad = table.clone()
    bad[4, 1] = 40  # the cache has 40 blocks
    with pytest.raises((ValueError, IndexError, RuntimeError)):
        prefill_attention(query, kv_layer, bad, cu, seq_lens, 0.125)
    if CPU.lib is not None and cpu_ops.prefill_kernel(CPU.lib, dtype, 64) is not None:
        with pytest.raises(ValueError, match="out of range"):
            prefill_attention(query, kv_layer, bad, cu, seq_lens, 0.125)
        with pytest.raises(ValueError, match="out of range"):
            prefill_attention(query, kv_layer, table, cu, seq_lens - 1, 0.125)  # a chunk past its sequence


@gpu
@requires_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_cuda_long_chunks(head_dim, dtype):
    q_lens, totals = [1000, 300, 1, 129], [1000, 1300, 700, 2000]
    query, kv_layer, table, cu, seq_lens = prefill_case(32, 8, head_dim, dtype, 11, q_lens, totals, num_blocks=512)
    want = prefill_attention_ref(query, kv_layer, table, cu, seq_lens, head_dim ** -0.5)
    assert_close(prefill_attention(query, kv_layer, table, cu, seq_lens, head_dim ** -0.5), want, dtype)
