"""Hostile HTTP input against the proxy (fake nodes): every one gets a 4xx with an OpenAI error
body, quickly, and the proxy answers a normal request correctly afterwards."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import proxy.limits
from proxy.errors import ApiError
from proxy.limits import MAX_JSON_DEPTH, parse_json
from proxy.schemas import MAX_STOP_STRINGS
from proxy.uploads import SMALL_BODY_BYTES, BodyReader, UploadLimits, UploadPace
from tests.proxy.conftest import MODEL_NAME
from tests.proxy.fuzzing import hostile_bodies

OK_BODY = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}


def _raw(proxy, content: bytes | str, path: str = "/v1/completions", content_type: str | None = "application/json",
         **kwargs) -> httpx.Response:
    headers = {"Content-Type": content_type} if content_type else {}
    return httpx.post(proxy.base_url + path, content=content, headers=headers, timeout=10, **kwargs)


def _body(**fields) -> str:
    return json.dumps({**OK_BODY, **fields})


def assert_openai_error(response: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    if status is not None:
        assert response.status_code == status, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and set(error) == {"message", "type", "param", "code"}
    return error


def assert_still_serving(proxy) -> None:
    reply = proxy.client().completions.create(**OK_BODY)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3


HOSTILE = hostile_bodies(MODEL_NAME)
TOO_LARGE = {"10 MB body"}  # 413; every other hostile body is a 400


@pytest.mark.parametrize(("name", "path", "content", "content_type"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_body_gets_a_4xx_with_an_openai_error(proxy, name, path, content, content_type):
    started = time.monotonic()
    response = _raw(proxy, content, path, content_type)
    assert_openai_error(response, 413 if name in TOO_LARGE else 400)
    assert time.monotonic() - started < 5, name


def test_every_hostile_body_leaves_the_proxy_serving(proxy):
    for _, path, content, content_type in HOSTILE:
        assert_openai_error(_raw(proxy, content, path, content_type))
    assert_still_serving(proxy)


def test_huge_integers_negative_counts_and_surrogates_name_the_field(proxy):
    for fields, param in ((dict(max_tokens=2**70), "max_tokens"), (dict(seed=2**70), "seed"), (dict(n=-1), "n"),
                          (dict(logprobs=-1), "logprobs"), (dict(prompt=[1, 2**70]), "prompt"),
                          (dict(stop_token_ids=[10**6]), "stop_token_ids"),
                          (dict(logit_bias={"999999": 1}), "logit_bias"),
                          (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop")):
        assert assert_openai_error(_raw(proxy, _body(**fields)), 400)["param"] == param, fields
    error = assert_openai_error(_raw(proxy, _body(prompt="a\ud800b")), 400)
    assert "lone surrogate" in error["message"]


def test_valid_surrogate_pair_and_shallow_nesting_are_accepted(proxy):
    reply = _raw(proxy, _body(prompt="smile \ud83d\ude00"))
    assert reply.status_code == 200, reply.text
    schema = json.loads("{\"properties\": " * 10 + "{}" + "}" * 10)
    reply = _raw(proxy, _body(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}))
    assert reply.status_code == 200, reply.text


def _depth(value) -> int:
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return 1 + max(map(_depth, children), default=0) if isinstance(value, (dict, list)) else 0


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab\n'),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text('[]{}"a'), inner, max_size=3),
                     max_leaves=200)


@settings(max_examples=300, deadline=None)
@given(_JSON)
def test_nesting_is_measured_on_the_bytes_exactly_brackets_in_strings_left_out(value):
    assert proxy.limits._deepest(json.dumps(value).encode()) == _depth(value)


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 100_000,
                                 b'{"a":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1)])
def test_a_body_nested_too_deep_is_refused_before_the_parser_recurses_into_it(monkeypatch, raw):
    def parser(*args, **kwargs):
        raise AssertionError("the JSON parser ran on a body nested too deep")
    monkeypatch.setattr(proxy.limits.json, "loads", parser)
    with pytest.raises(ApiError, match=f"nested more than {MAX_JSON_DEPTH} levels deep") as refused:
        parse_json(raw)
    assert refused.value.status == 400


def test_a_body_exactly_at_the_depth_limit_with_brackets_in_strings_parses():
    value = json.loads('{"a": ' * (MAX_JSON_DEPTH - 1) + '["[[[{{{\\"]]"]' + "}" * (MAX_JSON_DEPTH - 1))
    assert parse_json(json.dumps(value).encode()) == value


def test_body_over_the_limit_gets_413_by_content_length_without_being_read(start_proxy):
    proxy = start_proxy(max_body_bytes=1 << 20)
    body = _body(prompt="x" * (10 << 20))
    started = time.monotonic()
    error = assert_openai_error(_raw(proxy, body), 413)
    assert error["code"] == "request_too_large" and time.monotonic() - started < 5
    assert_still_serving(proxy)


def test_chunked_body_over_the_limit_gets_413_while_read(start_proxy):
    proxy = start_proxy(max_body_bytes=1 << 20)

    def chunks():
        yield b'{"model": "m", "prompt": "'
        for _ in range(10):
            yield b"x" * (1 << 20)
        yield b'"}'

    assert_openai_error(_raw(proxy, chunks()), 413)
    assert_still_serving(proxy)


def test_ten_megabyte_body_gets_413_at_the_default_limit(proxy):
    assert proxy.config.max_body_bytes < 10 << 20
    assert_openai_error(_raw(proxy, _body(prompt="x" * (10 << 20))), 413)
    assert_still_serving(proxy)


def test_body_arriving_too_slowly_gets_408(start_proxy):
    proxy = start_proxy(body_timeout_s=0.5)

    def slow():
        yield b'{"model": '
        time.sleep(1.5)
        yield b'"m", "prompt": "x"}'

    assert_openai_error(_raw(proxy, slow()), 408)
    assert_still_serving(proxy)


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_content_types_other_than_json_are_parsed_as_json_or_refused(proxy, content_type):
    # NOTE: as OpenAI's and vLLM's servers, the body is read as JSON whatever the header says
    # (curl -d sends form encoding); what is not JSON is a 400.
    assert _raw(proxy, _body(), content_type=content_type).status_code == 200
    assert_openai_error(_raw(proxy, b"model=m&prompt=x", content_type=content_type), 400)


def test_unknown_path_and_wrong_method_get_openai_errors(proxy):
    assert_openai_error(httpx.get(proxy.base_url + "/v1/nope", timeout=5), 404)
    assert_openai_error(httpx.get(proxy.base_url + "/v1/completions", timeout=5), 405)


def test_prompt_of_a_million_token_ids_gets_a_400_naming_the_context_length(proxy):
    # NOTE: a body this large (7 MB) is parsed in a worker thread (app._PARSE_IN_THREAD_BYTES).
    body = _body(prompt=list(range(1, 300)) * 5000)
    started = time.monotonic()
    error = assert_openai_error(_raw(proxy, body), 400)
    assert "maximum context length" in error["message"] and time.monotonic() - started < 10
    assert_still_serving(proxy)


class _FakeUpload:
    """A request whose body arrives in chunks of chunk_bytes (what BodyReader reads), from one client."""

    headers: dict = {}
    client = SimpleNamespace(host="192.0.2.1")

    def __init__(self, num_chunks: int, chunk_bytes: int = 1024) -> None:
        self.num_chunks = num_chunks
        self.chunk_bytes = chunk_bytes

    async def stream(self):
        for _ in range(self.num_chunks):
            yield b"x" * self.chunk_bytes


def test_large_uploads_share_a_bounded_buffer_that_small_bodies_never_touch():
    reader = BodyReader(UploadLimits(max_body_bytes=SMALL_BODY_BYTES + 4096, timeout_s=5.0))
    reader.num_large_bytes = reader.max_large_bytes - 2048  # other large uploads hold all but 2 KiB
    chunks_of_small = SMALL_BODY_BYTES // 1024
    with pytest.raises(ApiError) as refused:
        asyncio.run(reader.read(_FakeUpload(chunks_of_small + 3)))
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
    assert reader.num_large_bytes == reader.max_large_bytes - 2048  # what it had read is given back
    assert len(asyncio.run(reader.read(_FakeUpload(chunks_of_small + 2)))) == SMALL_BODY_BYTES + 2048
    reader.num_large_bytes = reader.max_large_bytes  # large uploads hold everything
    assert len(asyncio.run(reader.read(_FakeUpload(chunks_of_small)))) == SMALL_BODY_BYTES  # small: still read
    assert reader.uploads.num_clients == 0


def test_upload_pace_needs_its_bytes_in_every_window_from_the_start():
    pace = UploadPace(started_at=100.0, min_bytes_per_s=10, window_s=2.0)  # 20 bytes per window
    assert pace.deadline() == 102.0  # nothing yet: behind at the first window's end
    pace.add(100.5, 25)
    assert pace.deadline() == 104.0  # window [100, 102) has enough: the next one must bring its own
    pace.add(102.1, 5)
    assert pace.deadline() == 104.0 and pace.num_bytes_short() == 5
    pace.add(103.9, 15)
    assert pace.deadline() == 106.0


def test_a_client_hanging_up_mid_body_is_one_info_line_not_a_traceback(proxy, caplog):
    """A client that sends half its body and closes: one INFO line naming it, no error logged, and
    the proxy serves the next request."""
    import logging
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(proxy.base_url)
    with caplog.at_level(logging.INFO):
        with socket.create_connection((address.hostname, address.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b'{"model": "m", "prompt": "' + b"x" * 80)
            time.sleep(0.3)
        deadline = time.monotonic() + 5
        while not any("disconnected before its request body" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.05)
        assert_still_serving(proxy)
    gone = [r for r in caplog.records if "disconnected before its request body" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], \
        [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
