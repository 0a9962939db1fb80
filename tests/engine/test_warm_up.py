"""engine.warm_up: by default one full step (the scheduler's token budget) of throwaway
prompts, within the cache; nothing left allocated or cached."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.warm_up import warm_up
from tests.kernels.conftest import ENGINE_DEVICES


def warmed_steps(model_dir, num_blocks: int, num_tokens: int | None = None, device: str = "cpu",
                 measure_warm: bool | None = None) -> tuple[LLMEngine, list[tuple[int, int]]]:
    """The warm-up's steps as (prompts prefilled, prefill tokens), with max_model_len 100, a
    256-token step budget and 16-token blocks."""
    engine = LLMEngine(EngineConfig(ModelConfig.from_pretrained(model_dir, dtype="float32", max_model_len=100),
                                    CacheConfig(num_blocks=num_blocks), SchedulerConfig(max_num_batched_tokens=256),
                                    device=device))
    steps = []
    run_batch = engine._run_batch

    def recording(scheduled):
        steps.append((len(scheduled.prefills), scheduled.num_prefill_tokens))
        return run_batch(scheduled)

    engine._run_batch = recording
    warm_up(engine, num_tokens, measure_warm)
    return engine, steps


def test_the_warm_up_fills_one_step(tiny_model_dir):
    engine, steps = warmed_steps(tiny_model_dir, num_blocks=64)
    assert steps[0] == (3, 256)  # 98 + 98 + 60: each prompt leaves room for 2 output tokens
    assert sum(tokens for _, tokens in steps[1:]) < 256  # the second run's full blocks are cached
    assert engine.prefill_rate.tokens_per_s > 0
    assert engine.scheduler.prefix_stats.num_query_tokens == 0  # reset: the throwaway prompts count nowhere
    engine.check_leaks()


def test_measured_warm_the_prefill_rate_is_of_a_third_run_alone(tiny_model_dir, monkeypatch):
    """As on CUDA (the first run compiling the kernels): the rate is measured afresh on other
    prompts, computed whole; the earlier runs' measurements are dropped."""
    from engine.engine import PrefillRate

    seen = []
    real = PrefillRate.observe
    monkeypatch.setattr(PrefillRate, "observe", lambda self, n, s: (seen.append((id(self), n)), real(self, n, s)))
    engine, steps = warmed_steps(tiny_model_dir, num_blocks=64, measure_warm=True)
    assert steps[0] == (3, 256) and sum(t for _, t in steps) > 2 * 256  # the third run: 256 tokens again
    last = id(engine.prefill_rate)
    assert [n for rate, n in seen if rate == last and n] == [256] and engine.prefill_rate.tokens_per_s > 0
    assert engine.scheduler.prefix_stats.num_query_tokens == 0
    engine.check_leaks()


@pytest.mark.parametrize(("num_blocks", "num_tokens", "first_step"), [
    (64, 40, (1, 40)),  # asked for fewer
    (10, None, (2, 128)),  # a cache of 10 blocks: 98 + 30 tokens and their outputs
])
def test_the_warm_up_takes_what_it_is_asked_for_within_the_cache(tiny_model_dir, num_blocks, num_tokens, first_step):
    engine, steps = warmed_steps(tiny_model_dir, num_blocks, num_tokens)
    assert steps[0] == first_step
    engine.check_leaks()



@pytest.mark.parametrize("device", ENGINE_DEVICES)
def test_structured_masking_is_warmed_up_on_cuda_only(tiny_model_dir, device, monkeypatch):
    """On CUDA the warm-up masks float32 rows the way structured requests' steps do (xgrammar's
    Triton kernel compiled then, not on the first such request's step); on the CPU xgrammar stays
    unimported until a structured request comes. The masking warm-up changes no logit."""
    from engine import warm_up as warm_up_module
    from engine.grammar import warm_up_masking

    calls = []
    monkeypatch.setattr(warm_up_module, "warm_up_masking", lambda *args: calls.append(args))
    engine, _ = warmed_steps(tiny_model_dir, num_blocks=64, device=device)
    model = engine.config.model
    assert calls == ([(model.vocab_size, device)] if device == "cuda" else [])
    warm_up_masking(1000, device)  # raises if an all-allowed mask changed a logit
