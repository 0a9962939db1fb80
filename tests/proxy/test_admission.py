"""Overload control: the admission's estimates and limits on fabricated load reports, and 429s
with Retry-After from a proxy in front of fake nodes (in-flight limit, full nodes, queue wait,
TTFT target), slots always given back; and node names instead of addresses."""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time

import httpx
import pytest

from engine import protocol
from proxy.admission import Admission, AdmissionLimits, is_full
from proxy.errors import ApiError
from proxy.main import add_arguments, config_from_args
from proxy.metrics import ProxyMetrics
from proxy.node_client import NodeClient, _Unreported, take_report
from proxy.node_names import NodeNames
from proxy.nodes import NodePool
from tests.proxy.conftest import MODEL_NAME


def _report(role=protocol.Role.DECODE, **fields) -> protocol.LoadReport:
    values = dict(node_id="n", role=role, protocol_version=protocol.PROTOCOL_VERSION, model_name="m",
                  max_model_len=256, block_size=16, num_running=0, num_waiting=0, num_queued_prompt_tokens=0,
                  num_free_blocks=100, num_total_blocks=100)
    return protocol.LoadReport(**{**values, **fields})


def _pool(num_prefill: int = 0, num_decode: int = 1) -> NodePool:
    pool = NodePool(tuple(f"127.0.0.1:{1 + i}" for i in range(num_prefill)),
                    tuple(f"127.0.0.1:{100 + i}" for i in range(num_decode)), heartbeat_timeout_s=60)
    for node in pool.all:
        _set(node)
    return pool


def _set(node: NodeClient, **fields) -> None:
    role = protocol.Role.PREFILL if node.kind == "prefill" else protocol.Role.DECODE
    take_report(node, _report(role, **fields))


def _admission(pool: NodePool, **limits) -> Admission:
    return Admission(AdmissionLimits(**{"max_num_requests": 100, **limits}), pool, ProxyMetrics())


def _finish(admission: Admission, num: int, interval_s: float) -> None:
    """Record num finishes interval_s apart, ending now."""
    now = time.monotonic()
    for i in range(num):
        admission.drain.record(now - (num - 1 - i) * interval_s)


def test_idle_nodes_mean_no_wait_and_full_nodes_are_told_apart():
    pool = _pool()
    [decode] = pool.decode
    assert not is_full(decode, None)
    _set(decode, num_free_blocks=0, num_waiting=1)
    assert is_full(decode, None)
    _set(decode, num_free_blocks=0, num_waiting=0)
    assert not is_full(decode, None)  # no free block, but nothing waits for one
    _set(decode, num_waiting=5)
    assert not is_full(decode, None) and is_full(decode, 5) and not is_full(decode, 6)
    _set(decode, num_pending_pulls=3, num_waiting=2)
    assert is_full(decode, 5)


def test_decode_queue_wait_is_the_slots_to_free_over_the_drain_rate():
    pool = _pool()
    admission = _admission(pool)
    _set(pool.decode[0], num_running=2, num_waiting=6)
    assert admission.estimate(10).queue_s == 0  # no drain rate measured yet: not estimated
    _finish(admission, 11, 0.5)  # 2 finishes per second
    wait = admission.estimate(10)
    # 6 queued ahead, then a slot for this request: 7 finishes at 2 per second
    assert wait.decode_queue_s == pytest.approx(3.5, rel=0.05) and wait.queue_s == wait.decode_queue_s
    assert wait.ttft_s == pytest.approx(wait.queue_s)  # colocated: the first token waits for a slot


def test_requests_sent_since_the_report_join_a_queue_but_not_an_idle_node():
    pool = _pool()
    [decode] = pool.decode
    admission = _admission(pool)
    _finish(admission, 11, 0.5)
    decode.unreported.extend(_Unreported(seq, 16, 16) for seq in range(1, 5))
    assert admission.estimate(1).decode_queue_s == 0  # its slots are unknown: taken as free
    _set(decode, num_waiting=2, num_running=2)
    assert admission.estimate(1).decode_queue_s == pytest.approx(3.5, rel=0.05)  # (2 + 4 + 1) / 2 per s
    _set(decode, num_waiting=0, num_running=1)  # the node runs 2 at most (seen while it queued)
    assert admission.estimate(1).decode_queue_s == pytest.approx(2.0, rel=0.05)  # 1 + 4 - 2 queued, + 1


def test_a_node_that_says_its_slots_makes_a_request_wait_once_they_are_full():
    pool = _pool(num_decode=2)
    admission = _admission(pool)
    _finish(admission, 11, 0.5)
    first, second = pool.decode
    _set(first, num_running=4, max_num_seqs=4)
    _set(second, num_running=3, max_num_seqs=4)
    assert admission.estimate(1).decode_queue_s == 0  # a free slot on the second node
    second.unreported.append(_Unreported(1, 16, 16))
    # nothing queued yet, but every slot is held: this request waits for the next one to free
    assert admission.estimate(1).decode_queue_s == pytest.approx(0.5, rel=0.05)
    _set(first, num_running=4, num_waiting=3, max_num_seqs=4)
    assert admission.estimate(1).decode_queue_s == pytest.approx(2.0, rel=0.05)  # 3 queued, + 1
    _set(first, num_running=3, num_waiting=1, max_num_seqs=4)  # KV blocks short: 3 is all it runs
    assert admission.estimate(1).decode_queue_s == pytest.approx(1.0, rel=0.05)


def test_prefill_wait_takes_the_soonest_prefill_node_and_its_own_prefill_time():
    pool = _pool(num_prefill=2)
    admission = _admission(pool)
    _set(pool.prefill[0], num_queued_prompt_tokens=1000, prefill_tokens_per_s=1000.0)
    _set(pool.prefill[1], num_queued_prompt_tokens=500, prefill_tokens_per_s=250.0)
    wait = admission.estimate(500)
    assert (wait.queue_s, wait.prefill_s, wait.ttft_s) == pytest.approx((1.0, 0.5, 1.5))
    _finish(admission, 11, 0.5)
    _set(pool.decode[0], num_waiting=20)  # 10.5 s for a decode slot: counts in the wait, not in TTFT
    wait = admission.estimate(500)
    assert wait.queue_s == pytest.approx(10.5, rel=0.05) and wait.ttft_s == pytest.approx(1.5)


def test_limits_refuse_with_429_retry_after_and_reason():
    pool = _pool()
    admission = _admission(pool, max_queue_wait_s=2.0, slo_ttft_s=1.0)
    _finish(admission, 11, 0.5)
    admission.check([10])
    _set(pool.decode[0], num_waiting=4)  # 4 queued and this one: 2.5 s
    with pytest.raises(ApiError) as refused:
        admission.check([10])
    error = refused.value
    assert (error.status, error.kind, error.code, error.headers) == (429, "rate_limit_exceeded", "queue_wait",
                                                                     {"Retry-After": "1"})
    admission.limits = AdmissionLimits(100, max_queue_wait_s=None, slo_ttft_s=1.0)
    with pytest.raises(ApiError) as refused:
        admission.check([10])
    assert refused.value.code == "slo_ttft" and refused.value.headers == {"Retry-After": "2"}
    _set(pool.decode[0], num_waiting=1, num_free_blocks=0)
    with pytest.raises(ApiError) as refused:
        admission.check([10])
    assert refused.value.code == "nodes_full"
    samples = {s.labels["reason"]: s.value for s in admission.metrics.rejections.collect()[0].samples
               if s.name.endswith("_total")}
    assert samples == {"queue_wait": 1, "slo_ttft": 1, "nodes_full": 1}


def test_in_flight_limit_counts_choices_and_tickets_give_slots_back():
    admission = _admission(_pool(), max_num_requests=4)
    first, second = admission.enter("a"), admission.enter("b")
    first.resize(3)
    with pytest.raises(ApiError) as refused:
        admission.enter("c")
    assert refused.value.status == 429 and refused.value.code == "max_num_requests"
    with pytest.raises(ApiError) as refused:
        second.resize(5)
    assert refused.value.status == 400  # more choices than the proxy ever runs at once
    first.release()
    first.release()  # twice: no effect
    second.release()
    assert admission.num_in_flight == 0 and admission.clients.num_clients == 0


def test_client_limit_refuses_only_the_client_past_it_and_names_the_cap():
    admission = _admission(_pool(), max_num_requests=10, max_client_requests=3)
    held = admission.enter("a")
    held.resize(3)
    for refuse in (lambda: admission.precheck("a"), lambda: admission.enter("a")):
        with pytest.raises(ApiError) as refused:
            refuse()
        error = refused.value
        assert (error.status, error.code) == (429, "max_client_requests")
        assert "max_client_requests" in error.message and "is 3" in error.message
    other = admission.enter("b")
    other.resize(3)  # another client still gets its own 3
    with pytest.raises(ApiError) as refused:
        other.resize(4)
    assert refused.value.status == 400 and "max_client_requests" in refused.value.message  # never fits
    held.release()
    other.release()
    assert admission.num_in_flight == 0 and admission.clients.num_clients == 0


def test_routing_passes_over_full_nodes():
    pool = _pool(num_decode=2)
    _admission(pool, max_node_waiting=3)
    busy, idle = pool.decode
    _set(busy, num_free_blocks=500, num_waiting=3)
    _set(idle, num_free_blocks=10)
    assert pool.pick_decode() is idle  # without the check: most free blocks
    _set(idle, num_free_blocks=10, num_waiting=3)
    assert pool.pick_decode() is busy  # every node full: the usual choice (admission refuses new ones)


# ---- a proxy in front of fake nodes ------------------------------------------------------------


def _post(proxy, body: dict, timeout_s: float = 30.0) -> httpx.Response:
    return httpx.post(proxy.base_url + "/v1/completions", content=json.dumps(body), timeout=timeout_s,
                      headers={"Content-Type": "application/json"})


def _metric(proxy, prefix: str) -> float | None:
    for line in httpx.get(proxy.base_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return None


def _wait_metric(proxy, prefix: str, value: float, timeout_s: float = 5.0, is_at_most: bool = False) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = _metric(proxy, prefix)
        if found == value or (is_at_most and found is not None and found <= value):
            return True
        time.sleep(0.02)
    return False


def _in_background(proxy, body: dict) -> tuple[threading.Thread, list]:
    answers: list = []
    thread = threading.Thread(target=lambda: answers.append(_post(proxy, body)))
    thread.start()
    return thread, answers


def _assert_429(response: httpx.Response, code: str) -> None:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", code)
    assert int(response.headers["retry-after"]) >= 1


def test_requests_past_max_num_requests_get_429_at_once_and_slots_come_back(start_proxy):
    proxy = start_proxy(max_num_requests=2, node={"step_s": 0.02})
    long_body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 60, "ignore_eos": True}
    running = [_in_background(proxy, long_body) for _ in range(2)]
    assert _wait_metric(proxy, "pdserve_requests_in_flight ", 2.0)
    _assert_429(_post(proxy, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}), "max_num_requests")
    assert all(thread.is_alive() for thread, _ in running)  # refused at once: no slot had come back
    for thread, answers in running:
        thread.join(timeout=30)
        assert answers[0].status_code == 200 and answers[0].json()["usage"]["completion_tokens"] == 60
    assert _wait_metric(proxy, "pdserve_requests_in_flight ", 0.0)
    response = _post(proxy, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "n": 3})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"  # never fits
    assert _post(proxy, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}).status_code == 200
    assert _metric(proxy, 'pdserve_admission_rejections_total{reason="max_num_requests"}') == 1.0
    assert _metric(proxy, 'pdserve_requests_total{endpoint="completions",status="429"}') == 1.0


def test_slots_come_back_after_disconnects_and_failures(start_proxy):
    proxy = start_proxy(max_num_requests=4, node={"step_s": 0.02, "fail_token_id": 7})
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", proxy.base_url + "/v1/completions", json=body, timeout=10) as response:
        next(response.iter_lines())  # one event, then the client leaves
    with pytest.raises(httpx.ReadTimeout):
        _post(proxy, {**body, "stream": False}, timeout_s=0.3)
    assert _post(proxy, {"model": MODEL_NAME, "prompt": [7, 8], "max_tokens": 2}).status_code == 400
    assert _post(proxy, {"model": "other", "prompt": "x"}).status_code == 404
    assert httpx.post(proxy.base_url + "/tokenize", json={"prompt": "hi"}, timeout=5).status_code == 200
    assert _wait_metric(proxy, "pdserve_requests_in_flight ", 0.0)


def test_full_decode_node_gets_no_new_requests_and_429_when_all_are_full(start_proxy):
    # One block of 16 tokens: a running request of 16 tokens or more leaves none free; one slot.
    proxy = start_proxy(num_prefill=0, node={"step_s": 0.02, "max_num_seqs": 1, "num_total_blocks": 1})
    body = {"model": MODEL_NAME, "prompt": [5] * 16, "max_tokens": 100, "ignore_eos": True}
    running = [_in_background(proxy, body)]
    assert _wait_metric(proxy, 'pdserve_node_free_blocks{kind="decode",node="decode0"}', 0.0, is_at_most=True)
    running.append(_in_background(proxy, body))  # no free block, but nothing waits yet: admitted
    assert _wait_metric(proxy, 'pdserve_node_waiting{kind="decode",node="decode0"}', 1.0)
    _assert_429(_post(proxy, {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}), "nodes_full")
    assert all(thread.is_alive() for thread, _ in running)  # refused at once, before a block came back
    for thread, answers in running:
        thread.join(timeout=30)
        assert answers[0].status_code == 200


def test_queue_wait_limit_refuses_once_the_queue_is_long(start_proxy):
    # 1 decode slot, 10 tokens at 20 ms: a slot frees every ~0.2 s, so 3 queued is ~0.6 s.
    proxy = start_proxy(num_prefill=0, max_queue_wait_s=0.5, node={"step_s": 0.02, "max_num_seqs": 1})
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 10, "ignore_eos": True}
    for _ in range(4):  # measures the drain rate
        assert _post(proxy, body).status_code == 200
    running = []
    for _ in range(12):
        running.append(_in_background(proxy, body))
        time.sleep(0.06)
    for thread, _ in running:
        thread.join(timeout=30)
    statuses = [answers[0].status_code for _, answers in running]
    assert statuses.count(200) >= 3 and statuses.count(429) >= 1, statuses
    assert set(statuses) == {200, 429}
    refused = [answers[0] for _, answers in running if answers[0].status_code == 429]
    _assert_429(refused[0], "queue_wait")


def test_prompt_whose_prefill_alone_misses_the_ttft_target_is_refused(start_proxy):
    # The prefill node reports 100 tokens/s: 50 prompt tokens take 0.5 s, 5 take 0.05 s.
    proxy = start_proxy(slo_ttft_ms=200, node={"prefill_tokens_per_s": 100.0})
    _assert_429(_post(proxy, {"model": MODEL_NAME, "prompt": [5] * 50, "max_tokens": 2}), "slo_ttft")
    assert proxy.prefill[0].messages(protocol.PrefillRequest) == []  # refused on arrival: sent nowhere
    assert proxy.decode[0].messages(protocol.DecodeRequest) == []
    assert _post(proxy, {"model": MODEL_NAME, "prompt": [5] * 5, "max_tokens": 2}).status_code == 200


def test_node_names_replace_addresses_in_text():
    names = NodeNames(("127.0.0.1:80",), ("127.0.0.1:8001", "10.0.0.2:80"))
    text = "prefill node 127.0.0.1:80 and decode 127.0.0.1:8001, then 10.0.0.2:80: gone"
    assert names.redact(text) == "prefill node prefill0 and decode decode0, then decode1: gone"
    assert NodeNames(("127.0.0.1:80",), ("127.0.0.1:81",), is_exposed=True).redact(text) == text


def test_health_and_metrics_name_nodes_without_addresses(start_proxy):
    proxy = start_proxy(num_decode=2)
    addresses = [n.address for n in proxy.prefill + proxy.decode]
    metrics = httpx.get(proxy.base_url + "/metrics", timeout=5).text
    for name, kind in (("prefill0", "prefill"), ("decode0", "decode"), ("decode1", "decode")):
        assert f'pdserve_node_up{{kind="{kind}",node="{name}"}} 1.0' in metrics
    proxy.decode[0].die()
    health = httpx.get(proxy.base_url + "/health", timeout=5)
    deadline = time.monotonic() + 5
    while health.status_code != 503 and time.monotonic() < deadline:
        health = httpx.get(proxy.base_url + "/health", timeout=5)
    assert health.status_code == 503 and "decode decode0" in health.json()["down"]
    for text in (metrics, health.text):
        assert not any(address in text for address in addresses)


def test_expose_node_addresses_shows_them(start_proxy):
    proxy = start_proxy(expose_node_addresses=True)
    metrics = httpx.get(proxy.base_url + "/metrics", timeout=5).text
    assert f'node="{proxy.decode[0].address}"' in metrics and 'node="decode0"' not in metrics


def test_limit_arguments_become_config_fields_and_bad_values_are_refused(model_dir):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(model_dir), "--decode", "127.0.0.1:3", "--max-num-requests", "16",
                              "--max-queue-wait-s", "2.5", "--slo-ttft-ms", "300", "--max-node-waiting", "8",
                              "--max-body-bytes", "1000", "--body-timeout-s", "5", "--expose-node-addresses"])
    config = config_from_args(args)
    assert (config.max_num_requests, config.max_queue_wait_s, config.slo_ttft_ms, config.max_node_waiting,
            config.max_body_bytes, config.body_timeout_s, config.expose_node_addresses) == (16, 2.5, 300, 8, 1000,
                                                                                             5.0, True)
    defaults = config_from_args(parser.parse_args(["--model", str(model_dir), "--decode", "127.0.0.1:3"]))
    assert (defaults.max_num_requests, defaults.max_queue_wait_s, defaults.slo_ttft_ms, defaults.max_node_waiting,
            defaults.expose_node_addresses) == (1024, None, None, None, False)
    for field_name, value in (("max_num_requests", 0), ("max_queue_wait_s", 0.0), ("slo_ttft_ms", -1.0),
                              ("max_node_waiting", 0), ("max_body_bytes", 0), ("body_timeout_s", 0.0)):
        with pytest.raises(ValueError, match=field_name):
            dataclasses.replace(config, **{field_name: value})
