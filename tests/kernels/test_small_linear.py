"""The Triton small-batch projections (kernels/triton/small_linear.py) against the unfused ops they
replace (the reference projection, RMSNorm with the residual add, SiLU-and-mul, rotary with the KV
write), for every variant (plain, bias, the norm with and without a residual, gated, QKV with rotary),
W kept either way, rows from 1 to SMALL_ROWS, widths that are not multiples of the tiles; under
TRITON_INTERPRET=1 on CPU, on CUDA when present."""

import pytest
import torch

from kernels.reference import ops
from kernels.triton import elementwise
from kernels.triton.small_linear import SMALL_ROWS, qkv_rotary_fits, small_linear, small_qkv_rotary
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
    (dict(bias=160, strided=True), "bias .* contiguous"),
    (dict(norm=192, strided=True), "norm weight .* contiguous"),
])
def test_small_linear_names_what_does_not_fit(case, message):
    k, n = 96, case.get("n", 80)
    x = randn(case.get("rows", 2), k)
    weight_t = randn(case.get("k_weight", k), n)
    kwargs = {"gated": case.get("gated", False)}
    step = 2 if case.get("strided") else 1  # every other value of twice as many: the right shape, not contiguous
    if "bias" in case:
        kwargs["bias"] = randn(case["bias"])[::step]
    if "norm" in case:
        kwargs["norm_weight"] = randn(case["norm"])[::step]
    if "residual" in case:
        kwargs["residual"] = randn(*x.shape)
    with pytest.raises(ValueError, match=message):
        small_linear(x, weight_t, **kwargs)


@pytest.mark.parametrize("with_residual, with_bias", [(False, False), (True, True)], ids=["first-layer", "qwen2"])
@pytest.mark.parametrize("heads", [(4, 2, 64), (8, 1, 32), (6, 2, 128)], ids=["gqa2-d64", "gqa8-d32", "gqa3-d128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_small_qkv_rotary_is_the_projection_then_rotary_and_the_kv_write(dtype, heads, with_residual, with_bias):
    """The same bits as small_linear then rotary_and_write_kv: each output column is the same sum in
    the same order, rotated and rounded as the rotary kernel does; a slot of -1 writes nothing."""
    num_heads, num_kv_heads, head_dim = heads
    rows, k, block_size, num_blocks = 5, 96, 16, 12
    width = (num_heads + 2 * num_kv_heads) * head_dim
    x, norm = randn(rows, k, dtype=dtype), randn(k, dtype=dtype, seed=4)
    residual = randn(rows, k, dtype=dtype, seed=2) if with_residual else None
    bias = randn(width, dtype=dtype, seed=5) if with_bias else None
    _, weight_t = _weight(k, width, dtype, False, seed=1)
    cos_sin = ops.rotary_cos_sin_cache(head_dim, 256, 10000.0, None, torch.float32).to(dtype=dtype, device=x.device)
    positions = torch.tensor([3, 17, 0, 99, 250], device=x.device)
    slots = torch.tensor([5, 40, -1, 100, 191], device=x.device)
    cache = randn(num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=dtype, seed=6)
    expected_cache = cache.clone()
    query, new_residual = small_qkv_rotary(x, weight_t, bias, residual=residual, norm_weight=norm, eps=1e-5,
                                           positions=positions, cos_sin_cache=cos_sin, kv_cache_layer=cache,
                                           slot_mapping=slots, num_heads=num_heads, num_kv_heads=num_kv_heads)
    qkv, expected_residual = small_linear(x, weight_t, bias, residual=residual, norm_weight=norm, eps=1e-5)
    q, key, value = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    expected_query = q.reshape(rows, num_heads, head_dim)
    elementwise.rotary_and_write_kv(expected_query, key.reshape(rows, num_kv_heads, head_dim),
                                    value.reshape(rows, num_kv_heads, head_dim), positions, cos_sin, expected_cache,
                                    slots)
    assert torch.equal(query, expected_query)
    assert torch.equal(cache, expected_cache)
    assert torch.equal(new_residual, expected_residual)
    assert not torch.equal(cache, randn(num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=dtype, seed=6))


def test_small_qkv_rotary_takes_only_weights_as_stored_and_heads_of_16():
    x, norm = randn(2, 96), randn(96)
    weight, weight_t = _weight(96, (2 + 2) * 64, torch.float32, False, seed=1)
    assert qkv_rotary_fits(weight_t, 64) and not qkv_rotary_fits(weight.t().contiguous(), 64)
    assert not qkv_rotary_fits(weight_t, 24)
    args = dict(residual=None, norm_weight=norm, eps=1e-5, positions=torch.tensor([1, 2], device=x.device),
                cos_sin_cache=randn(32, 64), kv_cache_layer=randn(4, 2, 16, 1, 64),
                slot_mapping=torch.tensor([1, 2], device=x.device), num_heads=2, num_kv_heads=1)
    small_qkv_rotary(x, weight_t, None, **args)
    with pytest.raises(ValueError, match="small_qkv_rotary"):
        small_qkv_rotary(x, weight.t().contiguous(), None, **args)  # W^T stored: columns are not rows of W
    with pytest.raises(ValueError, match="small_qkv_rotary"):
        small_qkv_rotary(x, weight_t, None, **(args | {"num_kv_heads": 2}))
    with pytest.raises(ValueError, match="small_qkv_rotary"):
        small_qkv_rotary(x, weight_t, None, **(args | {"slot_mapping": torch.tensor([1], device=x.device)}))
    # read at unit stride, and a slot times the cache's block stride in int64
    int32_slots = torch.tensor([1, 2], dtype=torch.int32, device=x.device)
    every_other = torch.tensor([1, 0, 2, 0], device=x.device)[::2]
    for bad in ({"slot_mapping": int32_slots}, {"slot_mapping": every_other}, {"positions": every_other},
                {"norm_weight": randn(192)[::2]}):
        with pytest.raises(ValueError, match="contiguous"):
            small_qkv_rotary(x, weight_t, None, **(args | bad))
    with pytest.raises(ValueError, match="contiguous"):
        small_qkv_rotary(x, weight_t, randn(2 * 4 * 64)[::2], **args)
