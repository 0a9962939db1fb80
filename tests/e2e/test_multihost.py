"""Nodes on separate hosts: the proxy, 2 prefill and 3 decode nodes each in a network namespace
of its own (own address, veth to a bridge), KV moving over NIXL/UCX TCP between them, every
control and side-channel socket under the cluster secret (off loopback, nothing runs without
one). prefill0 and decode0 bind 0.0.0.0 and advertise their address (--advertise-host), the
others bind their address. The proxy knows the prefill nodes by address and the decode nodes
by a DNS name it re-resolves (the proxy host's /etc/hosts, as a headless Service's records),
which lists decode0 and decode1 at first; decode2 runs but is unlisted until a test adds it.
Greedy output equals transformers' and no prompt falls back or is prefilled on a decode node.
The proxy and decode0 log JSON lines."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine.protocol import curve_keys
from pdserve.cluster import Cluster
from pdserve.launcher import Deployment, wait_healthy
from pdserve.netns import TestNetwork
from tests.e2e.conftest import CLUSTER_SECRET, NODE_ARGS, assert_kv_path_only, node_load, wait_blocks_free
from tests.e2e.test_pipeline import hf, hf_greedy, random_prompts  # noqa: F401 - hf is a fixture

NODE_PORT = 7100  # every host has its own port space
PROXY_PORT = 8000
PDSERVE = [sys.executable, "-m", "pdserve.cli"]
NAMES = ["proxy", "prefill0", "prefill1", "decode0", "decode1", "decode2"]
ADVERTISING = {"prefill0", "decode0"}  # bind 0.0.0.0, advertise their namespace address
DECODE_DNS = "decode.pdserve.test"
ADMIN_TOKEN = "multihost-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _node_argv(net: TestNetwork, name: str, model_dir: Path) -> list[str]:
    kind = name.rstrip("0123456789")
    address = net.hosts[name].address
    bind = ["--host", "0.0.0.0", "--advertise-host", address] if name in ADVERTISING else ["--host", address]
    logs = ["--log-format", "json"] if name == "decode0" else []
    return PDSERVE + [kind, "--model", str(model_dir), *bind, "--port", str(NODE_PORT), "--node-id", name,
                      "--cluster-secret", CLUSTER_SECRET, *logs, *NODE_ARGS]


def _start_hosts(net: TestNetwork, model_dir: Path, log_dir: Path) -> Deployment:
    cluster = Cluster()
    addresses = {name: f"{net.hosts[name].address}:{NODE_PORT}" for name in NAMES[1:]}
    for name in NAMES[1:]:
        cluster.start(name, net.hosts[name].command(_node_argv(net, name, model_dir)), log_dir)
    net.hosts["proxy"].set_names({DECODE_DNS: [net.hosts["decode0"].address, net.hosts["decode1"].address]})
    proxy_argv = PDSERVE + ["proxy", "--model", str(model_dir), "--host", net.hosts["proxy"].address,
                            "--port", str(PROXY_PORT), "--local-prefill-min-wait-s", "-1",
                            "--cluster-secret", CLUSTER_SECRET, "--log-format", "json",
                            "--prefill", ",".join(addresses[n] for n in ("prefill0", "prefill1")),
                            "--decode-dns", f"{DECODE_DNS}:{NODE_PORT}", "--discovery-interval-s", "1",
                            "--admin-token", ADMIN_TOKEN]
    cluster.start("proxy", net.hosts["proxy"].command(proxy_argv), log_dir)
    listed = {n: a for n, a in addresses.items() if n != "decode2"}
    return Deployment(cluster, f"http://{net.hosts['proxy'].address}:{PROXY_PORT}", listed, log_dir)


@pytest.fixture(scope="module")
def multihost(tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("multihost-logs")
    with TestNetwork(NAMES) as net:
        deployment = _start_hosts(net, tiny_model_dir, log_dir)
        try:
            wait_healthy(deployment, 180)
            yield deployment, net
        finally:
            deployment.stop()


def _client(deployment: Deployment) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=deployment.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_32_concurrent_greedy_requests_across_six_hosts_equal_transformers(multihost, hf):  # noqa: F811
    deployment, net = multihost
    prompts = random_prompts(32, [5, 17, 40, 130, 300], seed=21)
    expected = [hf_greedy(hf, p, 8)[0] for p in prompts]
    _, tokenizer = hf

    async def run_all():
        client = _client(deployment)
        name = (await client.models.list()).data[0].id
        return await asyncio.gather(*[client.completions.create(model=name, prompt=p, max_tokens=8, temperature=0)
                                      for p in prompts])

    results = asyncio.run(run_all())
    for i, (result, want) in enumerate(zip(results, expected)):
        assert result.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), f"prompt {i}"
    keys = curve_keys(CLUSTER_SECRET)
    assert_kv_path_only(deployment, keys)
    # Each node is reached at its own host's address, not loopback, and holds nothing afterwards.
    for name, address in deployment.node_addresses.items():
        assert address.startswith(net.hosts[name].address + ":")
        report = wait_blocks_free(address, keys=keys)
        assert report.num_free_blocks == report.num_total_blocks, name
    # Both nodes binding 0.0.0.0 served: decode0 pulled KV (zero fallbacks, above) from the side
    # channels the prefill nodes advertise, prefill0's among them.
    admin = httpx.get(deployment.base_url + "/admin/nodes", headers=ADMIN, timeout=10).json()["nodes"]
    sent = {n["address"]: n["requests_sent"] for n in admin}
    assert sent[deployment.node_addresses["prefill0"]] > 0 and sent[deployment.node_addresses["decode0"]] > 0, sent


def test_node_added_by_dns_gets_requests_and_removed_node_drains_while_traffic_runs(multihost, hf):  # noqa: F811
    deployment, net = multihost
    keys = curve_keys(CLUSTER_SECRET)
    _, tokenizer = hf
    # NOTE: prompts never seen before (until all were sent): cache-aware routing has no reason
    # to prefer the nodes that served them, so the new node's first request measures discovery.
    prompts = random_prompts(40, [9, 33, 70, 150], seed=5)
    expected = [tokenizer.decode(hf_greedy(hf, p, 8)[0], skip_special_tokens=True) for p in prompts]
    new_address = f"{net.hosts['decode2'].address}:{NODE_PORT}"
    leaving = deployment.node_addresses["decode1"]
    node_load(new_address, timeout_s=120, keys=keys)  # decode2 is up (it reports) before it is listed

    async def listing(http: httpx.AsyncClient) -> dict[str, dict]:
        response = await http.get(deployment.base_url + "/admin/nodes", headers=ADMIN)
        return {n["address"]: n for n in response.json()["nodes"]}

    sequence = itertools.count()

    async def traffic(client, name, stop: asyncio.Event, outcomes: list) -> None:
        while not stop.is_set():
            k = next(sequence) % len(prompts)
            result = await client.completions.create(model=name, prompt=prompts[k], max_tokens=8, temperature=0)
            outcomes.append((k, result.choices[0].text))

    async def scenario() -> tuple[float, list]:
        client, stop, outcomes = _client(deployment), asyncio.Event(), []
        name = (await client.models.list()).data[0].id
        workers = [asyncio.create_task(traffic(client, name, stop, outcomes)) for _ in range(4)]
        async with httpx.AsyncClient(timeout=10) as http:
            while len(outcomes) < 6:  # traffic flows on the first four nodes
                await asyncio.sleep(0.05)
            records = [net.hosts[n].address for n in ("decode0", "decode1", "decode2")]
            net.hosts["proxy"].set_names({DECODE_DNS: records})  # a third record, as a new pod's
            listed_at = time.monotonic()
            while (await listing(http)).get(new_address, {}).get("requests_sent", 0) == 0:
                assert time.monotonic() - listed_at < 60, "the new node never got a request"
                await asyncio.sleep(0.05)
            joined_s = time.monotonic() - listed_at
            removed = await http.delete(deployment.base_url + f"/admin/nodes/{leaving}", headers=ADMIN)
            assert removed.status_code == 202, removed.text
            sent_at_removal = removed.json()["requests_sent"]
            while leaving in (state := await listing(http)):
                assert state[leaving]["requests_sent"] == sent_at_removal, "a leaving node got a new request"
                await asyncio.sleep(0.05)
            after = len(outcomes)
            while len(outcomes) < after + 6:  # and traffic goes on without it
                await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*workers)
        return joined_s, outcomes

    joined_s, outcomes = asyncio.run(scenario())
    print(f"decode2 got its first request {joined_s:.2f} s after its DNS record appeared; {len(outcomes)} requests")
    assert joined_s < 5, f"the added node took {joined_s:.1f} s to get a request"
    for k, text in outcomes:
        assert text == expected[k], f"prompt {k}"
    deployment.node_addresses["decode2"] = new_address
    assert_kv_path_only(deployment, keys)
    for address in deployment.node_addresses.values():
        report = wait_blocks_free(address, keys=keys)
        assert report.num_free_blocks == report.num_total_blocks, address


def test_json_logs_carry_request_ids(multihost):
    deployment, _ = multihost
    proxy_lines = (deployment.log_dir / "proxy.log").read_text().splitlines()
    records = [json.loads(line) for line in proxy_lines if line.startswith("{")]
    # Every line the proxy's loggers write is one JSON object (the settings line too).
    assert records and len(records) == len([line for line in proxy_lines if line.strip()]), proxy_lines[:5]
    assert {"time", "level", "logger", "message"} <= set(records[0])
    access = [r for r in records if r["logger"] == "proxy.access" and "/v1/completions" in r["message"]]
    assert access and all(r.get("request_id") for r in access)
    node_records = [json.loads(line) for line in (deployment.log_dir / "decode0.log").read_text().splitlines()
                    if line.startswith("{")]
    assert any(r["logger"] == "node.server" and "serving on" in r["message"] for r in node_records)
