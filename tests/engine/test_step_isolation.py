"""A step that raises fails only the requests at fault: each request of the failed batch is run
again alone, the ones whose own run raises end with an error (blocks freed), and the others get
exactly the tokens a step without the fault gives them, whether the fault hit before the
forward, in it, or in sampling (after the KV was written)."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.errors import EngineBroken
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.conftest import poison_sampling

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True, logprobs=2)
PROMPTS = {
    "short": [11, 12, 13],
    "poison": [21, 22, 23, 24, 25],
    "long": [(5 * i + 3) % 1900 + 8 for i in range(90)],  # chunked: 64-token budget
    "seeded": [31, 32, 33, 34],
}


def make_engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(ModelConfig.from_pretrained(model_dir), CacheConfig(num_blocks=64),
                                  SchedulerConfig(max_num_batched_tokens=64)))


def run(engine: LLMEngine, request_ids: list[str]) -> dict[str, list]:
    """Every request's outputs until none is left."""
    for request_id in request_ids:
        engine.add_request(request_id, PROMPTS[request_id], SEEDED if request_id == "seeded" else GREEDY)
    outputs: dict[str, list] = {request_id: [] for request_id in request_ids}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, list]:
    """The bystanders' tokens (with logprobs) from a run without the poisoned request."""
    outputs = run(make_engine(tiny_model_dir), ["short", "long", "seeded"])
    return {request_id: [t for out in outs for t in out.new_tokens] for request_id, outs in outputs.items()}


def poison_batches_with(engine: LLMEngine, where: str) -> None:
    """Make every step that includes request "poison" raise, at the point where says."""
    def has_poison(scheduled) -> bool:
        return any(r.request_id == "poison" for r, _ in scheduled.scheduled())

    if where == "sampler":
        poison_sampling(engine.sampler, "poison", RuntimeError("injected fault in sampling"))
        return
    real_execute = engine.runner.execute

    def execute(scheduled):
        if where == "after_forward":
            logits = real_execute(scheduled)  # the KV of the whole batch is written
            if has_poison(scheduled):
                raise RuntimeError("injected fault after the forward")
            return logits
        if has_poison(scheduled):
            raise RuntimeError("injected fault before the forward")
        return real_execute(scheduled)

    engine.runner.execute = execute


@pytest.mark.parametrize("where", ["before_forward", "after_forward", "sampler"])
def test_fault_of_one_request_fails_it_alone_and_the_batch_goes_on_unchanged(tiny_model_dir, reference, where):
    engine = make_engine(tiny_model_dir)
    poison_batches_with(engine, where)
    outputs = run(engine, ["short", "poison", "long", "seeded"])
    [failed] = outputs["poison"]
    assert failed.finish_reason is FinishReason.ERROR and failed.new_tokens == []
    assert "injected fault" in failed.error
    for request_id, tokens in reference.items():
        got = [t for out in outputs[request_id] for t in out.new_tokens]
        assert got == tokens, request_id  # ids and logprobs: as if the fault never happened
        assert outputs[request_id][-1].finish_reason is FinishReason.LENGTH
    engine.check_leaks()  # the failed request's blocks are free


def test_fault_of_the_batch_as_a_whole_fails_nobody(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    real_execute = engine.runner.execute
    num_failed = []

    def execute(scheduled):
        if len(scheduled.scheduled()) > 1 and not num_failed:
            num_failed.append(1)
            raise MemoryError("injected: the batch is too big once")
        return real_execute(scheduled)

    engine.runner.execute = execute
    outputs = run(engine, ["short", "long", "seeded"])
    assert num_failed == [1]
    for request_id, tokens in reference.items():
        assert [t for out in outputs[request_id] for t in out.new_tokens] == tokens, request_id
    engine.check_leaks()


@pytest.mark.parametrize("error", [
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: device-side assert triggered"),
])
def test_a_device_failure_is_the_engines_not_a_requests(tiny_model_dir, error):
    """A CUDA error that leaves the device unusable: the step raises EngineBroken (its node fails
    every request to run elsewhere and stops) instead of retrying each request alone and failing
    them all while the node stays up. Out of memory or a bad launch is still one batch's: isolated."""
    engine = make_engine(tiny_model_dir)
    real_execute = engine.runner.execute
    calls = []

    def failing(raised):
        def execute(scheduled):
            calls.append(scheduled)
            raise raised
        return execute

    engine.runner.execute = failing(error)
    for request_id in ("short", "long"):
        engine.add_request(request_id, PROMPTS[request_id], GREEDY)
    with pytest.raises(EngineBroken, match="the device failed"):
        engine.step()
    assert len(calls) == 1  # no retry one by one
    for round_, isolated in enumerate((torch.OutOfMemoryError("CUDA error: out of memory"),
                                       torch.AcceleratorError("CUDA error: invalid configuration argument"))):
        if round_:
            for request_id in ("short", "long"):
                engine.add_request(request_id, PROMPTS[request_id], GREEDY)
        calls.clear()
        engine.runner.execute = failing(isolated)
        outputs = engine.step()
        assert len(calls) == 3  # the batch, then each request alone
        assert sorted(o.request_id for o in outputs) == ["long", "short"]
        assert all(o.finish_reason is FinishReason.ERROR for o in outputs)
    engine.runner.execute = real_execute
    engine.check_leaks()
