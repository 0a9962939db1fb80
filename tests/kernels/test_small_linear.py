"""The Triton small-batch projections (kernels/triton/small_linear.py) against the unfused ops they
replace (the reference projection, RMSNorm with the residual add, SiLU-and-mul), for every variant (plain,
bias, the norm with and without a residual, gated), W kept either way, rows from 1 to SMALL_ROWS,
widths that are not multiples of the tiles; under TRITON_INTERPRET=1 on CPU, on CUDA when present."""

import pytest
import torch

from kernels.reference import ops
from kernels.triton import elementwise
from kernels.triton.small_linear import SMALL_ROWS, small_linear
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, randn

ROWS = [1, 3, SMALL_ROWS]
DTYPE_IDS = [str(dtype).removeprefix("torch.") for dtype in DTYPES]  # the GPU check runs the bfloat16 ones
# (in, out): one K tile and a ragged out; several K tiles with a ragged last (tiles of 128 or 256)
SHAPES = [(96, 80), (300, 40)]


def rounds_as_torch(dtype) -> bool:
    """Whether Triton rounds to dtype as torch does here: Triton's interpreter truncates float32 to
    bfloat16 (the GPU rounds to nearest), and the fused kernels round several times on the way, so on
    the CPU their bfloat16 results are held to the unfused Triton kernels' (rounded alike) alone."""
    return DEVICE == "cuda" or dtype != torch.bfloat16


def _weight(k: int, n: int, dtype, transposed: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(W [n, k], W^T as small_linear reads it: contiguous, or a transposed view of W)."""
    weight = randn(n, k, dtype=dtype, seed=seed) * 0.1
    return weight, (weight.t().contiguous() if transposed else weight.t())


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_small_linear_equals_the_projection(dtype, rows, shape, transposed):
    k, n = shape
    x, bias = randn(rows, k, dtype=dtype), randn(n, dtype=dtype, seed=3)
    weight, weight_t = _weight(k, n, dtype, transposed, seed=1)
    out, residual = small_linear(x, weight_t)
    assert residual is None and out.shape == (rows, n) and out.dtype == dtype
    assert_close(out, ops.linear_ref(x, weight, None), dtype)
    out, _ = small_linear(x, weight_t, bias)
    assert_close(out, ops.linear_ref(x, weight, bias), dtype)


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_small_linear_with_the_norm_fused_equals_norm_then_projection(dtype, rows, with_residual, transposed):
    k, n = SHAPES[1]
    x, residual_in = randn(rows, k, dtype=dtype), randn(rows, k, dtype=dtype, seed=2)
    norm, bias = randn(k, dtype=dtype, seed=4), randn(n, dtype=dtype, seed=5)
    weight, weight_t = _weight(k, n, dtype, transposed, seed=1)
    residual = residual_in if with_residual else None
    out, new_residual = small_linear(x, weight_t, bias, residual=residual, norm_weight=norm, eps=1e-5)
    normed, expected_residual = elementwise.add_rms_norm(x, residual, norm, 1e-5)
    # the residual stream as the RMSNorm kernel leaves it, bit for bit; without a residual, x itself (as
    # the layer loop's first layer keeps it)
    if with_residual:
        assert torch.equal(new_residual, expected_residual)
    else:
        assert new_residual is x
    assert_close(out, ops.linear_ref(normed, weight, bias), dtype)
    if rounds_as_torch(dtype):
        ref_normed, ref_residual = (ops.add_rms_norm_ref(x, residual, norm, 1e-5) if with_residual
                                    else (ops.rms_norm_ref(x, norm, 1e-5), x))
        assert_close(out, ops.linear_ref(ref_normed, weight, bias), dtype)
        assert_close(new_residual, ref_residual, dtype)
    assert torch.equal(x, randn(rows, k, dtype=dtype)), "the input was written"


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_small_linear_gated_equals_projection_then_silu_and_mul(dtype, rows, transposed):
    k, intermediate = SHAPES[1][0], 40
    x, residual = randn(rows, k, dtype=dtype), randn(rows, k, dtype=dtype, seed=2)
    norm, bias = randn(k, dtype=dtype, seed=4), randn(2 * intermediate, dtype=dtype, seed=5)
    weight, weight_t = _weight(k, 2 * intermediate, dtype, transposed, seed=1)
    out, new_residual = small_linear(x, weight_t, bias, residual=residual, norm_weight=norm, eps=1e-6, gated=True)
    assert out.shape == (rows, intermediate)
    # the unfused Triton pair: RMSNorm with the residual add, the projection, SiLU-and-mul
    normed, expected_residual = elementwise.add_rms_norm(x, residual, norm, 1e-6)
    assert torch.equal(new_residual, expected_residual)
    assert_close(out, elementwise.silu_and_mul(ops.linear_ref(normed, weight, bias)), dtype)
    if rounds_as_torch(dtype):
        normed, expected_residual = ops.add_rms_norm_ref(x, residual, norm, 1e-6)
        assert_close(out, ops.silu_and_mul_ref(ops.linear_ref(normed, weight, bias)), dtype)
    out, _ = small_linear(x, weight_t, gated=True)
    assert_close(out, elementwise.silu_and_mul(ops.linear_ref(x, weight, None)), dtype)
    if rounds_as_torch(dtype):
        assert_close(out, ops.silu_and_mul_ref(ops.linear_ref(x, weight, None)), dtype)


def test_small_linear_is_the_same_bits_every_run():
    # one fixed summation order (no split-K partials, no atomics): graphs and eager steps agree
    x, residual, norm = randn(5, 300, dtype=torch.bfloat16), randn(5, 300, seed=2), randn(300, seed=4)
    _, weight_t = _weight(300, 2 * 40, torch.bfloat16, False, seed=1)
    runs = [small_linear(x, weight_t, residual=residual.to(x.dtype), norm_weight=norm.to(x.dtype), eps=1e-5,
                         gated=True)[0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("case, message", [
    (dict(rows=0), "1 to 16 rows"),
    (dict(rows=SMALL_ROWS + 1), "1 to 16 rows"),
    (dict(k_weight=95), "for W\\^T"),
    (dict(n=81, gated=True), "even width"),
    (dict(bias=79), "bias"),
    (dict(norm=95), "norm weight"),
    (dict(residual=True), "needs a norm"),
])
def test_small_linear_names_what_does_not_fit(case, message):
    k, n = 96, case.get("n", 80)
    x = randn(case.get("rows", 2), k)
    weight_t = randn(case.get("k_weight", k), n)
    kwargs = {"gated": case.get("gated", False)}
    if "bias" in case:
        kwargs["bias"] = randn(case["bias"])
    if "norm" in case:
        kwargs["norm_weight"] = randn(case["norm"])
    if "residual" in case:
        kwargs["residual"] = randn(*x.shape)
    with pytest.raises(ValueError, match=message):
        small_linear(x, weight_t, **kwargs)
