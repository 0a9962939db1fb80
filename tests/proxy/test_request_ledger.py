"""The proxy's request ledger (proxy/ledger.py) tracks every generation request to its end: the
output (streamed or not), an error (a status, or an SSE error event mid-stream), the client gone
first. /metrics exports the open requests and the ends by outcome; every proxy a test starts is
checked at its stop for none open and none unanswered (tests/conftest.py, UvicornServer.stop)."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx

from tests.proxy.conftest import MODEL_NAME


def ends(proxy) -> dict[str, int]:
    text = httpx.get(proxy.base_url + "/metrics", timeout=5).text
    found = dict(re.findall(r'^pdserve_request_ends_total\{outcome="(\w+)"\} (\S+)$', text, re.MULTILINE))
    [num_open] = re.findall(r"^pdserve_requests_open (\S+)$", text, re.MULTILINE)
    return {outcome: int(float(count)) for outcome, count in found.items()} | {"open": int(float(num_open))}


def wait_ends(proxy, want: dict[str, int], timeout_s: float = 10.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = ends(proxy)
        if all(got.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_every_way_a_request_ends_is_counted_once(start_proxy):
    proxy = start_proxy(node={"step_s": 0.05, "fail_token_id": 7, "fail_is_client_error": False})
    assert ends(proxy) == {"tokens": 0, "error": 0, "client_gone": 0, "unanswered": 0, "open": 0}
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}
    assert httpx.post(proxy.base_url + "/v1/completions", json=body, timeout=10).status_code == 200
    streamed = httpx.post(proxy.base_url + "/v1/completions", json={**body, "stream": True}, timeout=10)
    assert streamed.text.rstrip().endswith("data: [DONE]")
    # An error status: a token id the fake node fails on (a server error after the prompt was sent).
    failing = httpx.post(proxy.base_url + "/v1/completions", json={**body, "prompt": [7, 8]}, timeout=10)
    assert failing.status_code == 500
    # A 400 before any node is asked, and one in the body's checks: both answered, both errors.
    assert httpx.post(proxy.base_url + "/v1/completions", json={**body, "max_tokens": -1},
                      timeout=10).status_code == 400
    # A streaming client that hangs up after its first chunk.
    with socket.create_connection(("127.0.0.1", int(proxy.base_url.rsplit(":", 1)[1]))) as sock:
        payload = json.dumps({**body, "max_tokens": 200, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        received = b""
        while b"data: " not in received:  # the headers may come alone
            chunk = sock.recv(65536)
            assert chunk, "the proxy closed the stream"
            received += chunk
    got = wait_ends(proxy, {"client_gone": 1, "open": 0})
    # The 400 for max_tokens comes from the body's own validation, before the request is taken on.
    assert got == {"tokens": 2, "error": 1, "client_gone": 1, "unanswered": 0, "open": 0}
