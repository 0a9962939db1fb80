"""The greedy LM head (kernels/cpu/greedy_head.py) on float32 heads: its token equals the argmax of
the float32 panel kernel's logits (the order it sums the candidates in) bit for bit, ties included,
on random heads and on heads built so that the int8 screen alone would pick wrong. Where the
backend's build has no greedy head (its "greedy_head" capability: AVX512-BF16 and AVX512-VNNI),
each test checks that prepare_greedy_head builds none, so the engine keeps the logits path there.
bfloat16 heads: test_greedy_head_bf16.py."""

import pytest
import torch

from kernels.cpu import native
from kernels.cpu.backend import CpuBackend
from kernels.cpu.greedy_head import available
from tests.kernels.ops import CPU

KERNELS = CPU.projections
argmax_rows = CPU.argmax
linear = CPU.linear
prepare_linear = CPU.prepare_linear
prepare_greedy_head = CPU.prepare_greedy_head
greedy_head_argmax = CPU.greedy_argmax


def _head(weight: torch.Tensor):
    """The greedy head of weight: built exactly where the backend has the capability."""
    head = prepare_greedy_head(weight, prepare_linear(weight, copy=False))
    assert (head is not None) == ("greedy_head" in CPU.capabilities)
    return head


def _panel_argmax(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The reference: the float32 panel kernel's logits (f32_linear.c), their first maximum."""
    n = weight.shape[0]
    return argmax_rows(KERNELS._run_kernel("f32_linear", x, KERNELS.pack_f32_panels(weight), None, n))


def test_available_exactly_where_the_cpu_has_avx512_bf16_and_vnni():
    """At the backend's level and at every other level this machine runs: the screen is there
    exactly where the level's build has AVX512-BF16 and AVX512-VNNI, and no compiled library
    has none."""
    need = {"avx512_bf16", "avx512_vnni"}
    assert available(KERNELS) == ("greedy_head" in CPU.capabilities)
    assert available(KERNELS) == (CPU.lib is not None and need <= CPU.lib.level.cpu_features)
    for level in native.available_levels():
        backend = CpuBackend("cpu", native.load(level.name))
        assert available(backend.projections) == ("greedy_head" in backend.capabilities) == (
            need <= level.cpu_features), level.name
    assert not available(CpuBackend("cpu", None).projections)


@pytest.mark.parametrize("vocab, hidden", [(49152, 576), (1000, 64), (4999, 130), (47, 8)])
@pytest.mark.parametrize("rows", [1, 7, 8, 33, 64, 70])
def test_token_equals_the_panel_kernels_argmax_on_random_heads(vocab, hidden, rows):
    gen = torch.Generator().manual_seed(vocab * 1000 + hidden * 10 + rows)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.05
    x = torch.randn(rows, hidden, generator=gen) * 3
    head = _head(weight)
    if head is None:
        return
    candidates = torch.empty(rows, dtype=torch.int64)
    got = greedy_head_argmax(x, head, candidates)
    assert torch.equal(got, _panel_argmax(x, weight))
    assert torch.equal(got, argmax_rows(x @ weight.t()))  # random rows: no near-ties either way
    assert bool((candidates >= 1).all()) and int(candidates.max()) < 1000  # the screen narrowed every row
    assert float(candidates.float().mean()) < 64


def test_near_duplicate_outputs_are_decided_by_the_exact_logits():
    """Pairs of outputs a float32 step apart: int8 rounds each pair to one value, so the screen
    cannot order them and only the exact pass can. Broken bounds (or no exact pass) pick the
    wrong one of a pair in about half of the rows."""
    gen = torch.Generator().manual_seed(7)
    hidden, pairs = 256, 500
    base = torch.randn(pairs, hidden, generator=gen) * 0.05
    nudge = torch.randn(pairs, hidden, generator=gen) * 1e-6
    weight = torch.stack([base, base + nudge], dim=1).reshape(2 * pairs, hidden)
    x = torch.randn(40, hidden, generator=gen)
    candidates = torch.empty(40, dtype=torch.int64)
    head = _head(weight)
    if head is None:
        return
    got = greedy_head_argmax(x, head, candidates)
    assert torch.equal(got, _panel_argmax(x, weight))
    assert bool((candidates >= 2).all())  # both of the winning pair went to the exact pass
    assert (got % 2 == 1).any() and (got % 2 == 0).any()  # the exact logits chose either member


@pytest.mark.parametrize("vocab", [1000, 3000])
def test_rows_near_zero_where_bfloat16_flushes_denormals(vocab):
    """x of ~1e-38 (denormal products; vdpbf16ps, for the picked pairs, flushes them to zero): the bound's absolute part
    keeps the true maximum; over the candidate cap (3,000 outputs) the row takes the full head."""
    gen = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, 64, generator=gen) * 0.05
    x = torch.randn(5, 64, generator=gen) * 1e-37
    x[2] *= 1e-3  # denormal itself
    head = _head(weight)
    if head is not None:
        assert torch.equal(greedy_head_argmax(x, head), _panel_argmax(x, weight))


def test_tied_outputs_give_the_first_index():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(300, 96, generator=gen) * 0.1
    weight[[250, 40, 120]] = weight[7].clone()  # four equal rows: 7 is the first
    x = weight[7].clone().unsqueeze(0).repeat(3, 1) * 5  # each row's maximum is those four
    head = _head(weight)
    if head is None:
        return
    got = greedy_head_argmax(x, head)
    assert got.tolist() == [7, 7, 7] == _panel_argmax(x, weight).tolist()


def test_rows_the_screen_cannot_narrow_take_the_full_head():
    """All-zero weights tie every output (over the kernel's candidate cap); inf and NaN in x are
    the full head's to answer (NaN: the first NaN's index, as the backend's argmax)."""
    gen = torch.Generator().manual_seed(5)
    zeros = torch.zeros(5000, 64)
    candidates = torch.empty(2, dtype=torch.int64)
    zero_head = _head(zeros)
    if zero_head is None:
        return
    assert greedy_head_argmax(torch.randn(2, 64, generator=gen), zero_head, candidates).tolist() == [0, 0]
    assert candidates.tolist() == [5000, 5000]
    weight = torch.randn(5000, 64, generator=gen) * 0.1
    x = torch.randn(4, 64, generator=gen)
    x[1, 3] = float("inf")
    x[2, 10] = float("nan")
    head = _head(weight)
    if head is None:
        return
    expected = argmax_rows(linear(x, head.linear))
    assert torch.equal(greedy_head_argmax(x, head), expected)
    assert expected[0] == _panel_argmax(x[:1], weight)[0]


def test_strided_rows_empty_batch_and_wrong_inputs():
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(2000, 128, generator=gen) * 0.05
    head = _head(weight)
    if head is None:
        return
    wide = torch.randn(9, 200, generator=gen)
    view = wide[:, :128]
    assert torch.equal(greedy_head_argmax(view, head), _panel_argmax(view.contiguous(), weight))
    assert greedy_head_argmax(torch.empty(0, 128), head).shape == (0,)
    with pytest.raises(ValueError, match="greedy_head_argmax"):
        greedy_head_argmax(torch.randn(2, 128).to(torch.bfloat16), head)
    with pytest.raises(ValueError, match="greedy_head_argmax"):
        greedy_head_argmax(torch.randn(2, 64), head)


def test_heads_it_builds_none_for_on_any_cpu():
    weight = torch.randn(2000, 128, generator=torch.Generator().manual_seed(12)) * 0.05
    odd = torch.randn(100, 9)
    assert prepare_greedy_head(odd, prepare_linear(odd)) is None
    bad = weight.clone()
    bad[3, 4] = float("nan")
    assert prepare_greedy_head(bad, prepare_linear(bad)) is None
