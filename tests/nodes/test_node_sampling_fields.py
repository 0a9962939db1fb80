"""logit_bias, structured output and prompt logprobs through the real node classes over the fake
transport: a seeded JSON-schema request gives the same tokens colocated, disaggregated (first
token on the prefill node, the rest on the decode node) and after a failed pull (local prefill on
the decode node); prompt logprobs come once, from the node that prefilled; bad values are
per-request error replies. Every test ends with no block, lease, request or matcher held."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from engine import protocol
from engine.protocol import Role, SamplingOptions, StructuredKind, StructuredOutput
from node.config import ServerConfig
from node.server import NodeServer
from tests.nodes.conftest import (
    PROMPT,
    PROXY,
    Pair,
    assert_nothing_held_once_released,
    colocated_tokens,
    make_engine,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
STRUCTURED = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))
SEEDS = (0, 1, 2, 3)
FAILED_PULL_SEEDS = (2, 3)
MAX_ROUNDS = 3000


def seeded(seed: int) -> SamplingOptions:
    return SamplingOptions(temperature=1.0, seed=seed, max_tokens=512, structured=STRUCTURED,
                           logit_bias={96: 1.5, 5: -0.5})  # a little towards "}", away from '"'


def prefill_all(pair: Pair, sampling: dict[str, SamplingOptions]) -> dict[str, protocol.PrefillResult]:
    for request_id, options in sampling.items():
        pair.prefill.handle_message(PROXY, protocol.PrefillRequest(request_id, PROMPT, options))
    pair.run(lambda: len(pair.results(protocol.PrefillResult)) == len(sampling), MAX_ROUNDS)
    return {r.request_id: r for r in pair.results(protocol.PrefillResult)}


def decode_all(pair: Pair, sampling: dict[str, SamplingOptions], results: dict[str, protocol.PrefillResult]) -> None:
    for request_id, options in sampling.items():
        result = results[request_id]
        pair.decode.handle_message(PROXY, protocol.DecodeRequest(request_id, PROMPT, options, result.first_token,
                                                                 result.kv_handle))
    pair.run(lambda: all(pair.tokens_of(request_id) is not None for request_id in sampling), MAX_ROUNDS)


def deltas_of(pair: Pair) -> list[protocol.RequestDelta]:
    return [d for batch in pair.results(protocol.TokenBatch) for d in batch.deltas]


def test_seeded_json_schema_is_the_same_colocated_disaggregated_and_after_a_failed_pull(pair, tiny_model_dir):
    sampling = {f"s{seed}": seeded(seed) for seed in SEEDS}
    expected = colocated_tokens(tiny_model_dir, sampling)
    results = prefill_all(pair, sampling)
    for seed in FAILED_PULL_SEEDS:
        pair.decode.connector.inject(f"s{seed}", "fail")
    decode_all(pair, sampling, results)
    assert pair.decode.num_kv_fallbacks == len(FAILED_PULL_SEEDS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    for request_id in sampling:
        tokens = pair.tokens_of(request_id)
        assert tokens == expected[request_id], request_id
        assert tokens[-1] in (0, 2)  # eos: the grammar ended the request
        value = json.loads(tokenizer.decode(tokens[:-1]))
        assert set(value) == {"name", "age", "color"} and value["color"] in ("red", "green", "blue")
    assert all(d.prompt_logprobs is None for d in deltas_of(pair))
    assert_nothing_held_once_released(pair)


@pytest.fixture(scope="module")
def transformers_logprobs(tiny_model_dir) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), -1)


def assert_prompt_logprobs(entries: list[protocol.TokenLogprob], want: torch.Tensor, num_top: int) -> None:
    assert [e.token_id for e in entries] == PROMPT and entries[0].logprob is None
    for idx in range(1, len(PROMPT)):
        assert abs(entries[idx].logprob - want[idx - 1, PROMPT[idx]].item()) < 1e-4
        assert [t for t, _ in entries[idx].top] == want[idx - 1].topk(num_top).indices.tolist()


def test_prompt_logprobs_come_once_from_the_node_that_prefilled(pair, tiny_model_dir, transformers_logprobs):
    options = SamplingOptions(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    results = prefill_all(pair, {"pulled": options, "fallback": options})
    for result in results.values():
        assert_prompt_logprobs(result.prompt_logprobs, transformers_logprobs, 2)
    pair.decode.connector.inject("fallback", "fail")
    decode_all(pair, {"pulled": options, "fallback": options}, results)
    assert all(d.prompt_logprobs is None for d in deltas_of(pair))  # the proxy has them already
    # A decode node told to prefill locally sends them on the request's first delta.
    pair.decode.handle_message(PROXY, protocol.DecodeRequest("local", PROMPT, options))
    pair.run(lambda: any(d.request_id == "local" and d.finish_reason for d in deltas_of(pair)))
    local = [d for d in deltas_of(pair) if d.request_id == "local"]
    assert_prompt_logprobs(local[0].prompt_logprobs, transformers_logprobs, 2)
    assert all(d.prompt_logprobs is None for d in local[1:])
    assert_nothing_held_once_released(pair)


def test_colocated_node_sends_prompt_logprobs_on_the_first_delta(tiny_model_dir, transformers_logprobs):
    node = NodeServer(make_engine(tiny_model_dir, Role.COLOCATED), ServerConfig("colocated"))
    sent = []
    node.send = lambda _identity, message: sent.append(message)
    try:
        options = SamplingOptions(temperature=0.0, max_tokens=3, prompt_logprobs=5)
        node.handle_message(PROXY, protocol.DecodeRequest("c", PROMPT, options))
        while node.engine.has_unfinished():
            node.run_once()
        deltas = [d for batch in sent for d in batch.deltas]
        assert_prompt_logprobs(deltas[0].prompt_logprobs, transformers_logprobs, 5)
        assert all(d.prompt_logprobs is None for d in deltas[1:])
        node.engine.check_leaks()
    finally:
        node.close()


def test_bad_new_values_are_per_request_client_errors_and_free_everything(pair):
    good = SamplingOptions(temperature=0.0, max_tokens=3, ignore_eos=True)
    refused = SamplingOptions(structured=StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type": "nosuch"}'))
    pair.prefill.handle_message(PROXY, protocol.PrefillRequest("vocab", PROMPT, SamplingOptions(logit_bias={4096: 1})))
    pair.prefill.handle_message(PROXY, protocol.PrefillRequest("range", PROMPT, SamplingOptions(logit_bias={4: 300})))
    pair.prefill.handle_message(PROXY, protocol.PrefillRequest("schema", PROMPT, refused))
    results = prefill_all(pair, {"good": good})  # the batch goes on
    pair.run(lambda: len(pair.results(protocol.ErrorReply)) == 3)  # the schema's refusal comes from a compile
    errors = {e.request_id: e for e in pair.results(protocol.ErrorReply)}
    assert set(errors) == {"vocab", "range", "schema"}
    assert all(e.is_client_error and e.kind in ("ValueError", "SamplingError") for e in errors.values())
    assert "4096" in errors["vocab"].message and "nosuch" in errors["schema"].message
    # A pull whose first token breaks the request's grammar is refused before any block is taken,
    # and the prefill node's lease is released at once.
    result = results["good"]
    assert result.first_token.token_id != 94  # not "{"
    structured = SamplingOptions(structured=StructuredOutput(StructuredKind.JSON_OBJECT))
    pair.decode.handle_message(PROXY, protocol.DecodeRequest("good", PROMPT, structured, result.first_token,
                                                             result.kv_handle))
    pair.run(lambda: any(e.request_id == "good" for e in pair.results(protocol.ErrorReply)))
    [error] = [e for e in pair.results(protocol.ErrorReply) if e.request_id == "good"]
    assert error.is_client_error and "does not follow" in error.message
    assert_nothing_held_once_released(pair)
