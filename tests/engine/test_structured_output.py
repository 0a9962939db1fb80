"""Structured output (xgrammar): JSON-schema and JSON-object requests follow their grammar and
end with eos, under sampling and greedy, alone and batched with free-text requests; bad schemas
and tokens off the grammar are refused at admission; matchers are freed on finish and abort;
compiled grammars sit in a bounded LRU."""

from __future__ import annotations

import json

import pytest

from engine.grammar import Grammars
from engine.protocol import StructuredKind, StructuredOutput
from engine.sampling_params import SamplingParams
from tests.engine.run_requests import EOS_IDS, PROMPT, run_to_end

# Bounded everywhere (fixed keys, maxLength, an integer range, an enum), so even the tiny random
# model's outputs end well within MAX_TOKENS (measured: about 100 tokens, most of them whitespace).
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "color"],
    "additionalProperties": False,
}
PERSON = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(PERSON_SCHEMA))
MAX_TOKENS = 512


def check_person(value) -> None:
    """PERSON_SCHEMA checked by hand (no jsonschema package here)."""
    assert isinstance(value, dict) and set(value) == {"name", "age", "ok", "color"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 6, value
    assert type(value["age"]) is int and 0 <= value["age"] <= 99, value
    assert type(value["ok"]) is bool, value
    assert value["color"] in ("red", "green", "blue"), value


def as_json(tokenizer, tokens: list[int]):
    """The output before its closing eos, parsed by a strict JSON parser."""
    assert tokens[-1] in EOS_IDS, tokens[-5:]
    return json.loads(tokenizer.decode(tokens[:-1]))


def test_json_schema_at_temperature_one_parses_and_validates_for_20_seeds(engine, tokenizer):
    requests = {f"s{seed}": SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, structured=PERSON)
                for seed in range(20)}
    # An unconstrained neighbour in the same batch.
    requests["free"] = SamplingParams(temperature=1.0, seed=1, max_tokens=40, ignore_eos=True)
    results = run_to_end(engine, requests)
    for request_id in requests:
        if request_id == "free":
            continue
        tokens, reason = results[request_id]
        assert reason == "stop", (request_id, len(tokens), tokenizer.decode(tokens))
        check_person(as_json(tokenizer, tokens))
    assert len(results["free"][0]) == 40


def test_greedy_json_schema_with_truncation_and_ignore_eos_still_ends_at_the_grammar(engine, tokenizer):
    results = run_to_end(engine, {
        "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured=PERSON),
        "truncated": SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3, max_tokens=MAX_TOKENS,
                                    ignore_eos=True, structured=PERSON),
    })
    for tokens, reason in results.values():
        assert reason == "stop"
        check_person(as_json(tokenizer, tokens))


def test_complete_grammar_overrides_min_tokens(engine, tokenizer):
    [(tokens, reason)] = run_to_end(engine, {"m": SamplingParams(temperature=1.0, seed=5, min_tokens=MAX_TOKENS - 1,
                                                          max_tokens=MAX_TOKENS, structured=PERSON)}).values()
    assert reason == "stop" and len(tokens) < MAX_TOKENS - 1
    check_person(as_json(tokenizer, tokens))


def test_json_object_with_a_bias_towards_closing_is_an_object(engine, tokenizer):
    close_brace = tokenizer.convert_tokens_to_ids("}")
    any_object = StructuredOutput(StructuredKind.JSON_OBJECT)
    requests = {f"o{seed}": SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, structured=any_object,
                                           logit_bias={close_brace: 8.0}) for seed in range(5)}
    for tokens, reason in run_to_end(engine, requests).values():
        assert reason == "stop"
        assert isinstance(as_json(tokenizer, tokens), dict)


def test_output_tokens_a_request_arrives_with_are_accepted_or_refused(engine, tokenizer):
    prefix = tokenizer.encode('{"name": "ab", "age": 4')
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=MAX_TOKENS, structured=PERSON)
    engine.add_request("cont", PROMPT, params, output_token_ids=prefix)
    tokens = []
    while engine.has_unfinished():
        tokens += [t.token_id for out in engine.step() for t in out.new_tokens]
    value = as_json(tokenizer, prefix + tokens)
    check_person(value)
    assert value["name"] == "ab" and str(value["age"]).startswith("4")
    with pytest.raises(ValueError, match=r"request bad: output token 1 .* does not follow"):
        engine.add_request("bad", PROMPT, params, output_token_ids=tokenizer.encode("{x"))
    engine.check_leaks()


@pytest.mark.parametrize("schema, match", [
    ('{"type": "nosuch"}', "not supported"),
    ('{"type": "string", "pattern": "(("}', "not supported"),
])
def test_schema_the_library_refuses_is_a_value_error_at_admission(engine, schema, match):
    params = SamplingParams(structured=StructuredOutput(StructuredKind.JSON_SCHEMA, schema))
    with pytest.raises(ValueError, match=f"request r: .*{match}"):
        engine.add_request("r", PROMPT, params)
    with pytest.raises(ValueError, match="request r"):
        engine.check_request("r", PROMPT, params, [])
    engine.check_leaks()


def test_abort_frees_the_matcher(engine):
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, structured=PERSON)
    engine.add_request("a", PROMPT, params)
    engine.add_request("b", PROMPT, params)
    engine.step()
    assert engine.grammars.num_live_matchers == 2
    engine.abort("a")
    engine.abort("b")
    assert engine.grammars.num_live_matchers == 0
    engine.check_leaks()


def test_compiled_grammars_are_kept_in_a_bounded_lru(tiny_model_dir):
    grammars = Grammars(str(tiny_model_dir), 2048, EOS_IDS, cache_size=2)
    specs = [StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps({"type": "object", "maxProperties": n}))
             for n in (1, 2, 3)]
    first = grammars.compile("r", specs[0])
    assert grammars.compile("r", specs[0]) is first  # a hit
    grammars.compile("r", specs[1])
    grammars.compile("r", specs[0])  # specs[0] is now the most recent: specs[1] goes next
    grammars.compile("r", specs[2])
    assert grammars.num_compiled == 2
    assert grammars.compile("r", specs[0]) is first


def test_bounded_strings_refuse_raw_control_characters(tiny_model_dir):
    import xgrammar

    grammars = Grammars(str(tiny_model_dir), 2048, EOS_IDS)
    compiled = grammars.compile("r", PERSON)
    assert not xgrammar.GrammarMatcher(compiled).accept_string('{"name": "a\x0eb"')
    assert xgrammar.GrammarMatcher(compiled).accept_string('{"name": "a b"')
