"""The wire's sampling fields (logit_bias, structured of every kind, prompt_logprobs, every integer
and float option) and prompt logprobs in results: ranges both sides check (integers fit a signed 64-bit
tensor, token ids int32, floats are finite), msgpack round trips, the version header every
frame carries, and the cluster keys derived from a secret."""

from __future__ import annotations

import msgspec
import pytest

from engine import protocol
from engine import sampling_rules as rules
from engine.protocol import SamplingOptions, StructuredKind, StructuredOutput, TokenLogprob
from engine.sampling_rules import SamplingError

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
HUGE_SCHEMA = '{"a": "' + "x" * rules.MAX_JSON_SCHEMA_BYTES + '"}'


def test_new_fields_round_trip_through_msgpack():
    sampling = SamplingOptions(logit_bias={5: -1.5, 7: 100}, prompt_logprobs=3,
                               structured=StructuredOutput(StructuredKind.JSON_SCHEMA, SCHEMA))
    request = protocol.PrefillRequest("r", [1, 2, 3], sampling)
    decoded = protocol.decode_to_node(protocol.encode(request))
    assert decoded == request and decoded.sampling.logit_bias == {5: -1.5, 7: 100.0}
    entries = [TokenLogprob(1), TokenLogprob(2, -0.5, [(2, -0.5), (9, -1.0)])]
    result = protocol.PrefillResult("r", TokenLogprob(4), 2, prompt_logprobs=entries)
    assert protocol.decode_from_node(protocol.encode(result)) == result
    outcome = protocol.KVOutcome(protocol.KVSource.FALLBACK, protocol.KVFallbackReason.LEASE_LOST)
    batch = protocol.TokenBatch([protocol.RequestDelta("r", [TokenLogprob(4)], 1, None, 2, entries, outcome),
                                 protocol.RequestDelta("s", [TokenLogprob(5)], 0)])
    assert protocol.decode_from_node(protocol.encode(batch)) == batch
    assert outcome.label == "fallback:lease_lost" and protocol.KVOutcome(protocol.KVSource.PULLED).label == "pulled"


@pytest.mark.parametrize("structured", [
    StructuredOutput(StructuredKind.REGEX, regex=r"\d{3}-[a-z]+"),
    StructuredOutput(StructuredKind.CHOICE, choices=("yes", 'say "no"', "")),
    StructuredOutput(StructuredKind.EBNF, grammar='root ::= "a" | "b"'),
])
def test_regex_choice_and_ebnf_round_trip_and_only_their_field_goes_on_the_wire(structured):
    request = protocol.DecodeRequest("r", [1], SamplingOptions(structured=structured))
    frame = protocol.encode(request)
    assert protocol.decode_to_node(frame) == request and b"json_schema" not in frame
    assert protocol.frame_version(frame) >= 8  # version 8 brought the kinds a version 7 node cannot read
    rules.check_sampling(request.sampling)


def test_frames_of_another_version_or_without_a_header_are_refused_before_decoding():
    frame = protocol.encode(protocol.Ping())
    assert protocol.frame_version(frame) == protocol.PROTOCOL_VERSION
    assert isinstance(protocol.decode_to_node(frame), protocol.Ping)
    older = b"PD" + (protocol.PROTOCOL_VERSION - 1).to_bytes(2, "big") + frame[4:]
    for data, named in ((older, f"version {protocol.PROTOCOL_VERSION - 1}"), (frame[4:], "no version header"),
                        (b"", "no version header")):
        with pytest.raises(msgspec.DecodeError, match=named):
            protocol.decode_to_node(data)
    with pytest.raises(msgspec.DecodeError):
        protocol.decode_from_node(frame[:-1] + b"\xc1")  # truncated / malformed msgpack


def test_curve_keys_are_derived_alike_everywhere_and_never_printed():
    keys = protocol.curve_keys("a-cluster-secret-of-some-length")
    assert keys == protocol.curve_keys("a-cluster-secret-of-some-length")
    assert keys != protocol.curve_keys("another-cluster-secret-entirely")
    assert len(keys.server_public) == len(keys.client_secret) == 40 and keys.server_public != keys.client_public
    assert "secret" not in repr(keys).replace("CurveKeys", "") and keys.server_secret.decode() not in repr(keys)
    with pytest.raises(ValueError, match="at least 16"):
        protocol.curve_keys("short")


@pytest.mark.parametrize("kwargs, param", [
    (dict(logit_bias={1: 100.5}), "logit_bias"),
    (dict(logit_bias={1: -101}), "logit_bias"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(logit_bias={-1: 0.0}), "logit_bias"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(prompt_logprobs=rules.MAX_LOGPROBS + 1), "prompt_logprobs"),
    (dict(structured=StructuredOutput(StructuredKind.JSON_SCHEMA)), "structured"),
    (dict(structured=StructuredOutput(StructuredKind.JSON_OBJECT, SCHEMA)), "structured"),
    (dict(structured=StructuredOutput(StructuredKind.JSON_SCHEMA, "{not json")), "structured"),
    (dict(structured=StructuredOutput(StructuredKind.JSON_SCHEMA, "[1, 2]")), "structured"),
    (dict(structured=StructuredOutput(StructuredKind.JSON_SCHEMA, HUGE_SCHEMA)), "structured"),
    (dict(structured=StructuredOutput(StructuredKind.REGEX)), "structured"),
    (dict(structured=StructuredOutput(StructuredKind.REGEX, regex="")), "structured"),
    (dict(structured=StructuredOutput(StructuredKind.REGEX, SCHEMA, regex="a")), "structured"),
    (dict(structured=StructuredOutput(StructuredKind.REGEX, regex="a" * (rules.MAX_REGEX_BYTES + 1))),
     "structured"),
    (dict(structured=StructuredOutput(StructuredKind.JSON_SCHEMA, SCHEMA, grammar="root ::= \"a\"")), "structured"),
    (dict(structured=StructuredOutput(StructuredKind.CHOICE, choices=())), "structured"),
    (dict(structured=StructuredOutput(StructuredKind.CHOICE, regex="a")), "structured"),
    (dict(structured=StructuredOutput(StructuredKind.CHOICE, choices=("a",) * (rules.MAX_NUM_GRAMMAR_CHOICES + 1))),
     "structured"),
    (dict(structured=StructuredOutput(StructuredKind.CHOICE, choices=("é" * (rules.MAX_GRAMMAR_CHOICES_BYTES // 2),
                                                                       "b"))), "structured"),
    (dict(structured=StructuredOutput(StructuredKind.EBNF, grammar="x" * (rules.MAX_GRAMMAR_BYTES + 1))),
     "structured"),
    (dict(structured=StructuredOutput(StructuredKind.JSON_OBJECT, choices=("a",))), "structured"),
    (dict(logit_bias={2**31: 1.0}), "logit_bias"),
    (dict(top_k=2**63), "top_k"),
    (dict(max_tokens=2**63), "max_tokens"),
    (dict(min_tokens=2**64 - 1), "min_tokens"),
    (dict(seed=2**63), "seed"),
    (dict(seed=-1), "seed"),
    (dict(stop_token_ids=[2**31]), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=list(range(rules.MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=float("inf")), "min_p"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(presence_penalty=float("-inf")), "presence_penalty"),
])
def test_out_of_range_values_raise_sampling_error_naming_the_field(kwargs, param):
    with pytest.raises(SamplingError, match=param) as info:
        rules.check_sampling(SamplingOptions(**kwargs))
    assert info.value.param == param


def test_edges_of_the_ranges_are_allowed():
    rules.check_sampling(SamplingOptions(
        logit_bias={0: -100.0, 3: 100}, prompt_logprobs=rules.MAX_LOGPROBS,
        structured=StructuredOutput(StructuredKind.JSON_OBJECT)))
    rules.check_sampling(SamplingOptions(prompt_logprobs=0, structured=StructuredOutput(
        StructuredKind.JSON_SCHEMA, SCHEMA)))
    for structured in (
        StructuredOutput(StructuredKind.REGEX, regex="a" * rules.MAX_REGEX_BYTES),
        StructuredOutput(StructuredKind.EBNF, grammar="x" * rules.MAX_GRAMMAR_BYTES),
        StructuredOutput(StructuredKind.CHOICE, choices=("ab",) * rules.MAX_NUM_GRAMMAR_CHOICES),
        StructuredOutput(StructuredKind.CHOICE, choices=("é" * (rules.MAX_GRAMMAR_CHOICES_BYTES // 2),)),
    ):
        rules.check_sampling(SamplingOptions(structured=structured))


def test_integer_options_at_their_64_bit_edges_are_accepted_and_sample_without_overflow(tiny_model_dir):
    from engine.config import CacheConfig, EngineConfig, ModelConfig
    from engine.engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(ModelConfig.from_pretrained(tiny_model_dir), CacheConfig(num_blocks=16)))
    edges = SamplingParams(max_tokens=rules.MAX_INT64, min_tokens=2, top_k=rules.MAX_INT64,
                           seed=rules.MAX_SEED, stop_token_ids=[rules.MAX_TOKEN_ID, 0], temperature=1.0,
                           top_p=0.9, logprobs=rules.MAX_LOGPROBS)
    engine.add_request("edges", [5, 6, 7], edges)
    engine.add_request("greedy", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0,
                                                           stop_token_ids=[rules.MAX_TOKEN_ID]))
    outputs = []
    for _ in range(4):
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"edges", "greedy"} and all(o.error is None for o in outputs)
    engine.abort("edges")
    engine.check_leaks()


def test_kv_progress_goes_both_ways_and_a_streamed_request_asks_for_it():
    handle = protocol.KVHandle("e-1", "10.0.0.1:5600", [4, 9], 32, 7, 30.0)
    progress = protocol.KVProgress("r", handle)
    last = protocol.KVProgress("r", handle, protocol.TokenLogprob(5, -0.5))
    assert protocol.decode_from_node(protocol.encode(progress)) == progress  # prefill node -> proxy
    assert protocol.decode_to_node(protocol.encode(last)) == last  # proxy -> decode node, the last with its token
    request = protocol.PrefillRequest("r", [1, 2], SamplingOptions(), stream_kv=True)
    assert protocol.decode_to_node(protocol.encode(request)).stream_kv
    assert not protocol.decode_to_node(protocol.encode(protocol.PrefillRequest("r", [1], SamplingOptions()))).stream_kv
