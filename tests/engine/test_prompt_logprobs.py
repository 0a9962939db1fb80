"""prompt_logprobs: each prompt token's logprob (and the top N) equal transformers' log_softmax of
its logits within 1e-4 (float32), across chunked prefill and preemption; sent once, with the
first token; never computed for a request that arrives with output tokens."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams

PROMPT_LENGTHS = [1, 2, 16, 17, 40, 100, 250]
NUM_TOP = 3


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, 2048) for _ in range(n)] for n in PROMPT_LENGTHS]


def transformers_prompt_logprobs(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt: log_softmax of the logits at each position, [len(prompt), vocab]."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1) for p in prompts]


def assert_matches(entries, prompt: list[int], want: torch.Tensor, num_top: int) -> None:
    assert len(entries) == len(prompt)
    assert entries[0].token_id == prompt[0] and entries[0].logprob is None and entries[0].top == []
    for idx in range(1, len(prompt)):
        entry, row = entries[idx], want[idx - 1]
        assert entry.token_id == prompt[idx]
        assert abs(entry.logprob - row[prompt[idx]].item()) < 1e-4, f"position {idx}"
        top_values, top_ids = row.topk(num_top)
        # The same ids in the same order, but for near-ties (within 1e-4, where float rounding
        # of another batch or chunking may order them either way): each listed id's own value
        # must then match transformers' for that id, and the values in order must match.
        if [t for t, _ in entry.top] != top_ids.tolist():
            assert all(abs(v - row[t].item()) < 1e-4 for t, v in entry.top), f"position {idx}"
        assert len(entry.top) == num_top, f"position {idx}"
        assert all(abs(v - w) < 1e-4 for (_, v), w in zip(entry.top, top_values.tolist())), f"position {idx}"


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    prompts = make_prompts()
    return prompts, transformers_prompt_logprobs(tiny_model_dir, prompts)


def test_prompt_logprobs_equal_transformers_across_chunks_and_preemption(tiny_model_dir, expected):
    prompts, want = expected
    config = EngineConfig(ModelConfig.from_pretrained(tiny_model_dir, dtype="float32"), CacheConfig(num_blocks=24),
                          SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32))
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=NUM_TOP)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    engine.add_request("none", prompts[3], SamplingParams(temperature=0.0, max_tokens=4))
    got, num_outputs = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            num_outputs[out.request_id] = num_outputs.get(out.request_id, 0) + 1
            if out.prompt_logprobs is not None:
                assert out.request_id not in got and num_outputs[out.request_id] == 1  # once, with the first token
                got[out.request_id] = out.prompt_logprobs
    print(f"\n{engine.scheduler.num_preemptions} preemptions, "
          f"{engine.scheduler.num_chunked_prefill_steps} chunked prefill steps")
    assert engine.scheduler.num_preemptions >= 1 and engine.scheduler.num_chunked_prefill_steps >= 1
    assert "none" not in got
    for i, prompt in enumerate(prompts):
        assert_matches(got[f"p{i}"], prompt, want[i], NUM_TOP)
    engine.check_leaks()


def test_prompt_logprobs_zero_gives_the_tokens_own_only_and_none_for_a_continued_request(tiny_model_dir, expected):
    prompts, want = expected
    engine = LLMEngine(EngineConfig(ModelConfig.from_pretrained(tiny_model_dir, dtype="float32"),
                                    CacheConfig(num_blocks=64), SchedulerConfig()))
    engine.add_request("zero", prompts[4], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))
    engine.add_request("continued", prompts[4], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2),
                       output_token_ids=[42])
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                got[out.request_id] = out.prompt_logprobs
    assert set(got) == {"zero"}
    assert_matches(got["zero"], prompts[4], want[4], 0)
    engine.check_leaks()
