"""SiLU-and-mul: reference vs per-token math, Triton vs the same math."""

import pytest
import torch

from tests.kernels.conftest import DTYPES, assert_close, gpu, randn, requires_cuda
from tests.kernels.ops import silu_and_mul, silu_and_mul_ref


def naive_silu_and_mul(x):
    half = x.shape[1] // 2
    out = torch.empty(x.shape[0], half, dtype=torch.float64)
    for t in range(x.shape[0]):
        gate, up = x[t, :half].double().cpu(), x[t, half:].double().cpu()
        out[t] = gate / (1 + torch.exp(-gate)) * up
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, intermediate", [(1, 64), (5, 96), (17, 1500)])
def test_silu_and_mul_reference_and_triton_match_per_token_math(num_tokens, intermediate, dtype):
    x = randn(num_tokens, 2 * intermediate, dtype=dtype)
    naive = naive_silu_and_mul(x)
    assert_close(silu_and_mul_ref(x), naive, dtype)
    got = silu_and_mul(x, force_triton=True)
    assert got.shape == (num_tokens, intermediate) and got.dtype == dtype
    assert_close(got, naive, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, intermediate", [(1, 8), (9, 1536), (130, 100)])
def test_silu_and_mul_cpu_kernel_matches_reference(num_tokens, intermediate, dtype):
    """The compiled CPU kernel (float32, bfloat16 on CPU) against the reference, including large
    magnitudes (exp overflow and underflow) and a row stride wider than the row."""
    wide = randn(num_tokens, 2 * intermediate + 16, seed=4).cpu() * 4
    wide[0, :4] = torch.tensor([-200.0, 200.0, -90.0, 90.0])
    x = wide[:, : 2 * intermediate].to(dtype)
    got = silu_and_mul(x)
    assert got.shape == (num_tokens, intermediate) and got.dtype == dtype and torch.isfinite(got).all()
    assert_close(got, silu_and_mul_ref(x), dtype)


def test_silu_and_mul_empty_and_odd_width():
    assert silu_and_mul(randn(0, 64), force_triton=True).shape == (0, 32)
    with pytest.raises(ValueError, match="silu_and_mul"):
        silu_and_mul(randn(2, 63))


@gpu
@requires_cuda
def test_silu_and_mul_cuda_llama_width():
    x = randn(300, 2 * 14336, dtype=torch.bfloat16)
    assert_close(silu_and_mul(x), silu_and_mul_ref(x), torch.bfloat16)
