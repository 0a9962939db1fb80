"""RMSNorm and the fused residual add: reference vs transformers and per-token math, Triton vs
reference (under TRITON_INTERPRET=1 on CPU, on CUDA when present)."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tests.kernels.conftest import DEVICE, DTYPES, assert_close, gpu, randn, requires_cuda
from tests.kernels.ops import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref

SHAPES = [(1, 64), (7, 96), (33, 256)]


def naive_rms_norm(x, weight, eps):
    out = torch.empty(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        row = x[t].double().cpu()
        out[t] = row / torch.sqrt((row * row).mean() + eps) * weight.double().cpu()
    return out


def transformers_rms_norm(x, weight, eps):
    """transformers' RMSNorm on x's device (bit-equality holds op for op on one device, not across)."""
    norm = LlamaRMSNorm(x.shape[1], eps=eps).to(dtype=weight.dtype, device=x.device)
    norm.weight.data.copy_(weight)
    return norm(x).cpu()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_ref_equals_transformers_bit_for_bit(shape, dtype):
    x, residual = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype, seed=1)
    weight = randn(shape[1], dtype=dtype, seed=2)
    assert torch.equal(rms_norm_ref(x, weight, 1e-5).cpu(), transformers_rms_norm(x, weight, 1e-5))
    normed, new_residual = add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(new_residual.cpu(), (x + residual).cpu())
    assert torch.equal(normed.cpu(), transformers_rms_norm(x + residual, weight, 1e-5))


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_ref_matches_per_token_math(shape):
    x, weight = randn(*shape), randn(shape[1], seed=1)
    torch.testing.assert_close(rms_norm_ref(x, weight, 1e-6).double().cpu(), naive_rms_norm(x, weight, 1e-6),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(3, 1000)])
def test_rms_norm_triton_matches_reference(shape, dtype):
    x, residual = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype, seed=1)
    weight = randn(shape[1], dtype=dtype, seed=2)
    assert_close(rms_norm(x, weight, 1e-6, force_triton=True), rms_norm_ref(x, weight, 1e-6), dtype)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = add_rms_norm(x, residual, weight, 1e-6, force_triton=True)
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        # NOTE: Triton's interpreter truncates float32 -> bfloat16 casts; a GPU rounds to nearest.
        assert_close(new_residual, x + residual, dtype)
    else:
        assert torch.equal(new_residual, x + residual)
    assert_close(normed, rms_norm_ref(x + residual, weight, 1e-6), dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_empty_batch_and_cpu_dispatch():
    x, weight = randn(0, 64), randn(64)
    assert rms_norm(x, weight, 1e-6, force_triton=True).shape == (0, 64)
    assert add_rms_norm(x, x, weight, 1e-6, force_triton=True)[0].shape == (0, 64)
    if DEVICE == "cpu":  # float16 on CPU takes the reference itself (the C kernels: float32, bfloat16)
        x, weight = randn(5, 64, dtype=torch.float16), randn(64, dtype=torch.float16)
        assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, hidden", [(1, 64), (7, 576), (300, 960)])
def test_cpu_kernel_matches_reference(num_tokens, hidden, dtype):
    """The compiled one-pass CPU kernel (float32, bfloat16) against the reference, with and
    without the residual, on rows with a stride wider than the row (a view into a wider
    buffer). The residual sum rounds as torch's add does: bit-equal in both dtypes."""
    wide = randn(num_tokens, hidden + 32, seed=1).cpu().to(dtype) * 3
    x, residual = wide[:, :hidden], randn(num_tokens, hidden, seed=2).cpu().to(dtype)
    weight = randn(hidden, seed=3).cpu().to(dtype)
    got = rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype
    assert_close(got, rms_norm_ref(x, weight, 1e-6), dtype)
    out, new_residual = add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, ref_residual)
    assert_close(out, ref_out, dtype)
    assert torch.equal(x, wide[:, :hidden]) and x.stride(0) == hidden + 32  # inputs untouched


def test_rms_norm_rejects_mismatched_weight():
    with pytest.raises(ValueError, match="rms_norm"):
        rms_norm(randn(3, 64), randn(32), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(randn(3, 64), randn(2, 64), randn(64), 1e-6)


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_cuda_large_hidden(dtype):
    x, residual = randn(257, 8192, dtype=dtype), randn(257, 8192, dtype=dtype, seed=1)
    weight = randn(8192, dtype=dtype, seed=2)
    normed, new_residual = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, x + residual)
    assert_close(normed, rms_norm_ref(x + residual, weight, 1e-5), dtype)
