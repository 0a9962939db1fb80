"""Unknown top-level fields of completion bodies: ignored, as vLLM ignores them, and named in the
Pdserve-Ignored-Fields header (errors too) and in a WARNING line once per distinct field set (a
bounded number of lines a minute); --strict-fields refuses them with a 400 naming them all. vLLM's
(and OpenAI's) fields whose loss would change the answer are refused either way, unless their
value asks for nothing."""

from __future__ import annotations

import argparse
import logging

import httpx
import pytest

from engine import protocol
from proxy.field_policy import (
    IGNORED_FIELDS_HEADER,
    MAX_LINES_PER_WINDOW,
    MAX_REMEMBERED_SETS,
    WINDOW_S,
    IgnoredFieldsLog,
)
from proxy.main import add_arguments, config_from_args
from tests.proxy.conftest import MODEL_NAME

_CHAT = "/v1/chat/completions"
_USER = [{"role": "user", "content": "hi"}]
# Fields of other servers (vLLM's, OpenAI's) that change nothing here, and a typo.
UNKNOWN = {"priority": 0, "reasoning_effort": "low", "max_new_tokens": 5}


def _post(proxy, path: str, body: dict) -> httpx.Response:
    return httpx.post(proxy.base_url + path, json={"model": MODEL_NAME, **body}, timeout=10)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "proxy.field_policy" and r.levelno == logging.WARNING]


def test_unknown_fields_are_ignored_and_named_in_a_header(proxy):
    client = proxy.client()
    raw = client.completions.with_raw_response.create(model=MODEL_NAME, prompt="hi", max_tokens=2,
                                                      extra_body=UNKNOWN)
    assert raw.headers[IGNORED_FIELDS_HEADER] == "priority, reasoning_effort, max_new_tokens"
    assert raw.parse().usage.completion_tokens == 2  # max_new_tokens changed nothing
    raw = client.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=_USER, max_tokens=2,
                                                           extra_body={"prediction": {"type": "content"}})
    assert raw.headers[IGNORED_FIELDS_HEADER] == "prediction" and raw.parse().choices[0].message.content
    sent = proxy.prefill[0].messages(protocol.PrefillRequest)
    assert [request.sampling.max_tokens for request in sent] == [2, 2]
    assert IGNORED_FIELDS_HEADER not in _post(proxy, _CHAT, {"messages": _USER, "max_tokens": 1}).headers


def test_the_header_is_on_streams_and_errors_too(proxy):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "stream": True, "frobnicate": True}
    with httpx.stream("POST", proxy.base_url + "/v1/completions", json=body, timeout=10) as response:
        assert response.status_code == 200 and response.headers[IGNORED_FIELDS_HEADER] == "frobnicate"
        assert "data: [DONE]" in list(response.iter_lines())
    too_long = _post(proxy, "/v1/completions", {"prompt": "hi", "max_tokens": 10_000, "frobnicate": 1})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    assert too_long.headers[IGNORED_FIELDS_HEADER] == "frobnicate"


def test_odd_field_names_are_escaped_in_the_header(proxy):
    odd = {"a,b": 1, "x\r\nSet-Cookie: y": 2, "caf\u00e9": 3, "k" * 100: 4}
    response = _post(proxy, "/v1/completions", {"prompt": "hi", "max_tokens": 1, **odd})
    assert response.status_code == 200, response.text
    header = response.headers[IGNORED_FIELDS_HEADER]
    assert header == "a\\x2cb, x\\r\\nSet-Cookie: y, caf\\xe9, " + "k" * 64
    assert "set-cookie" not in response.headers


def test_ignored_fields_are_logged_once_per_field_set_and_endpoint(proxy, caplog):
    caplog.set_level(logging.WARNING, logger="proxy.field_policy")
    for body in ({"frobnicate": 1}, {"frobnicate": 2}, {"frobnicate": 1, "zap": 1}):
        assert _post(proxy, "/v1/completions", {"prompt": "hi", "max_tokens": 1, **body}).status_code == 200
    assert _post(proxy, _CHAT, {"messages": _USER, "max_tokens": 1, "frobnicate": 1}).status_code == 200
    lines = _warnings(caplog)
    assert len(lines) == 3, lines
    assert lines[0].startswith("completions: ignored request field not known to this server: 'frobnicate'")
    assert "'frobnicate', 'zap'" in lines[1] and lines[2].startswith("chat: ")


def test_new_field_sets_are_logged_a_bounded_number_of_times_a_window(caplog):
    caplog.set_level(logging.WARNING, logger="proxy.field_policy")
    now_s = [0.0]
    log = IgnoredFieldsLog(clock=lambda: now_s[0])
    for index in range(MAX_LINES_PER_WINDOW + 5):
        log.note("completions", [f"field{index}"])
    assert len(_warnings(caplog)) == MAX_LINES_PER_WINDOW
    now_s[0] += WINDOW_S
    log.note("completions", ["field0"])  # logged before: never again
    log.note("completions", ["late"])
    lines = _warnings(caplog)
    assert len(lines) == MAX_LINES_PER_WINDOW + 1 and "(5 requests with other new field sets were not logged)" in (
        lines[-1])
    for index in range(MAX_REMEMBERED_SETS + 1):  # the oldest set is forgotten past the bound
        now_s[0] += WINDOW_S
        log.note("chat", [f"f{index}"])
    now_s[0] += WINDOW_S
    log.note("chat", ["f0"])
    assert _warnings(caplog)[-1].startswith("chat: ignored request field not known to this server: 'f0'")


def test_strict_fields_refuses_unknown_fields_by_name(start_proxy):
    proxy = start_proxy(strict_fields=True)
    for path, body in (("/v1/completions", {"prompt": "hi"}), (_CHAT, {"messages": _USER})):
        response = _post(proxy, path, {**body, "frobnicate": 1, "max_new_tokens": 5})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "frobnicate", response.text
        assert "'frobnicate', 'max_new_tokens'" in error["message"] and "not known" in error["message"]
    assert proxy.prefill[0].messages(protocol.PrefillRequest) == []
    # vLLM defaults that ask for nothing are known fields: accepted, strict or not.
    response = _post(proxy, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "use_beam_search": False})
    assert response.status_code == 200 and IGNORED_FIELDS_HEADER not in response.headers
    schemas = httpx.get(proxy.base_url + "/openapi.json", timeout=10).json()["components"]["schemas"]
    assert schemas["CompletionRequest"]["additionalProperties"] is False


def test_strict_fields_is_a_proxy_flag(model_dir):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--model", str(model_dir), "--decode", "127.0.0.1:3"]
    assert config_from_args(parser.parse_args(base)).strict_fields is False
    assert config_from_args(parser.parse_args([*base, "--strict-fields"])).strict_fields is True
    assert config_from_args(parser.parse_args([*base, "--no-strict-fields"])).strict_fields is False


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "use_beam_search", True),
    (_CHAT, "use_beam_search", True),
    ("/v1/completions", "truncate_prompt_tokens", 4),
    ("/v1/completions", "allowed_token_ids", [1, 2]),
    (_CHAT, "bad_words", ["hello"]),
    ("/v1/completions", "logits_processors", ["my.Processor"]),
    ("/v1/completions", "prompt_logprobs", 1),
    ("/v1/completions", "return_token_ids", True),
    (_CHAT, "cache_salt", "s3cret"),
    ("/v1/completions", "prompt_embeds", "AAAA"),
    ("/v1/completions", "guided_whitespace_pattern", " ?"),
    (_CHAT, "structural_tag", "{\"type\": \"structural_tag\"}"),
    (_CHAT, "echo", True),
    (_CHAT, "functions", [{"name": "f", "parameters": {}}]),
    (_CHAT, "function_call", "auto"),
    (_CHAT, "best_of", 3),
])
def test_fields_whose_loss_would_change_the_answer_are_refused(proxy, path, field, value):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": _USER}
    response = _post(proxy, path, {**body, field: value})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field, response.text
    assert "not supported" in error["message"], error
    assert proxy.prefill[0].messages(protocol.PrefillRequest) == []


def test_vllm_defaults_that_ask_for_nothing_are_accepted_without_a_word(proxy, caplog):
    caplog.set_level(logging.WARNING, logger="proxy.field_policy")
    defaults = {"use_beam_search": False, "truncate_prompt_tokens": None, "allowed_token_ids": None,
                "bad_words": [], "logits_processors": None, "prompt_logprobs": None,
                "return_tokens_as_token_ids": None, "cache_salt": None, "guided_regex": None,
                "guided_choice": None, "guided_grammar": None, "structural_tag": None, "best_of": 1}
    response = _post(proxy, "/v1/completions", {"prompt": "hi", "max_tokens": 1, **defaults})
    assert response.status_code == 200 and IGNORED_FIELDS_HEADER not in response.headers, response.text
    chat = _post(proxy, _CHAT, {"messages": _USER, "max_tokens": 1, "echo": False, "functions": [], **defaults})
    assert chat.status_code == 200 and IGNORED_FIELDS_HEADER not in chat.headers, chat.text
    assert _warnings(caplog) == []
    assert _post(proxy, "/v1/completions", {"prompt": "hi", "use_beam_search": 0}).status_code == 400  # not False
