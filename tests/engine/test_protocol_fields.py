"""The wire's new sampling fields (logit_bias, structured, prompt_logprobs) and prompt logprobs
in results: ranges both sides check, and msgpack round trips."""

from __future__ import annotations

import pytest

from engine import protocol
from engine.protocol import SamplingError, SamplingOptions, StructuredKind, StructuredOutput, TokenLogprob

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
HUGE_SCHEMA = '{"a": "' + "x" * protocol.MAX_JSON_SCHEMA_BYTES + '"}'


def test_new_fields_round_trip_through_msgpack():
    sampling = SamplingOptions(logit_bias={5: -1.5, 7: 100}, prompt_logprobs=3,
                               structured=StructuredOutput(StructuredKind.JSON_SCHEMA, SCHEMA))
    request = protocol.PrefillRequest("r", [1, 2, 3], sampling)
    decoded = protocol.decode_to_node(protocol.encode(request))
    assert decoded == request and decoded.sampling.logit_bias == {5: -1.5, 7: 100.0}
    entries = [TokenLogprob(1), TokenLogprob(2, -0.5, [(2, -0.5), (9, -1.0)])]
    result = protocol.PrefillResult("r", TokenLogprob(4), 2, prompt_logprobs=entries)
    assert protocol.decode_from_node(protocol.encode(result)) == result
    batch = protocol.TokenBatch([protocol.RequestDelta("r", [TokenLogprob(4)], None, 2, entries),
                                 protocol.RequestDelta("s", [TokenLogprob(5)])])
    assert protocol.decode_from_node(protocol.encode(batch)) == batch


@pytest.mark.parametrize("kwargs, param", [
    (dict(logit_bias={1: 100.5}), "logit_bias"),
    (dict(logit_bias={1: -101}), "logit_bias"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(logit_bias={-1: 0.0}), "logit_bias"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(prompt_logprobs=protocol.MAX_LOGPROBS + 1), "prompt_logprobs"),
    (dict(structured=StructuredOutput(StructuredKind.JSON_SCHEMA)), "structured"),
    (dict(structured=StructuredOutput(StructuredKind.JSON_OBJECT, SCHEMA)), "structured"),
    (dict(structured=StructuredOutput(StructuredKind.JSON_SCHEMA, "{not json")), "structured"),
    (dict(structured=StructuredOutput(StructuredKind.JSON_SCHEMA, "[1, 2]")), "structured"),
    (dict(structured=StructuredOutput(StructuredKind.JSON_SCHEMA, HUGE_SCHEMA)), "structured"),
])
def test_out_of_range_values_raise_sampling_error_naming_the_field(kwargs, param):
    with pytest.raises(SamplingError, match=param) as info:
        protocol.check_sampling(SamplingOptions(**kwargs))
    assert info.value.param == param


def test_edges_of_the_ranges_are_allowed():
    protocol.check_sampling(SamplingOptions(
        logit_bias={0: -100.0, 3: 100}, prompt_logprobs=protocol.MAX_LOGPROBS,
        structured=StructuredOutput(StructuredKind.JSON_OBJECT)))
    protocol.check_sampling(SamplingOptions(prompt_logprobs=0, structured=StructuredOutput(
        StructuredKind.JSON_SCHEMA, SCHEMA)))
