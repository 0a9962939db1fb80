"""Bad input, node errors, dead and silent nodes, client disconnects, health, metrics, auth and
routing of the proxy, against fake nodes."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest

from engine import protocol
from tests.conftest import held_port
from tests.proxy.conftest import MODEL_NAME


def _post(proxy, body, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    kwargs.setdefault("timeout", 10)
    return httpx.post(proxy.base_url + path, content=content,
                      headers={"Content-Type": "application/json", **kwargs.pop("headers", {})}, **kwargs)


def _wait_unhealthy(proxy, timeout_s: float = 5.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = httpx.get(proxy.base_url + "/health", timeout=2)
        if response.status_code == 503:
            return response
        time.sleep(0.05)
    raise TimeoutError("proxy still healthy")


def _wait_metric(proxy, line: str, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if line in httpx.get(proxy.base_url + "/metrics", timeout=2).text:
            return True
        time.sleep(0.02)
    return False


def _sse_events(response: httpx.Response) -> list:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


_CHAT = "/v1/chat/completions"
_USER = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    ("/v1/completions", "{not json", 400),
    ("/v1/completions", "[1, 2]", 400),
    ("/v1/completions", {"prompt": "hi"}, 400),
    ("/v1/completions", {"model": MODEL_NAME}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": "ten"}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": "10"}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "stream": "yes"}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [1, True]}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "temperature": -0.1}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "temperature": 2.5}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "top_p": 0}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "top_p": 1.5}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "n": 0}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "logprobs": 21}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "stop": 5}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": ""}, 400),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [5] * 300}, 400),  # longer than max_model_len 256
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [10**7]}, 400),  # not in the vocabulary
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404),
    (_CHAT, {"model": MODEL_NAME, "messages": []}, 400),
    (_CHAT, {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    (_CHAT, {"model": MODEL_NAME, "messages": "hi"}, 400),
    (_CHAT, {"model": MODEL_NAME, "messages": _USER, "top_logprobs": 21, "logprobs": True}, 400),
    (_CHAT, {"model": MODEL_NAME, "messages": _USER, "max_completion_tokens": 0}, 400),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(proxy):
    for path, body, status in BAD_REQUESTS:
        response = _post(proxy, body, path)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error", (body, error)
        assert set(error) == {"message", "type", "param", "code"}
    ok = proxy.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_openai_client_raises_bad_request_for_out_of_range_values(proxy):
    with pytest.raises(openai.BadRequestError) as info:
        proxy.client().chat.completions.create(model=MODEL_NAME, messages=_USER, temperature=3)
    assert info.value.body["param"] == "temperature"


@pytest.mark.parametrize("is_client_error, status", [(True, 400), (False, 500)])
def test_node_error_reply_maps_to_4xx_or_5xx(start_proxy, is_client_error, status):
    proxy = start_proxy(node={"fail_token_id": 3, "fail_is_client_error": is_client_error})
    response = _post(proxy, {"model": MODEL_NAME, "prompt": [1, 3], "max_tokens": 4})
    assert response.status_code == status and response.json()["error"]["message"] == "fake failure"
    streamed = _post(proxy, {"model": MODEL_NAME, "prompt": [1, 3], "max_tokens": 4, "stream": True})
    assert streamed.status_code == status and streamed.json()["error"]["message"] == "fake failure"


def test_client_disconnect_mid_stream_aborts_on_the_decode_node_within_a_second(start_proxy):
    proxy = start_proxy(node={"step_s": 0.02})
    decode = proxy.decode[0]
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 250, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", proxy.base_url + "/v1/completions", json=body, timeout=10) as response:
        for num_lines, _ in enumerate(response.iter_lines()):
            if num_lines >= 10:
                break
    disconnected_at = time.monotonic()
    assert decode.wait_for(lambda: decode.messages(protocol.Abort), timeout_s=1.0)
    assert time.monotonic() - disconnected_at < 1.0
    [abort] = decode.messages(protocol.Abort)
    assert abort.request_ids == [decode.messages(protocol.DecodeRequest)[0].request_id]
    assert decode.num_running() == 0


def test_client_disconnect_during_prefill_aborts_on_the_prefill_node(start_proxy):
    proxy = start_proxy(node={"prefill_s": 30.0})
    prefill = proxy.prefill[0]
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 5, "stream": True}
    with pytest.raises(httpx.ReadTimeout):
        _post(proxy, body, timeout=httpx.Timeout(5, read=0.5))
    assert prefill.wait_for(lambda: prefill.messages(protocol.Abort), timeout_s=10.0)
    assert prefill.num_running() == 0


def test_client_disconnect_before_a_non_streaming_answer_aborts_on_the_node(start_proxy):
    proxy = start_proxy(node={"step_s": 0.02, "max_model_len": 4096})
    decode = proxy.decode[0]
    # 2000 steps of 20 ms: the request cannot finish on its own within the wait below, so only
    # an Abort can empty the node. The client hangs up only once the decode node holds the
    # request (a fixed client timeout could fire while it was still prefilling on a loaded
    # machine, and the Abort then rightly went to the prefill node).
    body = json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2000, "ignore_eos": True}).encode()
    host, port = proxy.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
        assert decode.wait_for(lambda: decode.messages(protocol.DecodeRequest), timeout_s=10.0)
        assert not decode.messages(protocol.Abort)
    assert decode.wait_for(lambda: decode.messages(protocol.Abort), timeout_s=10.0)
    [abort] = decode.messages(protocol.Abort)
    assert abort.request_ids == [decode.messages(protocol.DecodeRequest)[0].request_id]
    assert decode.num_running() == 0


def test_lease_the_decode_side_never_saw_is_released(start_proxy):
    """The decode node dies while the prompt is being prefilled: a 503 naming decode, and the lease
    the prefill node holds for nobody is released."""
    proxy = start_proxy(node={"prefill_s": 2.5}, decode_wait_s=0.2)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(response=_post(
        proxy, {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}, timeout=15)))
    thread.start()
    prefill = proxy.prefill[0]
    assert prefill.wait_for(lambda: prefill.messages(protocol.PrefillRequest), timeout_s=5.0)
    proxy.decode[0].die()
    thread.join(timeout=15)
    response = result["response"]
    assert response.status_code == 503 and "decode" in response.json()["error"]["message"]
    assert prefill.wait_for(lambda: prefill.messages(protocol.ReleaseKV), timeout_s=1.0)
    assert prefill.leases == {}


def test_a_request_while_the_decode_node_is_down_waits_then_is_not_prefilled(start_proxy):
    proxy = start_proxy(decode_wait_s=0.3)
    proxy.decode[0].die()
    _wait_unhealthy(proxy)
    response = _post(proxy, {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4})
    assert response.status_code == 503 and "nothing was prefilled" in response.json()["error"]["message"]
    assert proxy.prefill[0].messages(protocol.PrefillRequest) == []


def test_decode_node_dying_mid_request_fails_with_5xx_within_the_heartbeat_timeout(start_proxy):
    proxy = start_proxy(node={"step_s": 0.05})
    result: dict = {}

    def request() -> None:
        started = time.monotonic()
        result["response"] = _post(proxy, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 250,
                                           "ignore_eos": True}, timeout=15)
        result["elapsed_s"] = time.monotonic() - started

    thread = threading.Thread(target=request)
    thread.start()
    assert proxy.decode[0].wait_for(lambda: proxy.decode[0].num_running() == 1)
    proxy.decode[0].die()
    thread.join(timeout=15)
    response = result["response"]
    assert 500 <= response.status_code < 600 and response.json()["error"]["type"] == "server_error"
    assert result["elapsed_s"] < proxy.config.heartbeat_timeout_s + 3


def test_decode_node_dying_mid_stream_ends_with_an_error_event(start_proxy):
    proxy = start_proxy(node={"step_s": 0.05})
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 250, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", proxy.base_url + "/v1/completions", json=body, timeout=15) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
            if len(events) == 3 and proxy.decode[0].num_running():
                proxy.decode[0].die()
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])


def test_prefill_node_dying_is_retried_on_the_decode_node_and_health_names_it(start_proxy):
    proxy = start_proxy(node={"prefill_s": 30.0})
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault(
        "response", _post(proxy, {"model": MODEL_NAME, "prompt": "hi"}, timeout=15)))
    thread.start()
    assert proxy.prefill[0].wait_for(lambda: proxy.prefill[0].num_running() == 1)
    proxy.prefill[0].die()
    thread.join(timeout=15)
    assert result["response"].status_code == 200  # re-sent: prefilled on the decode node
    health = _wait_unhealthy(proxy)
    assert health.json()["down"] == ["prefill prefill0"]
    assert proxy.prefill[0].address not in health.text  # nodes go by name unless expose_node_addresses
    assert _post(proxy, {"model": MODEL_NAME, "prompt": "hi"}).status_code == 200  # the decode node prefills
    # Ready all along: a decode node takes requests (it prefills them itself); not once it dies too.
    assert httpx.get(proxy.base_url + "/ready", timeout=5).status_code == 200
    proxy.decode[0].die()
    deadline = time.monotonic() + 10
    while httpx.get(proxy.base_url + "/ready", timeout=5).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(proxy.base_url + "/ready", timeout=5).status_code == 503


def test_silent_prefill_node_times_out_and_the_request_is_retried_elsewhere(start_proxy):
    proxy = start_proxy(node={"prefill_s": 30.0}, first_token_timeout_s=0.5)
    started = time.monotonic()
    response = _post(proxy, {"model": MODEL_NAME, "prompt": "hi"})
    assert response.status_code == 200 and time.monotonic() - started < 3  # prefilled on the decode node
    assert proxy.prefill[0].wait_for(lambda: proxy.prefill[0].messages(protocol.Abort), timeout_s=1.0)


def test_node_that_never_reported_is_down_and_gets_no_requests(start_proxy):
    with held_port() as port:  # held: the live node cannot be given the same port
        silent = f"127.0.0.1:{port}"
        proxy = start_proxy(wait=False, num_decode=1, extra_decode_addresses=(silent,), expose_node_addresses=True)
        _check_silent_node_is_down(proxy, silent)


def test_no_prefill_is_spent_while_no_decode_node_is_up_and_the_503_names_them(start_proxy):
    """A prefill node up, the only decode node still starting (never reported): a clear 503 naming
    it, and the prefill node never asked (its work would be thrown away)."""
    with held_port() as port:
        starting = f"127.0.0.1:{port}"
        proxy = start_proxy(wait=False, num_decode=0, extra_decode_addresses=(starting,), decode_wait_s=0.5,
                            expose_node_addresses=True)
        assert _wait_metric(proxy, f'pdserve_node_up{{kind="prefill",node="{proxy.prefill[0].address}"}} 1.0')
        started = time.monotonic()
        response = _post(proxy, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
        assert time.monotonic() - started >= 0.5  # it waited for a decode node, bounded
        error = response.json()["error"]
        assert response.status_code == 503 and starting in error["message"], error
        assert "still starting" in error["message"] and "nothing was prefilled" in error["message"]
        assert proxy.prefill[0].messages(protocol.PrefillRequest) == []


def _check_silent_node_is_down(proxy, silent: str) -> None:
    live = proxy.decode[0].address
    assert _wait_metric(proxy, f'pdserve_node_up{{kind="decode",node="{live}"}} 1.0')
    assert _wait_metric(proxy, f'pdserve_node_up{{kind="prefill",node="{proxy.prefill[0].address}"}} 1.0')
    response = httpx.get(proxy.base_url + "/health", timeout=2)
    assert response.status_code == 503 and silent in response.text and live not in response.text
    for _ in range(3):
        assert _post(proxy, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}).status_code == 200
    assert len(proxy.decode[0].messages(protocol.DecodeRequest)) == 3


def test_metrics_export_latencies_requests_and_node_load(proxy):
    proxy.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4)
    list(proxy.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4, stream=True))
    text = httpx.get(proxy.base_url + "/metrics", timeout=5).text
    for name in ("pdserve_time_to_first_token_seconds_count 2.0", "pdserve_inter_token_latency_seconds_count 6.0",
                 "pdserve_e2e_request_latency_seconds_count 2.0", "pdserve_node_free_blocks{",
                 "pdserve_node_running{", "pdserve_node_waiting{", "pdserve_node_queued_prompt_tokens{",
                 "pdserve_node_kv_fallbacks_total{", 'pdserve_requests_total{endpoint="completions",status="200"} 2.0'):
        assert name in text, name


def test_api_key_is_required_on_v1_only(start_proxy):
    proxy = start_proxy(api_key="sekret")
    response = _post(proxy, {"model": MODEL_NAME, "prompt": "hi"})
    assert response.status_code == 401 and response.json()["error"]["message"]
    wrong = _post(proxy, {"model": MODEL_NAME, "prompt": "hi"}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert proxy.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1).choices
    assert httpx.get(proxy.base_url + "/health", timeout=2).status_code == 200


def test_requests_spread_over_decode_nodes(start_proxy):
    proxy = start_proxy(num_prefill=0, num_decode=2)
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 20, "ignore_eos": True}
    threads = [threading.Thread(target=lambda: _post(proxy, body))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [len(node.messages(protocol.DecodeRequest)) for node in proxy.decode] == [2, 2]


# ---- node-side queue bound, retry limits and the Drain message ----------------------------------


def test_a_node_refusing_as_full_is_routed_around(start_proxy):
    proxy = start_proxy(num_prefill=0, num_decode=2)
    full, other = proxy.decode
    full.config.refuse_as_full = True
    for _ in range(4):
        response = _post(proxy, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3})
        assert response.status_code == 200, response.text
    assert full.messages(protocol.DecodeRequest), "the full node was never tried: the refusal path did not run"
    assert len(other.messages(protocol.DecodeRequest)) == 4


@pytest.mark.parametrize("stream", [False, True])
def test_every_node_full_is_a_429_with_retry_after(start_proxy, stream):
    proxy = start_proxy(num_prefill=0, num_decode=2, node={"refuse_as_full": True})
    response = _post(proxy, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3, "stream": stream})
    assert response.status_code == 429, response.text
    assert int(response.headers["Retry-After"]) >= 1
    error = response.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and error["code"] == "nodes_full"
    assert [len(n.messages(protocol.DecodeRequest)) for n in proxy.decode] == [1, 1]  # each tried once
    for node in proxy.decode:
        node.config.refuse_as_full = False
    assert _post(proxy, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3}).status_code == 200


def test_max_attempts_bounds_the_sends_before_the_first_token(start_proxy):
    proxy = start_proxy(num_prefill=0, num_decode=3, node={"refuse_as_full": True}, max_attempts=2)
    response = _post(proxy, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3})
    assert response.status_code == 429, response.text
    assert sum(len(n.messages(protocol.DecodeRequest)) for n in proxy.decode) == 2


def test_a_node_reporting_its_queue_at_its_bound_gets_nothing_new(start_proxy):
    proxy = start_proxy(num_prefill=0, num_decode=2, node={"max_num_seqs": 1, "max_num_waiting": 1,
                                                            "step_s": 0.05, "max_model_len": 4096})
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1000, "ignore_eos": True}
    threads = [threading.Thread(target=_post, args=(proxy, body), kwargs={"timeout": 5}, daemon=True)
               for _ in range(4)]
    for thread in threads:
        thread.start()
        time.sleep(0.3)  # NOTE: a report in between: the proxy knows each node's queue
    # Each node runs one and has one waiting: at its bound, so the proxy answers the next at once.
    assert all(n.wait_for(lambda n=n: n.num_running() == 2, timeout_s=10) for n in proxy.decode)
    started = time.monotonic()
    response = _post(proxy, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3})
    assert response.status_code == 429 and response.json()["error"]["code"] == "nodes_full"
    assert time.monotonic() - started < 5
    assert [len(n.messages(protocol.DecodeRequest)) for n in proxy.decode] == [2, 2]  # never sent


@pytest.mark.parametrize("max_migrations, completes", [(0, False), (2, True)])
def test_max_migrations_bounds_the_moves_after_tokens(start_proxy, max_migrations, completes):
    proxy = start_proxy(num_prefill=0, num_decode=2, node={"step_s": 0.05}, max_migrations=max_migrations)
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 40, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", proxy.base_url + "/v1/completions", json=body, timeout=15) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
            if len(events) == 3:
                next(n for n in proxy.decode if n.num_running()).die()
    assert events[-1] == "[DONE]"
    assert ("error" in json.loads(events[-2])) is not completes


def test_pool_drain_sends_drain_and_routes_around_the_node(start_proxy):
    import asyncio

    from proxy.nodes import NodePool

    proxy = start_proxy(num_prefill=0, num_decode=2)  # the fake nodes; a pool of our own below

    async def scenario() -> None:
        pool = NodePool((), tuple(n.address for n in proxy.decode), heartbeat_timeout_s=5)
        pool.start()
        try:
            for _ in range(200):
                if all(n.is_routable for n in pool.decode):
                    break
                await asyncio.sleep(0.02)
            with pytest.raises(KeyError):
                pool.drain("decode7")
            drained = pool.drain("decode0", reason="test")
            assert drained is pool.decode[0] and drained.is_draining and not drained.is_routable
            assert pool.node_named(proxy.decode[1].address) is pool.decode[1]
            assert all(pool.pick_decode() is pool.decode[1] for _ in range(3))
        finally:
            await pool.stop()

    asyncio.run(scenario())
    assert proxy.decode[0].wait_for(lambda: proxy.decode[0].messages(protocol.Drain))
    assert proxy.decode[0].messages(protocol.Drain)[0].reason == "test"
    assert not proxy.decode[1].messages(protocol.Drain)
