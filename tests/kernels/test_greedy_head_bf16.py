"""The greedy LM head for bfloat16 heads (kernels/cpu/greedy_head.py, its int8 screen): its token
equals the argmax of the bfloat16 kernel's logits (bf16_linear.c, rounded to bfloat16, the first
index among equal values) bit for bit, on random heads, on heads whose hidden states have a few
outlying channels (as trained models' do), on logits that only the rounding to bfloat16 ties, and
on rows it must leave to the full head. Where the backend's build has no greedy head (its
"greedy_head" capability: AVX512-BF16 and AVX512-VNNI), or the head has no bfloat16 panels (a
build with AMX), there is none: each test then checks that prepare_greedy_head builds none."""

import pytest
import torch

from kernels.cpu import greedy_head
from kernels.cpu.greedy_head import GreedyHead
from tests.kernels.ops import CPU

KERNELS = CPU.projections
argmax_rows = CPU.argmax
linear = CPU.linear
prepare_linear = CPU.prepare_linear
prepare_greedy_head = CPU.prepare_greedy_head
greedy_head_argmax = CPU.greedy_argmax


@pytest.fixture(autouse=True)
def any_vocabulary(monkeypatch):
    """The engine builds the bfloat16 greedy head from BF16_MIN_VOCAB outputs on (a speed
    choice); these tests check its answers on small heads too."""
    monkeypatch.setattr(greedy_head, "BF16_MIN_VOCAB", 0)


@pytest.fixture(autouse=True, params=[False, True], ids=["vdpbf16ps", "widened"])
def bf16_entry(request, monkeypatch):
    """Both of the bfloat16 kernel's entries (ProjectionKernels.bf16_widens), whichever this CPU
    takes: the head's exact logits follow the entry the full head runs."""
    monkeypatch.setattr(KERNELS, "bf16_widens", request.param)
    monkeypatch.setattr(KERNELS, "bf16_entry", "bf16_linear_wide" if request.param else "bf16_linear")


def _heads(weight: torch.Tensor):
    """(the head as linear runs it, its greedy head or None): built exactly where the backend has
    the capability and the head bfloat16 panels."""
    weight = weight.to(torch.bfloat16)
    full = prepare_linear(weight, copy=False)
    head = prepare_greedy_head(weight, full)
    assert (head is not None) == ("greedy_head" in CPU.capabilities and full.bf16 is not None)
    assert head is None or isinstance(head, GreedyHead)
    return full, head


def _reference(x: torch.Tensor, full) -> torch.Tensor:
    return argmax_rows(linear(x, full))


@pytest.mark.parametrize("vocab, hidden", [(49152, 576), (1000, 64), (4999, 130), (47, 8)])
@pytest.mark.parametrize("rows", [1, 7, 8, 33, 64, 70, 130])
def test_token_equals_the_bfloat16_kernels_argmax_on_random_heads(vocab, hidden, rows):
    """70 and 130 rows: the kernel's blocked path, which sums in longer chunks."""
    gen = torch.Generator().manual_seed(vocab * 1000 + hidden * 10 + rows)
    full, head = _heads(torch.randn(vocab, hidden, generator=gen) * 0.05)
    if head is None:
        return
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(torch.bfloat16)
    candidates = torch.empty(rows, dtype=torch.int64)
    got = greedy_head_argmax(x, head, candidates)
    assert torch.equal(got, _reference(x, full))
    assert bool((candidates >= 1).all()) and float(candidates.float().mean()) < 64  # the screen narrowed the rows


def test_outlying_channels_are_taken_out_of_the_int8_screen():
    """A few channels at 20-40x the others, the same ones in every row (trained models' final
    hidden states look so): quantized with the rest, they would set the int8 step for all and
    leave thousands of candidates a row; the screen takes the largest pairs in bfloat16 instead."""
    gen = torch.Generator().manual_seed(21)
    full, head = _heads(torch.randn(8000, 256, generator=gen) * 0.05)
    if head is None:
        return
    x = torch.randn(48, 256, generator=gen)
    x[:, [5, 77, 78, 200]] *= torch.tensor([25.0, -40.0, 30.0, 20.0])
    x = x.to(torch.bfloat16)
    candidates = torch.empty(48, dtype=torch.int64)
    got = greedy_head_argmax(x, head, candidates)
    assert torch.equal(got, _reference(x, full))
    assert float(candidates.float().mean()) < 40, candidates.tolist()


def test_logits_the_rounding_to_bfloat16_ties_give_the_first_index():
    """Output 2's logit (100.047) is below output 5's (100.203) in float32, but both round to
    100.0 in bfloat16, where the linear kernel's logits are compared: the first index wins. The
    int8 parts are exact here (integer x and W on a power-of-two scale), so the bounds are tight
    and a screen that compared float32 values would drop output 2."""
    hidden = 64
    weight = torch.zeros(300, hidden)
    weight[:, 2] = 127 / 128  # every row's int8 step 1 / 128: each W exact in int8
    gen = torch.Generator().manual_seed(4)
    weight[:, :2] = torch.randint(-60, 60, (300, 2), generator=gen) / 128
    weight[2, :2] = torch.tensor([100, 106]) / 128
    weight[5, :2] = torch.tensor([100, 126]) / 128
    x = torch.zeros(3, hidden)
    x[:, 0], x[:, 1] = 127.0, 1.0
    x = x.to(torch.bfloat16)
    full, head = _heads(weight)
    if head is None:
        return
    logits = linear(x, full)
    assert logits[0, 2] == logits[0, 5] == logits[0].max()  # tied after the rounding
    assert greedy_head_argmax(x, head).tolist() == [2, 2, 2] == _reference(x, full).tolist()


def test_near_duplicate_outputs_are_decided_by_the_exact_logits():
    """Pairs of outputs one bfloat16 step apart in a few weights: the int8 screen cannot order
    them, only the exact pass can; either member of a pair wins in some rows."""
    gen = torch.Generator().manual_seed(7)
    hidden, pairs = 256, 500
    base = (torch.randn(pairs, hidden, generator=gen) * 0.05).to(torch.bfloat16)
    other = base.clone()
    cols = torch.randint(0, hidden, (pairs, 3), generator=gen)
    other.scatter_(1, cols, (base.gather(1, cols).float() * (1 + 2**-7)).to(torch.bfloat16))
    weight = torch.stack([base, other], dim=1).reshape(2 * pairs, hidden)
    x = torch.randn(60, hidden, generator=gen).to(torch.bfloat16)
    full, head = _heads(weight)
    if head is None:
        return
    candidates = torch.empty(60, dtype=torch.int64)
    got = greedy_head_argmax(x, head, candidates)
    assert torch.equal(got, _reference(x, full))
    assert bool((candidates >= 2).all())
    assert (got % 2 == 1).any() and (got % 2 == 0).any()


def test_rows_near_zero_where_bfloat16_flushes_denormals():
    gen = torch.Generator().manual_seed(9)
    full, head = _heads(torch.randn(3000, 64, generator=gen) * 0.05)
    if head is None:
        return
    x = torch.randn(5, 64, generator=gen) * 1e-37
    x[2] *= 1e-3  # denormal itself
    x = x.to(torch.bfloat16)
    assert torch.equal(greedy_head_argmax(x, head), _reference(x, full))


def test_rows_the_screen_cannot_narrow_take_the_full_head():
    """All-zero weights tie every output (over the candidate cap); inf and NaN in x are the full
    head's to answer (NaN: the first NaN's index, as the backend's argmax)."""
    gen = torch.Generator().manual_seed(5)
    zeros_full, zero_head = _heads(torch.zeros(5000, 64))
    if zero_head is None:
        return
    candidates = torch.empty(2, dtype=torch.int64)
    x = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    assert greedy_head_argmax(x, zero_head, candidates).tolist() == [0, 0]
    assert candidates.tolist() == [5000, 5000]
    full, head = _heads(torch.randn(5000, 64, generator=gen) * 0.1)
    x = torch.randn(4, 64, generator=gen)
    x[1, 3] = float("inf")
    x[2, 10] = float("nan")
    x = x.to(torch.bfloat16)
    assert torch.equal(greedy_head_argmax(x, head), _reference(x, full))


def test_strided_rows_empty_batch_and_wrong_inputs():
    gen = torch.Generator().manual_seed(11)
    full, head = _heads(torch.randn(2000, 128, generator=gen) * 0.05)
    if head is None:
        return
    view = torch.randn(9, 200, generator=gen).to(torch.bfloat16)[:, :128]
    assert torch.equal(greedy_head_argmax(view, head), _reference(view.contiguous(), full))
    assert greedy_head_argmax(torch.empty(0, 128, dtype=torch.bfloat16), head).shape == (0,)
    with pytest.raises(ValueError, match="greedy_head_argmax"):
        greedy_head_argmax(torch.randn(2, 128), head)  # float32 rows for a bfloat16 head
    with pytest.raises(ValueError, match="greedy_head_argmax"):
        greedy_head_argmax(torch.randn(2, 64).to(torch.bfloat16), head)


def test_bfloat16_heads_it_builds_none_for(monkeypatch):
    gen = torch.Generator().manual_seed(12)
    odd = torch.randn(100, 9, generator=gen).to(torch.bfloat16)
    assert prepare_greedy_head(odd, prepare_linear(odd)) is None
    bad = torch.randn(100, 64, generator=gen).to(torch.bfloat16)
    bad[3, 4] = float("inf")
    assert prepare_greedy_head(bad, prepare_linear(bad)) is None
    monkeypatch.setattr(greedy_head, "BF16_MIN_VOCAB", 8192)
    small = torch.randn(8191, 64, generator=gen).to(torch.bfloat16)
    assert prepare_greedy_head(small, prepare_linear(small)) is None  # the logits path is as fast there


@pytest.mark.parametrize("rounded", ["x", "weights"])
def test_each_quantization_term_of_the_bound_keeps_the_true_maximum(rounded):
    """Output 3's logit is above output 4's, but its int8 approximation is 40 units below: one
    value (x's or W's, by `rounded`) of 0.4375 units rounds to 0 in int8 against a 127 on the
    other side; everything else is exact in int8 (integers on power-of-two steps). Only the
    bound's term for that side's rounding (|dx| |w| or s_x |qx| |e|) keeps output 3; without it
    the screen drops it (40 units is over the bfloat16 rounding's allowance)."""
    hidden, vocab, x_unit, w_unit = 128, 300, 1 / 16, 2.0**-10
    x = torch.zeros(3, hidden)
    x[:, 64:104] = 127  # 20 pairs at the maximum: the screen takes out 8, the int8 step stays one unit
    weight = torch.zeros(vocab, hidden)
    weight[:, 120] = 127  # each output's int8 step one unit
    weight[:, 80:104] = -torch.randint(0, 2, (vocab, 24), generator=torch.Generator().manual_seed(2)).float()
    weight[[3, 4], 80:104] = 1
    x[:, 2], weight[4, 2] = 40, 1  # output 4: +40 units^2, exact
    if rounded == "x":
        x[:, 126], weight[3, 126] = 0.4375, 127  # output 3: +55.6 units^2, 0 in int8
    else:
        x[:, 126], weight[3, 126] = 127, 0.4375
    x, weight = (x * x_unit).to(torch.bfloat16), weight * w_unit
    full, head = _heads(weight)
    if head is None:
        return
    assert _reference(x, full).tolist() == [3, 3, 3]
    assert greedy_head_argmax(x, head).tolist() == [3, 3, 3]
