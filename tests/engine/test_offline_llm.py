"""engine.llm.LLM: a generate call that fails part way leaves nothing behind in the engine."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8] * n for n in (1, 2, 3)]


def _token_ids(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_a_generate_call_stopped_part_way_frees_its_requests_and_the_next_call_is_unchanged(tiny_model_dir,
                                                                                          monkeypatch):
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    expected = _token_ids(llm, params)
    real_step, calls = llm.engine.step, []

    def step():
        calls.append(None)
        if len(calls) == 3:
            raise KeyboardInterrupt  # a Ctrl-C, or a step that failed, with requests still running
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.undo()
    llm.engine.check_leaks()
    assert _token_ids(llm, params) == expected


def test_a_bad_parameter_for_a_later_prompt_leaves_the_earlier_ones_unqueued(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu")
    params = [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4),
              SamplingParams(max_tokens=4, logit_bias={10**9: 1.0})]
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    llm.engine.check_leaks()
