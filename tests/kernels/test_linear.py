"""Dense projections on the CPU backend (kernels/cpu/linear.py): the oneDNN-prepacked path (CPU
float32 and bfloat16), the AMX kernel (bfloat16 decode batches on CPUs with AMX), the AVX512-BF16
kernel (bfloat16 batches on CPUs without AMX), the float32 kernel (float32 decode batches on CPUs
with AVX-512), the float32 gate/up kernel (a gated MLP's first half, its activation fused, on CPUs
with AVX-512) and the BLAS path on W^T (other dtypes), a contiguous copy or a view, against
F.linear and a float64 oracle, from one row to prefill-sized batches.

Which compiled kernels run is the backend's own probes' answer (CPU.projections.has_*): where a
probe says a kernel is absent, each test checks what that means (no copy of W for it, no call to
it, the result still right) instead of skipping."""

import functools

import pytest
import torch

from kernels.cpu.linear import Linear, ProjectionKernels, can_prepack
from kernels.reference.ops import linear_ref, silu_and_mul_ref
from tests.kernels.conftest import DTYPES, assert_close
from tests.kernels.conftest import randn as _randn
from tests.kernels.ops import CPU

# The projections under test are the CPU's (oneDNN and the compiled small-batch kernels): their
# inputs stay on the CPU also where there is a GPU.
randn = functools.partial(_randn, device="cpu")
KERNELS = CPU.projections
prepare_linear = CPU.prepare_linear
linear = CPU.linear
linear_silu_and_mul = CPU.gate_up_silu

ROWS = [1, 7, 64, 256, 257, 700, 2048]


def oracle(x, weight, bias):
    out = x.double() @ weight.double().t()
    return out + bias.double() if bias is not None else out


def assert_within_any_float32_sum(got, x, weight, bias=None) -> None:
    """got within the error bound of a float32 x W^T + b summed in any order (n u / (1 - n u) times
    the sum of the terms' magnitudes, n = the inputs, the bias and the output's rounding): what
    oneDNN's float32 path is held to where no compiled kernel (with its tighter bound, 4x
    F.linear's worst error) takes the batch."""
    n, u = x.shape[1] + 2, 2.0**-24
    magnitude = x.double().abs() @ weight.double().abs().t()
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    error = (got.double() - oracle(x, weight, bias)).abs()
    assert bool((error <= n * u / (1 - n * u) * magnitude + 1e-30).all()), error.max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_reference(rows, with_bias, dtype):
    weight = randn(96, 160, dtype=dtype, seed=1) * 0.1
    bias = randn(96, dtype=dtype, seed=2) if with_bias else None
    x = randn(rows, 160, dtype=dtype, seed=3)
    expected = oracle(x, weight, bias)
    assert_close(linear_ref(x, weight, bias), expected, dtype)
    for copy in (True, False):
        got = linear(x, prepare_linear(weight, bias, copy=copy))
        assert got.shape == (rows, 96) and got.dtype == dtype
        assert_close(got, expected, dtype)


@pytest.mark.parametrize("rows", [1, 5, 64, 259])
def test_lm_head_without_a_copy_serves_any_number_of_rows(rows):
    weight = randn(3000, 64, seed=4) * 0.1  # an LM head: many outputs
    head = prepare_linear(weight, copy=False)
    if can_prepack(weight):
        assert head.weight_t is None and head.packed is not None
    else:
        assert head.packed is None and head.weight_t.data_ptr() == weight.data_ptr()  # a view, no copy
    x = randn(rows, 64, seed=5)
    assert_close(linear(x, head), oracle(x, weight, None), torch.float32)


def test_cpu_float32_is_prepacked_and_other_dtypes_use_blas():
    weight = randn(32, 48, seed=6).cpu()  # the torch wheels this project pins all carry oneDNN
    assert can_prepack(weight)
    packed = prepare_linear(weight)
    assert packed.packed is not None and packed.weight_t is None
    bf16 = prepare_linear(weight.to(torch.bfloat16))
    if KERNELS.has_bf16 and not KERNELS.has_amx:  # the bfloat16 kernel's copy in place of oneDNN's
        assert bf16.packed is None and bf16.weight_t is None and bf16.bf16 is not None
    elif torch.ops.mkldnn._is_mkldnn_bf16_supported():  # oneDNN has a bfloat16 path on this CPU
        assert bf16.packed is not None and bf16.weight_t is None
    else:
        assert bf16.packed is None and bf16.weight_t.is_contiguous()
    assert prepare_linear(weight.double()).packed is None
    # A strided input still works (the packed path needs rows contiguous).
    x = randn(10, 96, seed=7).cpu()[:, ::2]
    assert_close(linear(x, packed), oracle(x, weight, None), torch.float32)


def test_linear_rejects_mismatched_shapes():
    w = prepare_linear(randn(8, 16))
    with pytest.raises(ValueError, match="linear"):
        linear(randn(3, 15), w)
    with pytest.raises(ValueError, match="prepare_linear"):
        prepare_linear(randn(8, 16), randn(7))


def _spy_rows(monkeypatch, *entries: str) -> list:
    """The row counts ProjectionKernels._run_kernel runs any of entries on, in order, from now on
    (every compiled projection call goes through it, named by its entry point)."""
    calls, real = [], ProjectionKernels._run_kernel

    def spy(self, entry, x, *args):
        if entry in entries:
            calls.append(x.shape[0])
        return real(self, entry, x, *args)

    monkeypatch.setattr(ProjectionKernels, "_run_kernel", spy)
    return calls


@pytest.fixture
def amx_calls(monkeypatch) -> list:
    """The row counts the AMX kernel ran on, in order."""
    return _spy_rows(monkeypatch, "amx_linear_bf16")


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32, 33, 48, 63, 64])
@pytest.mark.parametrize(("out_features", "in_features"), [(17, 32), (40, 64), (96, 160), (100, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_decode_batches_take_the_amx_kernel(rows, out_features, in_features, with_bias, amx_calls):
    """Each output is the float64 product rounded once to bfloat16 (within half a unit in the last
    place): odd output counts, row counts that leave a partial 16-row tile, x's rows strided."""
    weight = randn(out_features, in_features, dtype=torch.bfloat16, seed=11)
    bias = randn(out_features, dtype=torch.bfloat16, seed=12) if with_bias else None
    x = randn(rows, in_features + 8, dtype=torch.bfloat16, seed=13)[:, :in_features]
    w = prepare_linear(weight, bias)
    assert (w.amx is not None) == KERNELS.has_amx
    got = linear(x, w)
    assert amx_calls == ([rows] if KERNELS.has_amx else [])
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), oracle(x, weight, bias), atol=1e-4, rtol=2**-8)


def test_amx_copy_only_where_it_is_used(amx_calls):
    """Batches over 64 rows and inputs not a multiple of 32 stay on oneDNN; a prefill-only engine's
    weights (small_batches=False) have no AMX copy."""
    weight = randn(48, 64, dtype=torch.bfloat16, seed=14)
    x = randn(65, 64, dtype=torch.bfloat16, seed=15)
    assert_close(linear(x, prepare_linear(weight)), oracle(x, weight, None), torch.bfloat16)
    assert amx_calls == []
    assert prepare_linear(weight, small_batches=False).amx is None
    odd = randn(48, 40, dtype=torch.bfloat16, seed=16)
    assert prepare_linear(odd).amx is None
    assert prepare_linear(weight.float()).amx is None
    x = randn(3, 40, dtype=torch.bfloat16, seed=17)
    assert_close(linear(x, prepare_linear(odd)), oracle(x, odd, None), torch.bfloat16)


@pytest.fixture
def bf16_calls(monkeypatch) -> list:
    """The row counts the AVX512-BF16 kernel ran on (either of its entries), in order."""
    return _spy_rows(monkeypatch, "bf16_linear", "bf16_linear_wide")


@pytest.fixture(params=[False, True], ids=["vdpbf16ps", "widened"])
def bf16_entry(request, monkeypatch) -> bool:
    """Both of the bfloat16 kernel's entries, whichever this CPU takes (ProjectionKernels.bf16_widens)."""
    monkeypatch.setattr(KERNELS, "bf16_widens", request.param)
    monkeypatch.setattr(KERNELS, "bf16_entry", "bf16_linear_wide" if request.param else "bf16_linear")
    return request.param


class _MeasuredLibrary:
    """CPU.lib with bf16_linear_dot_ratio() giving `ratio`: what ProjectionKernels decides from it."""

    def __init__(self, lib, ratio: float) -> None:
        self._lib, self._ratio = lib, ratio

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def bf16_linear_dot_ratio(self) -> float:
        return self._ratio


def test_the_bfloat16_kernels_entry_is_chosen_by_measurement():
    """Where the kernel builds, its entry follows vdpbf16ps's measured rate against FMAs'; where
    it does not (no AVX512-BF16: the library has neither entry nor the measurement), nothing is
    measured and the kernel is absent."""
    kernels = ProjectionKernels(CPU.lib)  # measured afresh
    if not kernels.has_bf16:
        assert kernels.bf16_widens is False and kernels.bf16_entry == "bf16_linear"
        assert kernels.prepare(randn(48, 64, dtype=torch.bfloat16)).bf16 is None
        return
    ratio = CPU.lib.bf16_linear_dot_ratio()
    assert 0.05 < ratio < 20
    widens = kernels.bf16_widens
    assert isinstance(widens, bool)
    assert kernels.bf16_entry == ("bf16_linear_wide" if widens else "bf16_linear")
    slow, fast = ProjectionKernels(_MeasuredLibrary(CPU.lib, 0.3)), ProjectionKernels(_MeasuredLibrary(CPU.lib, 2.0))
    assert slow.bf16_widens is True and slow.bf16_entry == "bf16_linear_wide"
    assert fast.bf16_widens is False and fast.bf16_entry == "bf16_linear"


class _LibraryWithoutBf16:
    """A kernel library built without AVX512-BF16: it says so (bf16_linear_ready() == 0) and has
    neither entry nor bf16_linear_dot_ratio (nor any other kernel)."""

    limits = {"panel": 48, "gate_up_half": 32, "small_batch_rows": 64}

    def has(self, name: str) -> bool:
        return name == "bf16_linear_ready"

    def __getattr__(self, name):
        if name == "bf16_linear_ready":
            return lambda: 0
        raise AttributeError(f"undefined symbol: {name}")


def test_nothing_is_measured_without_avx512_bf16():
    """A kernel library built without AVX512-BF16 says so (bf16_linear_ready() == 0) and has
    neither entry nor bf16_linear_dot_ratio: bf16_widens is False without looking for them."""
    kernels = ProjectionKernels(_LibraryWithoutBf16())
    assert kernels.bf16_widens is False and not kernels.has_bf16


def _bf16_kernel_only(weight, bias) -> Linear:
    """The weight as prepare_linear gives it on a CPU with AVX512-BF16 and no AMX: the kernel's
    copy alone, which takes every batch size (so that CPUs with AMX test the kernel too)."""
    return Linear(None, None, bias, weight.shape[1], weight.shape[0],
                  bias_f32=None if bias is None else bias.float(), bf16=KERNELS.pack_bf16_pairs(weight))


@pytest.mark.parametrize("rows", [1, 3, 7, 8, 9, 16, 31, 63, 64, 65, 72, 129, 256, 700])
@pytest.mark.parametrize(("out_features", "in_features"),
                         [(17, 32), (48, 64), (100, 160), (130, 576), (49, 6), (50, 1538), (800, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_batches_on_the_avx512_bf16_kernel(rows, out_features, in_features, with_bias, bf16_calls,
                                                    bf16_entry):
    """Each output is the float64 product rounded once to bfloat16 (within half a unit in the last
    place), on the decode path (up to 64 rows) and the blocked one (more: 128-row blocks, input
    blocks of at most 256 inputs, running totals carried between them; bf16_linear.c): odd output
    counts (a partial 48-output panel, a partial 16-lane vector), row counts that leave a partial
    8-row group or row block, one input block or several (576 in 3 x 192, 1,538 in 7), 17 panels
    (a group of 16 and a partial group of one), x's rows strided; vdpbf16ps and widened pairs
    (6 and 1,538 inputs: a partial 16-input vector in the widening). Without AVX512-BF16 the
    kernel is absent: prepare_linear makes no copy for it, nothing calls it, and the product is
    still right."""
    weight = randn(out_features, in_features, dtype=torch.bfloat16, seed=31)
    bias = randn(out_features, dtype=torch.bfloat16, seed=32) if with_bias else None
    x = randn(rows, in_features + 8, dtype=torch.bfloat16, seed=33)[:, :in_features]
    if not KERNELS.has_bf16:
        w = prepare_linear(weight, bias)
        assert w.bf16 is None
        got = linear(x, w)
        assert bf16_calls == []
        assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
        assert_close(got, oracle(x, weight, bias), torch.bfloat16)
        return
    got = linear(x, _bf16_kernel_only(weight, bias))
    assert bf16_calls == [rows]
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), oracle(x, weight, bias), atol=1e-4, rtol=2**-8)


def test_bfloat16_kernel_alone_takes_any_input_layout(bf16_calls, bf16_entry):
    """With only the kernel's copy: no rows give an empty output; columns strided are copied
    first; a float32 input is refused with a clear error. Without AVX512-BF16 prepare_linear
    gives no such copy, and its weight takes the same inputs without calling the kernel."""
    weight = randn(48, 64, dtype=torch.bfloat16, seed=54)
    if not KERNELS.has_bf16:
        w = prepare_linear(weight, None)
        assert w.bf16 is None and (w.packed is not None or w.weight_t is not None)
    else:
        w = _bf16_kernel_only(weight, None)
    assert linear(randn(0, 64, dtype=torch.bfloat16, seed=55), w).shape == (0, 48)
    x = randn(70, 128, dtype=torch.bfloat16, seed=56)[:, ::2]
    assert_close(linear(x, w), oracle(x, weight, None), torch.bfloat16)
    assert bf16_calls == ([70] if KERNELS.has_bf16 else [])
    if KERNELS.has_bf16:
        with pytest.raises(RuntimeError, match="bfloat16 input on the CPU"):
            linear(randn(3, 64, dtype=torch.float32, seed=57), w)


def test_bfloat16_small_batch_copy_by_cpu(bf16_calls, amx_calls):
    """A decoding engine's bfloat16 weights get the AMX copy where the build has AMX (batches over
    64 rows and prefill-only engines stay on oneDNN there); where it has AVX512-BF16 and no AMX,
    the AVX512-BF16 kernel's copy takes oneDNN's place, for every batch size, LM-head-sized
    outputs too, on prefill-only engines as well. Odd inputs stay on oneDNN (where oneDNN has a
    bfloat16 path; else on BLAS)."""
    weight = randn(48, 64, dtype=torch.bfloat16, seed=34)
    w = prepare_linear(weight)
    only_kernel = KERNELS.has_bf16 and not KERNELS.has_amx
    assert (w.amx is not None) == KERNELS.has_amx
    assert (w.bf16 is not None) == only_kernel
    assert (w.packed is not None) == (can_prepack(weight) and not only_kernel)
    for rows in (5, 65):
        x = randn(rows, 64, dtype=torch.bfloat16, seed=35 + rows)
        assert_close(linear(x, w), oracle(x, weight, None), torch.bfloat16)
    assert bf16_calls == ([5, 65] if only_kernel else [])
    assert (prepare_linear(weight, small_batches=False).bf16 is not None) == only_kernel
    assert prepare_linear(weight, small_batches=False).amx is None
    _check_wide(randn(4097, 32, dtype=torch.bfloat16, seed=37), bf16_calls, lambda w: w.bf16,
                only_kernel, max_rows=64, kernel_takes_more=only_kernel)
    odd_weight = randn(48, 7, dtype=torch.bfloat16, seed=38)
    odd = prepare_linear(odd_weight)
    assert odd.bf16 is None and (odd.packed is not None) == can_prepack(odd_weight)
    assert prepare_linear(weight.float()).bf16 is None


@pytest.fixture
def f32_calls(monkeypatch) -> list:
    """The row counts the float32 small-batch kernel ran on, in order."""
    return _spy_rows(monkeypatch, "f32_linear")


@pytest.mark.parametrize("rows", [1, 3, 7, 8, 9, 16, 31, 63, 64])
@pytest.mark.parametrize(("out_features", "in_features"), [(17, 32), (48, 64), (100, 160), (130, 576), (49, 7)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_decode_batches_take_the_float32_kernel(rows, out_features, in_features, with_bias, f32_calls):
    """Against the float64 product, as accurate as F.linear in float32 (within 4x its worst
    error): odd output counts (a partial 48-output panel, a partial 16-lane vector), row counts
    that leave a partial 8-row group, odd input counts, x's rows strided. Without the kernel (the
    probe) there is no copy for it and oneDNN serves the batch, within any float32 summation's
    error bound (the 4x bound is the kernel's: oneDNN's AVX2 path measured 4.3x on one row of
    130 x 576)."""
    weight = randn(out_features, in_features, dtype=torch.float32, seed=21)
    bias = randn(out_features, dtype=torch.float32, seed=22) if with_bias else None
    x = randn(rows, in_features + 8, dtype=torch.float32, seed=23)[:, :in_features]
    w = prepare_linear(weight, bias)
    assert (w.f32 is not None) == KERNELS.has_f32
    got = linear(x, w)
    assert f32_calls == ([rows] if KERNELS.has_f32 else [])
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    exact = oracle(x, weight, bias)
    if not KERNELS.has_f32:
        assert_within_any_float32_sum(got, x, weight, bias)
        return
    reference_error = (linear_ref(x, weight, bias).double() - exact).abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 4 * reference_error + 1e-6


@pytest.mark.parametrize("num_groups", range(1, 9))
@pytest.mark.parametrize("num_w_rows", [1, 5, 32, 576, 1536])
def test_row_groups_prefetch_the_whole_next_panel_once(num_groups, num_w_rows):
    """The small-batch kernels' row groups after the first fetch the next panel's 3 lines a W row
    between them (panels.h): with more than four groups every line once, in order, spread evenly
    over all of them; with fewer, one line a W row in groups 1-3, as many thirds as there are.
    Every built level has the plan; a CPU without any (no compiled kernels) has no small-batch
    kernel to run it."""
    if CPU.lib is None:
        assert not (KERNELS.has_f32 or KERNELS.has_bf16 or KERNELS.has_amx)
        return
    first = torch.zeros(num_groups, dtype=torch.int64)
    count = torch.zeros(num_groups, dtype=torch.int64)
    assert CPU.lib.next_panel_plan(num_groups, num_w_rows, first, count) == 0
    lines = [list(range(f, f + c)) for f, c in zip(first.tolist(), count.tolist())]
    assert lines[0] == []
    fetched = [line for group in lines for line in group]
    if num_groups > 4:
        assert fetched == list(range(3 * num_w_rows))
        assert max(count.tolist()[1:]) - min(count.tolist()[1:]) <= 1
    else:
        assert fetched == list(range((num_groups - 1) * num_w_rows))


def test_float32_copy_only_where_it_is_used(f32_calls):
    """Batches over 64 rows (over 32 for LM-head-sized outputs) and prefill-only engines stay on
    oneDNN."""
    weight = randn(48, 64, dtype=torch.float32, seed=24)
    x = randn(65, 64, dtype=torch.float32, seed=25)
    assert_close(linear(x, prepare_linear(weight)), oracle(x, weight, None), torch.float32)
    assert f32_calls == []
    assert prepare_linear(weight, small_batches=False).f32 is None
    _check_wide(randn(4097, 32, dtype=torch.float32, seed=26), f32_calls, lambda w: w.f32, KERNELS.has_f32,
                max_rows=32)
    assert prepare_linear(weight.bfloat16()).f32 is None


def _check_wide(weight: torch.Tensor, calls: list, copy_of, expect_copy: bool, max_rows: int,
                kernel_takes_more: bool = False) -> None:
    """An LM-head-sized weight: its small-batch copy takes max_rows rows, oneDNN one more (or the
    kernel too, with kernel_takes_more)."""
    w = prepare_linear(weight)
    assert (copy_of(w) is not None) == expect_copy
    calls.clear()
    for rows in (max_rows, max_rows + 1):
        x = randn(rows, weight.shape[1], dtype=weight.dtype, seed=rows)
        assert_close(linear(x, w), oracle(x, weight, None), weight.dtype)
    expected = [max_rows, max_rows + 1] if kernel_takes_more else [max_rows]
    assert calls == (expected if expect_copy else [])


def test_only_a_cpu_input_reaches_the_compiled_kernels(bf16_calls, amx_calls, f32_calls):
    """The kernels read x through its address: an x on another device (meta here; CUDA on a GPU
    machine) goes to torch, not to a kernel that would read device memory as host memory."""
    for dtype in (torch.bfloat16, torch.float32):
        weight = randn(48, 64, dtype=dtype, seed=40)
        w = prepare_linear(weight)
        if dtype == torch.bfloat16 and KERNELS.has_bf16:
            w = _bf16_kernel_only(weight, None)
        x = torch.empty(8, 64, dtype=dtype, device="meta")
        if w.packed is not None or w.weight_t is None:  # oneDNN's, or the bfloat16 kernel's alone: refused
            with pytest.raises(RuntimeError, match="CPU"):
                linear(x, w)
        else:
            assert linear(x, w).shape == (8, 48)
        linear(randn(8, 64, dtype=dtype, seed=41), w)  # the same weight on a CPU x takes its kernel
    assert bf16_calls + amx_calls == ([8] if KERNELS.has_bf16 or KERNELS.has_amx else [])
    assert f32_calls == ([8] if KERNELS.has_f32 else [])


def _product_error(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[float, float]:
    """got's worst error against the float64 product x W^T, and the float32 reference path's."""
    exact = oracle(x, weight, None)
    return (got.double() - exact).abs().max().item(), (linear_ref(x, weight).double() - exact).abs().max().item()


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 65, 100, 252, 253, 600])
@pytest.mark.parametrize(("inter", "in_features"), [(32, 64), (37, 65), (70, 130), (96, 576), (1, 7)])
@pytest.mark.parametrize("small_batches", [True, False])
def test_gate_up_kernel_fuses_silu_and_mul(rows, inter, in_features, small_batches, gate_up_calls):
    """A gated MLP's stacked gate and up weights: gate_up_silu equals silu(x Wg^T) * (x Wu^T) and
    linear the plain projection, the product as accurate as the float32 reference path (within 4x
    its worst error) and the activation within 8 float32 epsilons of silu and mul of it: odd
    intermediate sizes (a partial 32-output panel, a partial 16-lane vector), row counts that
    leave a partial 6-row tile and cross the 252-row blocks, odd input counts (a partial 64-input
    chunk), x's rows strided. Without the kernel (the probe) oneDNN serves both,
    within any float32 summation's error bound, the activation SiLU-and-mul of its product."""
    weight = randn(2 * inter, in_features, dtype=torch.float32, seed=50) * 0.2
    x = randn(rows, in_features + 8, dtype=torch.float32, seed=51)[:, :in_features]
    w = prepare_linear(weight, gate_up=True, small_batches=small_batches)
    assert (w.gate_up is not None) == KERNELS.has_gate_up
    assert (w.packed is None) == KERNELS.has_gate_up  # the kernel's copy in place of oneDNN's
    # the float32 small-batch kernel takes the decode-sized batches where the weight has its copy
    small_batch = small_batches and KERNELS.has_f32 and rows <= KERNELS.small_batch_rows
    takes = KERNELS.has_gate_up and not small_batch
    act = linear_silu_and_mul(x, w)
    assert act.shape == (rows, inter) and act.dtype == torch.float32
    both = linear(x, w)
    assert both.shape == (rows, 2 * inter)
    assert gate_up_calls == ([(rows, True), (rows, False)] if takes else [])
    if not (takes or small_batch):  # oneDNN's product, then SiLU-and-mul on it (the 4x bound is the kernels')
        assert_within_any_float32_sum(both, x, weight)
        assert_close(act, silu_and_mul_ref(both), torch.float32)
        return
    error, reference_error = _product_error(both, x, weight)
    assert error <= 4 * reference_error + 1e-6
    # The activation on that product: silu(g) * u of the kernel's own sums, within 8 float32 epsilons
    # of it (its exp, divide and multiply). Compared with the exact product instead, the product's
    # own error, scaled by u and silu'(g), would be judged against the reference's luck.
    own = silu_and_mul_ref(both.double())
    assert bool(((act.double() - own).abs() <= 8 * torch.finfo(torch.float32).eps * own.abs() + 1e-30).all())


def test_gate_up_copy_only_for_float32_without_bias(gate_up_calls):
    """A biased gate/up, another dtype or an ordinary projection keep oneDNN's copy; an empty batch
    gives an empty result."""
    weight = randn(64, 32, dtype=torch.float32, seed=52)
    assert prepare_linear(weight, randn(64, dtype=torch.float32, seed=53), gate_up=True).gate_up is None
    assert prepare_linear(weight.bfloat16(), gate_up=True).gate_up is None
    assert prepare_linear(weight).gate_up is None
    w = prepare_linear(weight, gate_up=True)
    assert linear_silu_and_mul(torch.empty(0, 32), w).shape == (0, 32)
    assert linear(torch.empty(0, 32), w).shape == (0, 64)


def test_gate_up_kernel_does_not_take_a_non_cpu_input():
    """An x on another device (meta here) is refused, not read as host memory: by the gate/up
    kernel's path, or by oneDNN's where the build has no gate/up kernel."""
    w = prepare_linear(randn(64, 32, dtype=torch.float32, seed=54), gate_up=True)
    assert (w.gate_up is not None) == KERNELS.has_gate_up
    x = torch.empty(80, 32, dtype=torch.float32, device="meta")
    for run in (linear, linear_silu_and_mul):
        with pytest.raises(RuntimeError, match="CPU"):
            run(x, w)
