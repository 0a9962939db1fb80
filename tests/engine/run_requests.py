"""Running a set of requests on an engine to the end, for the engine tests."""

from __future__ import annotations

from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams

EOS_IDS = (0, 2)  # the tiny model's eos ids (<|endoftext|>, <|im_end|>)
PROMPT = [5, 60, 7, 300, 9, 41]


def run_to_end(engine: LLMEngine, requests: dict[str, SamplingParams],
               prompt: list[int] = PROMPT) -> dict[str, tuple[list[int], str]]:
    """Run the requests together to the end: request_id -> (tokens, finish reason). The engine
    then holds nothing: every block free, every matcher gone (checked)."""
    for request_id, params in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    reasons = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += [t.token_id for t in out.new_tokens]
            if out.is_finished:
                reasons[out.request_id] = out.finish_reason.value
    engine.check_leaks()
    return {request_id: (ids, reasons[request_id]) for request_id, ids in tokens.items()}
