"""Paged decode attention: the batched reference vs a per-token float64 oracle, the split-K
Triton kernel and the compiled CPU kernel vs the reference, over dtypes, head dims, GQA ratios
1/3/4/8, lengths 0, 1, one block, one block plus one, and shuffled block tables read through a
strided layer view."""

import pytest
import torch

from tests.kernels.conftest import (
    DEVICE,
    DTYPES,
    GQA,
    NUM_BLOCKS,
    assert_close,
    gpu,
    make_cache,
    naive_attention,
    randn,
    requires_cuda,
    shuffled_block_tables,
)
from tests.kernels.ops import decode_attention, decode_attention_cpu, decode_attention_ref

SEQ_LENS = [1, 16, 17, 40, 0, 5]


def decode_case(heads, kv_heads, head_dim, dtype, seed, seq_lens=SEQ_LENS, extra_cols=0, num_blocks=NUM_BLOCKS):
    kv_layer = make_cache(kv_heads, head_dim, dtype, seed, num_blocks=num_blocks)[:, 1]
    table = shuffled_block_tables(seq_lens, seed=seed, extra_cols=extra_cols, num_blocks=num_blocks)
    query = randn(len(seq_lens), heads, head_dim, dtype=dtype, seed=seed + 1)
    return query, kv_layer, table, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("heads, kv_heads", GQA)
def test_decode_reference_matches_per_token_oracle(heads, kv_heads):
    query, kv_layer, table, seq_lens = decode_case(heads, kv_heads, 32, torch.float32, 3)
    out = decode_attention_ref(query, kv_layer, table, seq_lens, 0.17)
    for i, n in enumerate(SEQ_LENS):
        want = naive_attention(query[i:i + 1], kv_layer, table[i], [n - 1], 0.17) if n else torch.zeros(1, heads, 32)
        torch.testing.assert_close(out[i:i + 1].double().cpu(), want.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [32, 80])
def test_decode_triton_matches_reference(heads, kv_heads, head_dim, dtype):
    query, kv_layer, table, seq_lens = decode_case(heads, kv_heads, head_dim, dtype, 4)
    want = decode_attention_ref(query, kv_layer, table, seq_lens, head_dim ** -0.5)
    got = decode_attention(query, kv_layer, table, seq_lens, head_dim ** -0.5, force_triton=True)
    assert_close(got, want, dtype)
    assert torch.all(got[SEQ_LENS.index(0)] == 0)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_triton_llama_head_dims(head_dim, dtype):
    query, kv_layer, table, seq_lens = decode_case(8, 2, head_dim, dtype, 5)
    want = decode_attention_ref(query, kv_layer, table, seq_lens, head_dim ** -0.5)
    assert_close(decode_attention(query, kv_layer, table, seq_lens, head_dim ** -0.5, force_triton=True), want, dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_decode_triton_split_counts_and_padded_tables_agree(num_splits):
    query, kv_layer, table, seq_lens = decode_case(6, 2, 32, torch.float32, 6, extra_cols=2)
    want = decode_attention_ref(query, kv_layer, table, seq_lens, 0.2)
    got = decode_attention(query, kv_layer, table, seq_lens, 0.2, force_triton=True, num_splits=num_splits)
    assert_close(got, want, torch.float32)


def test_decode_triton_one_split_writes_the_output_without_the_merge_kernel(monkeypatch):
    """With one split (forced, or planned for a batch wide enough to fill the device) the attention
    program normalizes and writes the output itself: the merge kernel is not launched, and an
    empty sequence (a padding row) still gets zeros."""
    from kernels.triton import decode_attention as triton_decode

    class NoMerge:
        def __getitem__(self, grid):
            raise AssertionError(f"the merge kernel was launched for one split (grid {grid})")

    monkeypatch.setattr(triton_decode, "_decode_reduce_kernel", NoMerge())
    seq_lens = [0, 5, 40, 17, 1]
    query, kv_layer, table, lens = decode_case(6, 2, 32, torch.float32, 10, seq_lens=seq_lens, extra_cols=1)
    want = decode_attention_ref(query, kv_layer, table, lens, 0.2)
    got = decode_attention(query, kv_layer, table, lens, 0.2, force_triton=True, num_splits=1)
    assert_close(got, want, torch.float32)
    assert not got[0].any()
    monkeypatch.setattr(triton_decode, "_num_sms", lambda device: 1)  # the plan: these rows fill the device
    assert triton_decode._plan_splits(len(seq_lens), 2, table.shape[1] * kv_layer.shape[2], query.device, None)[0] == 1
    assert_close(decode_attention(query, kv_layer, table, lens, 0.2, force_triton=True), want, torch.float32)


def test_decode_triton_wide_table_splits_each_sequence_by_its_own_length(monkeypatch):
    """A table far wider than the sequences (a CUDA graph's is as wide as max_model_len): the
    split count is planned from the width, each sequence's splits from its own length; long
    sequences (over many splits of the minimum) and short ones (most splits empty) agree."""
    from kernels.triton import decode_attention as triton_decode

    monkeypatch.setattr(triton_decode, "_MIN_TOKENS_PER_SPLIT", 8)  # many splits at the test's lengths
    seq_lens = [1, 16, 17, 300, 0, 77]
    query, kv_layer, table, lens = decode_case(4, 2, 32, torch.float32, 8, seq_lens=seq_lens, extra_cols=60,
                                               num_blocks=80)
    want = decode_attention_ref(query, kv_layer, table, lens, 0.2)
    assert_close(decode_attention(query, kv_layer, table, lens, 0.2, force_triton=True), want, torch.float32)


@pytest.mark.parametrize("force_triton", [False, True])
def test_decode_reads_a_strided_query_from_a_fused_qkv(force_triton):
    query, kv_layer, table, seq_lens = decode_case(4, 2, 32, torch.float32, 7)
    qkv = torch.cat([query.reshape(len(SEQ_LENS), -1), randn(len(SEQ_LENS), 128, seed=9)], dim=-1)
    strided = qkv[:, :128].view(len(SEQ_LENS), 4, 32)
    want = decode_attention_ref(query, kv_layer, table, seq_lens, 0.2)
    got = decode_attention(strided, kv_layer, table, seq_lens, 0.2, force_triton=force_triton)
    assert_close(got, want, torch.float32)


def test_decode_empty_batch_and_bad_shapes():
    query, kv_layer, table, seq_lens = decode_case(4, 2, 32, torch.float32, 8)
    for force_triton in (False, True):
        empty = decode_attention(query[:0], kv_layer, table[:0], seq_lens[:0], 0.2, force_triton=force_triton)
        assert empty.shape == (0, 4, 32)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(randn(6, 3, 32), kv_layer, table, seq_lens, 0.2)
    with pytest.raises(ValueError, match="decode_attention"):
        decode_attention(query, kv_layer, table[:2], seq_lens, 0.2)


def cpu_case(*args, **kwargs):
    """decode_case's tensors on the CPU, where the compiled kernel runs (whatever DEVICE is)."""
    return tuple(t.cpu() for t in decode_case(*args, **kwargs))


@pytest.mark.parametrize("heads, kv_heads", GQA + [(12, 3)])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
def test_decode_cpu_kernel_matches_reference(heads, kv_heads, head_dim):
    seq_lens = SEQ_LENS + [33, 100, 64]
    query, kv_layer, table, lens = cpu_case(heads, kv_heads, head_dim, torch.float32, 11, seq_lens, extra_cols=1)
    want = decode_attention_ref(query, kv_layer, table, lens, head_dim ** -0.5)
    got = decode_attention_cpu(query, kv_layer, table, lens, head_dim ** -0.5)
    assert got is not None, "the compiled CPU kernel did not build or load"
    assert_close(got, want, torch.float32)
    assert torch.all(got[seq_lens.index(0)] == 0)
    assert_close(decode_attention(query, kv_layer, table, lens, head_dim ** -0.5), want, torch.float32)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (9, 3)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_decode_cpu_kernel_reads_a_bfloat16_cache_in_place(heads, kv_heads, head_dim):
    """bfloat16 query and cache: the kernel widens each value exactly and sums in float32, so it
    equals the float32 reference on the same (bfloat16-valued) inputs up to the output's rounding."""
    seq_lens = SEQ_LENS + [33, 100]
    query, kv_layer, table, lens = cpu_case(heads, kv_heads, head_dim, torch.bfloat16, 21, seq_lens, extra_cols=1)
    got = decode_attention_cpu(query, kv_layer, table, lens, head_dim ** -0.5)
    assert got is not None and got.dtype == torch.bfloat16
    want = decode_attention_ref(query.float(), kv_layer.float(), table, lens, head_dim ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=8e-3)
    assert torch.all(got[seq_lens.index(0)] == 0)
    assert_close(decode_attention(query, kv_layer, table, lens, head_dim ** -0.5), want, torch.bfloat16)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_cpu_kernel_rounds_a_bfloat16_output_as_torch_does(head_dim):
    """The bfloat16 copy takes the bfloat16 query and writes bfloat16 itself: its float32 sums are
    the float32 copy's on the same values, so its output must be exactly that output rounded by
    torch (to nearest even), NaN included."""
    seq_lens = SEQ_LENS + [33, 100]
    query, kv_layer, table, lens = cpu_case(9, 3, head_dim, torch.bfloat16, 23, seq_lens, extra_cols=1)
    query[2, 4, 7] = float("nan")
    got = decode_attention_cpu(query, kv_layer, table, lens, head_dim ** -0.5)
    wide = decode_attention_cpu(query.float(), kv_layer.float(), table, lens, head_dim ** -0.5)
    assert got is not None and wide is not None and got.dtype == torch.bfloat16
    assert torch.isnan(got[2, 4]).all() and not torch.isnan(got[3]).any()
    rounded, nan = wide.to(torch.bfloat16), torch.isnan(got)
    assert torch.isnan(rounded).equal(nan)
    assert torch.equal(got.view(torch.int16)[~nan], rounded.view(torch.int16)[~nan])


def test_decode_cpu_kernel_leaves_a_bfloat16_head_size_without_a_vector_path_to_the_reference():
    query, kv_layer, table, lens = cpu_case(4, 2, 48, torch.bfloat16, 22)
    assert decode_attention_cpu(query, kv_layer, table, lens, 0.2) is None
    want = decode_attention_ref(query.float(), kv_layer.float(), table, lens, 0.2)
    assert_close(decode_attention(query, kv_layer, table, lens, 0.2), want, torch.bfloat16)
    assert decode_attention_cpu(query.float(), kv_layer, table, lens, 0.2) is None  # mixed dtypes


def test_decode_cpu_kernel_reads_a_strided_query_and_refuses_out_of_range_tables():
    query, kv_layer, table, seq_lens = cpu_case(4, 2, 32, torch.float32, 12)
    qkv = torch.cat([query.reshape(len(SEQ_LENS), -1), randn(len(SEQ_LENS), 128, seed=13).cpu()], dim=-1)
    strided = qkv[:, :128].view(len(SEQ_LENS), 4, 32)
    want = decode_attention_ref(query, kv_layer, table, seq_lens, 0.2)
    assert_close(decode_attention_cpu(strided, kv_layer, table, seq_lens, 0.2), want, torch.float32)
    with pytest.raises(ValueError, match="width"):
        decode_attention_cpu(query, kv_layer, table, seq_lens + table.shape[1] * 16, 0.2)
    bad = table.clone()
    bad[0, 0] = kv_layer.shape[0]
    with pytest.raises(ValueError, match="block ids"):
        decode_attention_cpu(query, kv_layer, bad, seq_lens, 0.2)
    assert decode_attention_cpu(query.double(), kv_layer.double(), table, seq_lens, 0.2) is None


@pytest.mark.parametrize("block_size", [4, 16, 32, 64])
@pytest.mark.parametrize("group", [2, 5, 7])
@pytest.mark.parametrize("head_dim", [32, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_cpu_kernel_block_sizes_and_group_chunks(block_size, group, head_dim, dtype):
    """The kernel scores a block in tiles of 16 tokens and walks a GQA group in chunks of at most
    four heads (fewer for wide heads): blocks smaller than, equal to and several tiles long,
    lengths ending inside a tile, and groups that split into uneven chunks."""
    kv_heads = 2
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 5, 100, 0, 37]
    width = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * width + 3
    generator = torch.Generator().manual_seed(block_size * 100 + group * 10 + head_dim)
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    table = torch.randperm(num_blocks, generator=generator)[: len(seq_lens) * width].view(len(seq_lens), width)
    query = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=generator).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    table = table.to(torch.int32).contiguous()
    got = decode_attention_cpu(query, cache, table, lens, head_dim ** -0.5)
    assert got is not None, "the compiled CPU kernel did not build or load"
    want = decode_attention_ref(query.float(), cache.float(), table, lens, head_dim ** -0.5)
    if dtype == torch.float32:
        assert_close(got, want, torch.float32)
    else:
        torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=8e-3)
    assert torch.all(got[seq_lens.index(0)] == 0)


def test_loading_the_cpu_kernel_keeps_denormals():
    # A library linked with -ffast-math would switch on flush-to-zero for the whole process.
    from kernels.cpu.native import load

    assert load() is not None
    tiny = torch.tensor([1e-40])
    assert (tiny * 1.0).item() != 0.0


@gpu
@requires_cuda
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_cuda_long_sequences(head_dim, dtype):
    seq_lens = [1, 4096, 2049, 17, 0, 1000, 3333, 16]
    query, kv_layer, table, lens = decode_case(32, 8, head_dim, dtype, 10, seq_lens, num_blocks=1024)
    want = decode_attention_ref(query, kv_layer, table, lens, head_dim ** -0.5)
    assert_close(decode_attention(query, kv_layer, table, lens, head_dim ** -0.5), want, dtype)


def test_decode_cpu_kernel_checks_tables_again_once_they_change():
    """The bounds check runs once for a pair of unmodified table and length tensors (the model
    passes the same pair to every layer), and again after either is written in place or when the
    cache is smaller."""
    query, kv_layer, table, lens = cpu_case(4, 2, 32, torch.float32, 14)
    assert decode_attention_cpu(query, kv_layer, table, lens, 0.2) is not None
    assert decode_attention_cpu(query, kv_layer, table, lens, 0.2) is not None
    with pytest.raises(ValueError, match="block ids"):
        decode_attention_cpu(query, kv_layer[: int(table.max())], table, lens, 0.2)
    table[0, 0] = kv_layer.shape[0]
    with pytest.raises(ValueError, match="block ids"):
        decode_attention_cpu(query, kv_layer, table, lens, 0.2)
    table[0, 0] = 0
    assert decode_attention_cpu(query, kv_layer, table, lens, 0.2) is not None
    lens[1] = table.shape[1] * 16 + 1
    with pytest.raises(ValueError, match="width"):
        decode_attention_cpu(query, kv_layer, table, lens, 0.2)
