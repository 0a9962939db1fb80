"""Node metrics (node.metrics) against known traffic: counters equal the tokens and requests
sent, histograms have one observation per request (or per token gap), the KV pull counts the
blocks times the block's bytes, the model_name label is set, and nothing stays tracked once the
nodes are idle. First the real PrefillNode and DecodeNode in-process over the fake transport
(exact, step by step), then real processes (NIXL) scraped over HTTP as Prometheus would."""

from __future__ import annotations

import math
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import protocol
from engine.config import ModelConfig
from pdserve.launcher import wait_healthy
from pdserve.ports import free_port
from tests.e2e.conftest import KV_PATH_ONLY, start_nodes
from tests.nodes.conftest import (
    GREEDY,
    PROMPT,
    assert_nothing_held,
    release_notices_processed,
)

NUM_OUTPUT = GREEDY.max_tokens  # 6, ignore_eos: every request generates exactly this many


def prompt_of(k: int) -> list[int]:
    """PROMPT's length (3 blocks, the last partial), other tokens for each k: no two requests
    share a prefix, so the decode node's prefix cache never spares a pull."""
    return [(t + 13 * k) % 2000 + 8 for t in PROMPT]


def sample_values(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Sample name -> [(labels, value)] of a /metrics body (the exposition format parsed as
    Prometheus parses it)."""
    values: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values.setdefault(sample.name, []).append((sample.labels, sample.value))
    return values


def value(values: dict, name: str, **labels: str) -> float:
    """The sum of name's samples whose labels include labels (0 if none)."""
    return sum(v for sample_labels, v in values.get(name, []) if labels.items() <= sample_labels.items())


def block_bytes(model_dir, block_size: int = 16) -> int:
    """One KV block (all layers' K and V of block_size tokens), from the model's config alone."""
    model = ModelConfig.from_pretrained(model_dir)
    return model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * model.dtype.itemsize


@pytest.fixture
def pair(pair_factory):
    """A prefill and a decode node over the fake transport, their connectors built as a node
    process builds them (node.transfer.connector_for: metered)."""
    return pair_factory(metered=True)


def test_in_process_pair_counts_every_token_request_phase_and_pulled_byte(pair, tiny_model_dir):
    request_ids = ["a", "b", "c"]
    for k, request_id in enumerate(request_ids):
        pair.pull(request_id, prompt_of(k))
    pair.decode.handle_message(b"proxy", protocol.PrefillRequest("never-pulled", PROMPT, GREEDY))  # refused
    pair.run(lambda: all(pair.tokens_of(r) is not None for r in request_ids))
    pair.run(release_notices_processed(pair))
    pair.prefill.run_once()
    pair.decode.run_once()  # one more load snapshot each, taken idle
    prefill = sample_values(pair.prefill.metrics.render().decode())
    decode = sample_values(pair.decode.metrics.render().decode())
    n = len(request_ids)

    assert value(prefill, "vllm:prompt_tokens_total") == n * len(PROMPT)
    assert value(prefill, "vllm:generation_tokens_total") == n  # the first token of each
    assert value(prefill, "vllm:request_success_total", finished_reason="prefilled") == n
    assert value(prefill, "vllm:request_success_total") == n
    for name in ("time_to_first_token_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "e2e_request_latency_seconds", "request_inference_time_seconds"):
        assert value(prefill, f"vllm:{name}_count") == n, name
    assert value(prefill, "vllm:request_prompt_tokens_sum") == n * len(PROMPT)
    assert value(prefill, "pdserve_node_kv_lease_hold_seconds_count") == n  # every lease ended, once
    assert value(prefill, "vllm:inter_token_latency_seconds_count") == 0

    assert value(decode, "vllm:prompt_tokens_total") == 0  # pulled, not prefilled here
    assert value(decode, "vllm:generation_tokens_total") == n * (NUM_OUTPUT - 1)
    assert value(decode, "vllm:request_success_total", finished_reason="length") == n
    assert value(decode, "vllm:request_success_total", finished_reason="error") == 1  # the refused prefill
    assert value(decode, "vllm:time_to_first_token_seconds_count") == n
    assert value(decode, "vllm:inter_token_latency_seconds_count") == n * (NUM_OUTPUT - 2)
    assert value(decode, "vllm:request_time_per_output_token_seconds_count") == n
    assert value(decode, "vllm:request_decode_time_seconds_count") == n
    assert value(decode, "vllm:request_prefill_time_seconds_count") == 0
    assert value(decode, "pdserve_node_decode_batch_size_sum") == n * (NUM_OUTPUT - 1)  # every output a decode
    num_blocks = n * math.ceil(len(PROMPT) / 16)
    assert value(decode, "pdserve_node_kv_pulled_blocks_total") == num_blocks
    assert value(decode, "pdserve_node_kv_pulled_bytes_total") == num_blocks * block_bytes(tiny_model_dir) > 0
    assert value(decode, "pdserve_node_kv_pull_seconds_count") == n
    assert value(decode, "pdserve_node_kv_pull_wait_seconds_count") == n
    assert value(decode, "pdserve_node_kv_pull_fallbacks_total") == 0
    assert value(decode, "pdserve_node_kv_blocks_lost_total") == 0
    assert {labels["reason"] for labels, _ in decode["pdserve_node_kv_pull_fallbacks_total"]} >= {
        r.value for r in protocol.KVFallbackReason}

    model_name = pair.decode.engine.config.model.name
    for values, role in ((prefill, "prefill"), (decode, "decode")):
        assert value(values, "vllm:kv_cache_usage_perc") == 0.0  # idle: every block free
        assert values["vllm:e2e_request_latency_seconds_count"][0][0] == {
            "model_name": model_name, "engine": role, "role": role}
    assert pair.prefill.metrics.num_tracked == pair.decode.metrics.num_tracked == 0
    assert pair.decode.connector.meter.num_tracked == 0
    assert_nothing_held(pair)


def test_aborts_and_fallbacks_are_counted_and_leave_nothing_tracked(pair):
    pair.decode.connector.inject("falls-back", "fail")
    pair.pull("falls-back", prompt_of(0))
    pair.pull("aborted", prompt_of(1))
    pair.run(lambda: pair.deltas_of("aborted"))  # decoding
    pair.decode.handle_message(b"proxy", protocol.Abort(["aborted"]))
    pair.run(lambda: pair.tokens_of("falls-back") is not None)
    pair.run(release_notices_processed(pair))
    decode = sample_values(pair.decode.metrics.render().decode())
    assert value(decode, "pdserve_node_kv_pull_fallbacks_total", reason="transfer") == 1
    assert value(decode, "pdserve_node_kv_pull_failures_total", code="transfer") == 1
    assert value(decode, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(decode, "vllm:request_success_total", finished_reason="length") == 1
    assert value(decode, "vllm:prompt_tokens_total") == len(PROMPT)  # the fallback's, prefilled here
    assert value(decode, "vllm:request_queue_time_seconds_count") == 1
    assert value(decode, "vllm:request_prefill_time_seconds_count") == 1
    assert value(decode, "pdserve_node_kv_pulled_blocks_total") == math.ceil(len(PROMPT) / 16)  # "aborted"'s
    assert pair.decode.metrics.num_tracked == pair.prefill.metrics.num_tracked == 0
    assert pair.decode.connector.meter.num_tracked == 0
    assert_nothing_held(pair)


def test_a_lease_confirmed_while_its_handle_is_being_sent_is_observed_once(pair):
    """A fast reader can read and confirm a lease before the prefill node's loop gets past
    sending the handle (the confirmation ends it on the side channel's thread). Its hold time is
    still observed, once, and nothing stays tracked (the lease is timed from when it is added)."""
    sent = []

    def send_and_confirm_at_once(_identity, message):
        sent.append(message)
        if isinstance(message, protocol.PrefillResult) and message.kv_handle is not None:
            assert pair.prefill.leases.end(message.request_id, message.kv_handle.generation)

    pair.prefill.send = send_and_confirm_at_once
    pair.prefill.handle_message(b"proxy", protocol.PrefillRequest("fast", PROMPT, GREEDY))
    pair.run(lambda: sent)
    pair.prefill.run_once()  # the loop frees the ended lease's blocks and sees it gone
    prefill = sample_values(pair.prefill.metrics.render().decode())
    assert [type(m) for m in sent] == [protocol.PrefillResult]
    assert value(prefill, "pdserve_node_kv_lease_hold_seconds_count") == 1
    assert pair.prefill.metrics.num_tracked == 0
    assert len(pair.prefill.leases) == 0


# ---- real processes ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deployment(tiny_model_dir, tmp_path_factory):
    """1 prefill + 1 decode node process (NIXL), each with a health port, and the proxy."""
    ports = [free_port(), free_port()]
    deployment = start_nodes(tiny_model_dir, tmp_path_factory.mktemp("metrics-logs"),
                             [["--health-port", str(ports[0])]], [["--health-port", str(ports[1])]],
                             proxy_args=KV_PATH_ONLY)
    try:
        wait_healthy(deployment, 120)
        yield deployment, {"prefill0": f"http://127.0.0.1:{ports[0]}", "decode0": f"http://127.0.0.1:{ports[1]}"}
    finally:
        deployment.stop()


def scrape(url: str) -> dict:
    response = httpx.get(url + "/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return sample_values(response.text)


def wait_for(check, timeout_s: float = 30.0):
    """check() until it returns a true value (returned), or fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"not true after {timeout_s} s"
        time.sleep(0.05)
    return result


def test_real_nodes_export_what_they_served(deployment, tiny_model_dir):
    deployment, nodes = deployment
    model_name = ModelConfig.from_pretrained(tiny_model_dir).name
    prompts = [[(11 * i + 5 * j) % 1900 + 40 for j in range(20 + 9 * i)] for i in range(4)]
    num_prompt_tokens, num_blocks = 0, 0
    for prompt in prompts:
        response = httpx.post(deployment.base_url + "/v1/completions", timeout=60, json={
            "model": model_name, "prompt": prompt, "max_tokens": NUM_OUTPUT, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["completion_tokens"] == NUM_OUTPUT
        num_prompt_tokens += usage["prompt_tokens"]
        num_blocks += math.ceil(usage["prompt_tokens"] / 16)
    n = len(prompts)

    def prefill_with_every_lease_ended() -> dict | None:
        values = scrape(nodes["prefill0"])
        return values if value(values, "pdserve_node_kv_lease_hold_seconds_count") == n else None

    prefill = wait_for(prefill_with_every_lease_ended)
    decode = scrape(nodes["decode0"])

    assert value(prefill, "vllm:prompt_tokens_total") == num_prompt_tokens
    assert value(prefill, "vllm:generation_tokens_total") == n
    assert value(prefill, "vllm:request_success_total", finished_reason="prefilled") == n
    assert value(prefill, "vllm:request_prefill_time_seconds_count") == n
    assert value(prefill, "vllm:request_queue_time_seconds_count") == n
    assert value(decode, "vllm:prompt_tokens_total") == 0
    assert value(decode, "vllm:generation_tokens_total") == n * (NUM_OUTPUT - 1)
    assert value(decode, "vllm:request_success_total", finished_reason="length") == n
    assert value(decode, "vllm:e2e_request_latency_seconds_count") == n
    assert value(decode, "vllm:inter_token_latency_seconds_count") == n * (NUM_OUTPUT - 2)
    assert value(decode, "pdserve_node_kv_pull_seconds_count") == n
    assert value(decode, "pdserve_node_kv_pulled_bytes_total") == num_blocks * block_bytes(tiny_model_dir) > 0
    assert value(decode, "pdserve_node_kv_pull_fallbacks_total") == 0
    assert value(decode, "pdserve_node_step_seconds_count") >= NUM_OUTPUT - 1
    # What UCX reported for the decode node's reads (host memory here; on a GPU, cuda).
    [(transport, one)] = wait_for(lambda: scrape(nodes["decode0"]).get("pdserve_kv_transport_info"))
    assert one == 1 and transport["memory"] == "host" and "/" in transport["transport"] and transport["method"]
    for name, values in (("prefill0", prefill), ("decode0", decode)):
        labels = values["vllm:num_requests_running"][0][0]
        assert labels == {"model_name": model_name, "engine": name, "role": name[:-1]}, labels


def test_prefix_cache_counters_come_from_the_load_report(pair):
    """A prompt repeated on the decode node is found in its prefix cache: the hit shows in
    vllm:prefix_cache_hits_total (tokens), taken from the node's load snapshot."""
    for request_id in ("first", "repeat"):
        pair.pull(request_id, prompt_of(7))
        pair.run(lambda r=request_id: pair.tokens_of(r) is not None)
    pair.run(release_notices_processed(pair))
    pair.decode.run_once()  # a load snapshot taken after both
    decode = sample_values(pair.decode.metrics.render().decode())
    load = pair.decode._load.fields
    assert load["num_prefix_hit_tokens"] > 0
    assert value(decode, "vllm:prefix_cache_hits_total") == load["num_prefix_hit_tokens"]
    assert value(decode, "vllm:prefix_cache_queries_total") == load["num_prefix_query_tokens"] >= 2 * len(PROMPT)
    assert value(decode, "pdserve_node_kv_pulled_blocks_total") < 2 * math.ceil(len(PROMPT) / 16)
    assert_nothing_held(pair)
