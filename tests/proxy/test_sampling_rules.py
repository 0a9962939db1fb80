"""The proxy applies engine.protocol's sampling defaults and ranges (defined once there), names
the offending field of a refused request, and refuses fields it cannot honour (suffix)."""

from __future__ import annotations

import httpx
import pytest

from engine import protocol
from engine import sampling_rules as rules
from tests.proxy.conftest import MODEL_NAME


def _post(proxy, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(proxy.base_url + path, json={"model": MODEL_NAME, **body}, timeout=10)


def _out_of_range_values() -> list[tuple[str, object]]:
    """(field, a value just outside its protocol range) for every side of every range."""
    cases = []
    for name, low, high, is_low_allowed in rules.SAMPLING_RANGES:
        step = 1 if isinstance(low if low is not None else high, int) else 0.5
        if low is not None:
            cases.append((name, low - step if is_low_allowed else low))
        if high is not None:
            cases.append((name, high + step))
    return cases


@pytest.mark.parametrize("name, value", _out_of_range_values())
def test_every_protocol_range_is_enforced_naming_the_field(proxy, name, value):
    response = _post(proxy, {"prompt": "hi", "max_tokens": 2, name: value})
    assert response.status_code == 400, (name, value, response.text)
    assert response.json()["error"]["param"] == name


def test_chat_logprob_fields_follow_the_protocol_ranges(proxy):
    messages = [{"role": "user", "content": "hi"}]
    too_many = _post(proxy, {"messages": messages, "logprobs": True, "top_logprobs": rules.MAX_LOGPROBS + 1},
                     "/v1/chat/completions")
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "top_logprobs"
    zero = _post(proxy, {"messages": messages, "max_completion_tokens": 0}, "/v1/chat/completions")
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "max_completion_tokens"


def test_negative_stop_token_ids_are_refused_by_the_protocol_check(proxy):
    response = _post(proxy, {"prompt": "hi", "stop_token_ids": [3, -1]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stop_token_ids"


def test_unset_fields_get_the_protocol_defaults(proxy):
    assert _post(proxy, {"prompt": "hi"}).status_code == 200
    [request] = proxy.prefill[0].messages(protocol.PrefillRequest)
    assert request.sampling == protocol.SamplingOptions()


def test_a_suffix_is_refused_as_unsupported(proxy):
    response = _post(proxy, {"prompt": "def f(", "suffix": "    return 1\n"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "suffix"
    assert "suffix" in error["message"] and "not supported" in error["message"]
    assert _post(proxy, {"prompt": "hi", "max_tokens": 1, "suffix": None}).status_code == 200
