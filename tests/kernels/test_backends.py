"""Every backend this machine has (the CPU backend at each compiled level its CPU runs, and without
compiled kernels) against the reference backend on random inputs: projections across the row counts
where the kernels hand over to each other, the gated MLP, the greedy head, norms, rotary + KV write
and both attentions; and the one place a backend is chosen."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import native
from kernels.cpu.backend import CpuBackend
from kernels.reference.backend import ReferenceBackend
from kernels.reference.ops import rotary_cos_sin_cache
from kernels.select import select_backend
from tests.kernels.conftest import make_cache

REF = ReferenceBackend("cpu")
LEVELS = [level.name for level in native.available_levels()]
BACKENDS = [*(f"cpu-{name}" for name in LEVELS), "cpu-none"]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def make_backend(name: str) -> CpuBackend:
    level = name.removeprefix("cpu-")
    return CpuBackend("cpu", None if level == "none" else native.load(level))


@pytest.fixture(params=BACKENDS)
def backend(request) -> CpuBackend:
    return make_backend(request.param)


def test_this_machine_builds_and_runs_at_least_the_avx2_kernels():
    """The install builds every level (setup.py); an x86-64 CPU with AVX2 runs at least that one, and
    the best one runnable is what the CPU backend loads."""
    if not native.cpu_features() >= {"avx2", "fma"}:
        assert LEVELS == []
        return
    assert LEVELS[0] == "avx2"
    assert native.load().level.name == LEVELS[-1]


def _rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 5, 33, 64, 65, 200])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("small_batches", [True, False])
def test_linear_equals_the_reference(backend, dtype, rows, with_bias, small_batches):
    """Row counts on both sides of the small-batch kernels' limit, odd output counts (a ragged last
    panel), a bias or none, with and without the small-batch copies (a prefill-only engine)."""
    weight, x = _rand(97, 64, dtype=dtype, seed=1) / 8, _rand(rows, 64, dtype=dtype, seed=2)
    bias = _rand(97, dtype=dtype, seed=3) if with_bias else None
    w = backend.prepare_linear(weight, bias, small_batches=small_batches)
    got = backend.linear(x, w)
    assert got.shape == (rows, 97) and got.dtype == dtype
    torch.testing.assert_close(got.float(), REF.linear(x, REF.prepare_linear(weight, bias)).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 65, 300])
def test_gate_up_silu_equals_the_reference(backend, dtype, rows):
    weight, x = _rand(2 * 70, 96, dtype=dtype, seed=4) / 8, _rand(rows, 96, dtype=dtype, seed=5)
    w = backend.prepare_linear(weight, gate_up=True)
    got = backend.gate_up_silu(x, w)
    want = REF.silu_and_mul(REF.linear(x, REF.prepare_linear(weight)))
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(backend.linear(x, w).float(), REF.linear(x, REF.prepare_linear(weight)).float(),
                               **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_head_takes_the_argmax_of_the_heads_own_logits(backend, dtype, monkeypatch):
    """Where the build has the screen (the backend's probe says so), its token equals the argmax of
    the same backend's logits, ties included; elsewhere there is no head to prepare."""
    from kernels.cpu import greedy_head

    monkeypatch.setattr(greedy_head, "BF16_MIN_VOCAB", 0)
    weight = _rand(1000, 64, dtype=dtype, seed=6) / 8
    head = backend.prepare_linear(weight, copy=False)
    screen = backend.prepare_greedy_head(weight, head)
    own_panels = head.f32 if dtype == torch.float32 else head.bf16
    assert (screen is not None) == ("greedy_head" in backend.capabilities and own_panels is not None)
    if screen is None:
        return
    x = _rand(40, 64, dtype=dtype, seed=7)
    x[3] = x[2]  # equal rows: equal tokens
    assert torch.equal(backend.greedy_argmax(x, screen), backend.argmax(backend.linear(x, head)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_silu_and_argmax_equal_the_reference(backend, dtype):
    x, residual, weight = _rand(9, 96, dtype=dtype, seed=8), _rand(9, 96, dtype=dtype, seed=9), _rand(96, dtype=dtype)
    torch.testing.assert_close(backend.rms_norm(x, weight, 1e-6), REF.rms_norm(x, weight, 1e-6), **TOL[dtype])
    for got, want in zip(backend.add_rms_norm(x, residual, weight, 1e-6), REF.add_rms_norm(x, residual, weight, 1e-6)):
        torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(backend.silu_and_mul(x), REF.silu_and_mul(x), **TOL[dtype])
    assert torch.equal(backend.argmax(x), REF.argmax(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 32), (6, 2, 64), (8, 1, 48)])
def test_rotary_write_and_attention_equal_the_reference(backend, dtype, heads, kv_heads, head_dim):
    """One step's tokens rotated and written, then decode attention over three sequences and prefill
    attention over chunks on a cached prefix, against the reference on copies of the same cache."""
    num_tokens = 7
    cache = make_cache(kv_heads, head_dim, dtype, num_blocks=40, device="cpu")
    ref_cache = cache.clone()
    cos_sin = rotary_cos_sin_cache(head_dim, 512, 10000.0, None, torch.float32).to(dtype)
    positions = torch.tensor([0, 5, 17, 30, 31, 32, 100])
    slots = torch.tensor([3, 40, 77, 100, -1, 161, 250])
    q, k, v = (_rand(num_tokens, n, head_dim, dtype=dtype, seed=10 + i) for i, n in enumerate((heads, kv_heads,
                                                                                                   kv_heads)))
    q_ref, k_ref = q.clone(), k.clone()
    backend.rotary_and_write_kv(q, k, v, positions, cos_sin, cache[:, 0], slots)
    REF.rotary_and_write_kv(q_ref, k_ref, v, positions, cos_sin, ref_cache[:, 0], slots)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(cache, ref_cache, **TOL[dtype])
    tables = torch.randperm(40, generator=torch.Generator().manual_seed(3))[:24].view(3, 8).to(torch.int32)
    lens = torch.tensor([1, 60, 128], dtype=torch.int32)
    query = _rand(3, heads, head_dim, dtype=dtype, seed=20)
    scale = head_dim ** -0.5
    torch.testing.assert_close(backend.decode_attention(query, cache[:, 0], tables, lens, scale),
                               REF.decode_attention(query, cache[:, 0], tables, lens, scale), **TOL[dtype])
    cu = torch.tensor([0, 1, 17, 49], dtype=torch.int32)
    chunk = _rand(49, heads, head_dim, dtype=dtype, seed=21)
    torch.testing.assert_close(backend.prefill_attention(chunk, cache[:, 0], tables, cu, lens, scale),
                               REF.prefill_attention(chunk, cache[:, 0], tables, cu, lens, scale), **TOL[dtype])


def test_the_backend_is_chosen_once_by_name_and_device():
    assert select_backend("cpu").name == "cpu"
    assert select_backend("cpu", "reference").name == "reference"
    with pytest.raises(ValueError, match="not one of"):
        select_backend("cpu", "fast")
    with pytest.raises(ValueError, match="CUDA"):
        select_backend("cpu", "triton")
    with pytest.raises(ValueError, match="CPU"):
        select_backend("cuda", "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_kernel_copy_is_made_and_runs_where_the_backends_probe_says(backend, dtype, monkeypatch):
    """The compiled kernels' copies of W exist exactly where the build's probes say they run, and
    each batch runs on the kernel that takes it (a lost copy would leave the results right and the
    speed gone: this fails instead)."""
    kernels = backend.projections
    ran = []
    real_run, real_gate_up = type(kernels)._run_kernel, type(kernels).gate_up
    monkeypatch.setattr(type(kernels), "_run_kernel",
                        lambda self, entry, *a: ran.append(entry) or real_run(self, entry, *a))
    monkeypatch.setattr(type(kernels), "gate_up",
                        lambda self, x, w, gated: ran.append(f"gate_up:{gated}") or real_gate_up(self, x, w, gated))
    weight = _rand(64, 64, dtype=dtype, seed=30) / 8
    w = backend.prepare_linear(weight)
    gate_up = backend.prepare_linear(weight, gate_up=True, small_batches=False)
    is_f32 = dtype == torch.float32
    assert (w.f32 is not None) == (is_f32 and kernels.has_f32)
    assert (w.amx is not None) == (not is_f32 and kernels.has_amx)
    assert (w.bf16 is not None) == (not is_f32 and kernels.has_bf16 and not kernels.has_amx)
    assert (gate_up.gate_up is not None) == (is_f32 and kernels.has_gate_up)
    backend.linear(_rand(8, 64, dtype=dtype), w)
    backend.gate_up_silu(_rand(200, 64, dtype=dtype), gate_up)
    expected = []
    if w.amx is not None:
        expected.append("amx_linear_bf16")
    elif w.bf16 is not None:
        expected.append(kernels.bf16_entry)
    elif w.f32 is not None:
        expected.append("f32_linear")
    if gate_up.gate_up is not None:
        expected.append("gate_up:True")
    elif gate_up.bf16 is not None and gate_up.packed is None:
        expected.append(kernels.bf16_entry)
    assert ran == expected


@pytest.mark.parametrize("with_bias", [False, True])
def test_torch_projections_keep_a_weight_transposed_or_as_it_is_with_the_same_results(with_bias):
    """The reference and Triton backends' projections (x @ W^T on torch's matmul) keep each weight
    either transposed (W^T contiguous) or as the checkpoint has it (W contiguous, a transposed
    view: cuBLAS's TN GEMM, as F.linear): the same products, each a copy of its own (a shard
    sliced from a bigger tensor is not kept alive), or with copy=False a view of the weight."""
    from kernels.reference.backend import prepare_torch_linear, torch_linear

    full = torch.randn(96, 40, generator=torch.Generator().manual_seed(5))
    shard = full[32:80]  # rows of a bigger tensor: contiguous, but a view
    bias = torch.randn(48) if with_bias else None
    x = torch.randn(7, 40)
    want = x @ shard.t() + (bias if with_bias else 0)
    for transposed in (True, False):
        w = prepare_torch_linear(shard, bias, transposed=transposed)
        assert (w.weight_t.is_contiguous() if transposed else w.weight_t.t().is_contiguous())
        assert w.weight_t.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
        torch.testing.assert_close(torch_linear(x, w), want, atol=1e-5, rtol=1e-5)
    view = prepare_torch_linear(shard, bias, copy=False)
    assert view.weight_t.data_ptr() == shard.data_ptr()
    torch.testing.assert_close(torch_linear(x, view), want, atol=1e-5, rtol=1e-5)
