"""Decoding leaves nothing per token that the cyclic garbage collector tracks: a full collection's
pause would otherwise grow with every token the running requests have made."""

from __future__ import annotations

import gc

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.protocol import TokenLogprob
from engine.sampling_params import SamplingParams

NUM_REQUESTS = 6
NUM_STEPS = 40


def _tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


@pytest.mark.parametrize("decode_graphs", ["off", "static"])
def test_decode_steps_keep_no_tracked_object_per_token(tiny_model_dir, decode_graphs):
    engine = LLMEngine(EngineConfig(ModelConfig.from_pretrained(tiny_model_dir), CacheConfig(num_blocks=256),
                                    SchedulerConfig(max_num_seqs=8), decode_graphs=decode_graphs))
    params = SamplingParams(max_tokens=2 * NUM_STEPS, temperature=0.0, ignore_eos=True)
    for i in range(NUM_REQUESTS):
        engine.add_request(f"r{i}", [5 + i, 9, 13, 21], params)
    for _ in range(20):  # prefill, the first decodes, anything made once
        engine.step()
    before = _tracked()
    num_tokens = sum(len(out.new_tokens) for _ in range(NUM_STEPS) for out in engine.step())
    grown = _tracked() - before
    assert num_tokens >= NUM_REQUESTS * (NUM_STEPS - 1)
    # NOTE: the prefix cache's entry per full block (16 tokens) grows with them; a token's own object,
    # kept, would be num_tokens more
    assert grown < num_tokens // 4, f"{grown} more tracked objects after {num_tokens} tokens"
    for i in range(NUM_REQUESTS):
        engine.abort(f"r{i}")
    engine.check_leaks()


def test_a_token_is_not_tracked_with_or_without_alternatives():
    assert not gc.is_tracked(TokenLogprob(7))
    assert not gc.is_tracked(TokenLogprob(7, -0.5, [(7, -0.5), (3, -1.5)]))
