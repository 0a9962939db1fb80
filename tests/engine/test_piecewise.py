"""engine.piecewise's order of things, on the CPU with stand-ins for CUDA's graphs and streams (the
capture itself runs on a GPU: tests/engine/test_tensor_parallel.py's CUDA cases): each stretch
between two collectives is one graph; at replay each graph runs, then the collective met after
it; a worker's last collective (the gather) ends the capture; a failing step leaves no capture
open and no cut hook set. And TPGroup under the hook: its collectives act at replay, in place."""

from __future__ import annotations

import contextlib

import pytest
import torch

from engine import piecewise


class FakeGraph:
    def __init__(self, log: list) -> None:
        self.log = log
        self.id = sum(1 for entry in log if entry[0] == "begin")
        self.is_open = False

    def capture_begin(self, pool=None) -> None:
        assert pool == "pool"
        self.is_open = True
        self.log.append(("begin", self.id))

    def capture_end(self) -> None:
        assert self.is_open
        self.is_open = False
        self.log.append(("end", self.id))

    def replay(self) -> None:
        self.log.append(("replay", self.id))


class FakeStream:
    def wait_stream(self, _other) -> None:
        pass


class FakeGroup:
    cut = None


@pytest.fixture
def log(monkeypatch) -> list:
    entries: list = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: FakeGraph(entries))
    monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda _s: contextlib.nullcontext())
    return entries


def test_each_stretch_between_collectives_is_a_graph_and_replays_in_order(log):
    group = FakeGroup()

    def step():  # rank 0: two sums, then the gather, then the argmax's stretch
        group.cut(lambda: log.append(("sum", 0)), False)
        group.cut(lambda: log.append(("sum", 1)), False)
        group.cut(lambda: log.append(("gather",)), False)
        return "outputs"

    pieces, out = piecewise.capture_pieces(step, group, "pool", FakeStream())
    assert out == "outputs" and group.cut is None
    assert log == [("begin", 0), ("end", 0), ("begin", 1), ("end", 1), ("begin", 2), ("end", 2), ("begin", 3),
                   ("end", 3)]
    log.clear()
    pieces.replay()
    assert log == [("replay", 0), ("sum", 0), ("replay", 1), ("sum", 1), ("replay", 2), ("gather",), ("replay", 3)]


def test_a_last_collective_ends_the_capture(log):
    group = FakeGroup()

    def step():  # a worker: its gather to rank 0 is the step's last work
        group.cut(lambda: log.append(("sum", 0)), False)
        group.cut(lambda: log.append(("gather",)), True)

    pieces, _ = piecewise.capture_pieces(step, group, "pool", FakeStream())
    assert log == [("begin", 0), ("end", 0), ("begin", 1), ("end", 1)]
    log.clear()
    pieces.replay()
    assert log == [("replay", 0), ("sum", 0), ("replay", 1), ("gather",)]


def test_a_failing_step_closes_its_capture_and_unhooks_the_group(log):
    group = FakeGroup()

    def step():
        group.cut(lambda: None, False)
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="capturing"):
        piecewise.capture_pieces(step, group, "pool", FakeStream())
    assert log[-1] == ("end", 1) and group.cut is None


def test_captured_collectives_act_at_replay_on_the_tensors_the_capture_saw(tiny_model_dir):
    """Under a cut hook a sum is recorded, not done, and works in place on its tensor; rank 0's
    gather returns a buffer the recorded gather fills (the next graph reads that buffer)."""
    import datetime

    import torch.distributed as dist

    from engine.config import ModelConfig
    from engine.tp_group import TPGroup
    from engine.tp_shard import tp_shard

    model = ModelConfig.from_pretrained(tiny_model_dir)
    process_group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    group = TPGroup(tp_shard(model, 0, 1), model.vocab_size, process_group)
    recorded = []
    group.cut = lambda run, is_last: recorded.append((run, is_last))
    x = torch.ones(3)
    assert group.all_reduce(x) is x and len(recorded) == 1 and recorded[0][1] is False
    logits = torch.randn(2, model.vocab_size)
    out = group.gather_vocab(logits)
    assert out.shape == (2, model.vocab_size) and len(recorded) == 2 and recorded[1][1] is False
    recorded[1][0]()
    assert torch.equal(out, logits)


def test_replay_may_update_what_the_capture_made_under_inference_mode(tiny_model_dir, log):
    """The capture runs the forward under torch.inference_mode, so the static tensors a collective
    updates in place at replay (rank 0's gathered logits, a staged sum's) are inference tensors;
    the replay, called from the engine's step outside that mode, must still be allowed to."""
    import datetime

    import torch.distributed as dist

    from engine.config import ModelConfig
    from engine.tp_group import TPGroup
    from engine.tp_shard import tp_shard

    model = ModelConfig.from_pretrained(tiny_model_dir)
    process_group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    group = TPGroup(tp_shard(model, 0, 1), model.vocab_size, process_group)

    def step():
        with torch.inference_mode():
            return group.gather_vocab(torch.full((2, model.vocab_size), 2.0))

    pieces, out = piecewise.capture_pieces(step, group, "pool", FakeStream())
    assert out.is_inference()
    pieces.replay()  # the gather fills rank 0's static logits
    assert torch.equal(out, torch.full_like(out, 2.0))
