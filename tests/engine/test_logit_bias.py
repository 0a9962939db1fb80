"""logit_bias: added to a request's logits row before the choice, greedy and sampled, alone and
mixed with unbiased rows; greedy output equals transformers' greedy with the same bias added to
its logits (float32); ids outside the vocab are refused at admission, naming the request."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams

MAX_TOKENS = 10
PROMPTS = [[11, 400, 73, 1024, 5], list(range(900, 917))]


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(ModelConfig.from_pretrained(tiny_model_dir, dtype="float32"),
                                  CacheConfig(num_blocks=128), SchedulerConfig()))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


def transformers_greedy(model, prompt: list[int], bias: dict[int, float]) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            for token_id, value in bias.items():
                logits[token_id] += value
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens = {request_id: [] for request_id in requests}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += [t.token_id for t in out.new_tokens]
    engine.check_leaks()
    return tokens


def bias_for(model, prompt: list[int]) -> dict[int, float]:
    """A bias that changes the greedy path: ban the unbiased first token, lift two others."""
    [first] = transformers_greedy(model, prompt, {})[:1]
    return {first: -100.0, (first + 7) % 2000 + 8: 4.0, (first + 500) % 2000 + 8: 2.5, 1999: -3.0}


def test_greedy_with_logit_bias_equals_transformers_with_the_bias_added(engine, hf_model):
    biases = [bias_for(hf_model, prompt) for prompt in PROMPTS]
    expected = [transformers_greedy(hf_model, prompt, bias) for prompt, bias in zip(PROMPTS, biases)]
    unbiased = [transformers_greedy(hf_model, prompt, {}) for prompt in PROMPTS]
    assert all(e != u for e, u in zip(expected, unbiased))  # the bias matters
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # All rows greedy (the argmax fast path) with bias on every row.
    only_biased = run(engine, {f"b{i}": (p, SamplingParams(**greedy, logit_bias=b))
                               for i, (p, b) in enumerate(zip(PROMPTS, biases))})
    assert [only_biased[f"b{i}"] for i in range(len(PROMPTS))] == expected
    # Greedy rows with and without bias, next to a sampled row.
    mixed = run(engine, {
        "b0": (PROMPTS[0], SamplingParams(**greedy, logit_bias=biases[0])),
        "plain1": (PROMPTS[1], SamplingParams(**greedy)),
        "sampled": (PROMPTS[1], SamplingParams(temperature=1.0, seed=4, max_tokens=MAX_TOKENS, ignore_eos=True)),
    })
    assert mixed["b0"] == expected[0] and mixed["plain1"] == unbiased[1]


def test_a_large_bias_decides_sampled_tokens(engine):
    tokens = run(engine, {
        "forced": (PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                              logit_bias={1234: 100.0})),
        "banned": (PROMPTS[1], SamplingParams(temperature=1.5, seed=9, max_tokens=MAX_TOKENS, ignore_eos=True,
                                              logit_bias={t: -100.0 for t in range(8, 2048)})),
    })
    assert tokens["forced"] == [1234] * MAX_TOKENS
    assert all(t < 8 for t in tokens["banned"])


def test_logit_bias_id_outside_the_vocab_is_refused_naming_the_request_and_ids(engine):
    params = SamplingParams(logit_bias={5: 1.0, 2048: 2.0, 99999: -1.0})
    with pytest.raises(ValueError, match=r"request r7: logit_bias token ids \[2048, 99999\] are outside \[0, 2048\)"):
        engine.add_request("r7", PROMPTS[0], params)
    with pytest.raises(ValueError, match="request r7"):
        engine.check_request("r7", PROMPTS[0], params, [])
    engine.check_leaks()
