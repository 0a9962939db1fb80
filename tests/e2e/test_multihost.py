"""Nodes on separate hosts: the proxy, 2 prefill and 2 decode nodes each in a network namespace
of its own (own address, veth to a bridge), KV moving over NIXL/UCX TCP between them, every
control and side-channel socket under the cluster secret (off loopback, nothing runs without
one). Greedy output equals transformers' and no prompt falls back or is prefilled on a decode
node."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import openai
import pytest

from engine.protocol import curve_keys
from pdserve.launcher import Cluster, Deployment, wait_healthy
from pdserve.netns import TestNetwork
from tests.e2e.conftest import CLUSTER_SECRET, NODE_ARGS, assert_kv_path_only, wait_blocks_free
from tests.e2e.test_pipeline import hf, hf_greedy, random_prompts  # noqa: F401 - hf is a fixture

NODE_PORT = 7100  # every host has its own port space
PROXY_PORT = 8000
PDSERVE = [sys.executable, "-m", "pdserve.cli"]
NAMES = ["proxy", "prefill0", "prefill1", "decode0", "decode1"]


def _start_hosts(net: TestNetwork, model_dir: Path, log_dir: Path) -> Deployment:
    cluster = Cluster()
    addresses = {name: f"{net.hosts[name].address}:{NODE_PORT}" for name in NAMES[1:]}
    for name in NAMES[1:]:
        kind = name.rstrip("0123456789")
        argv = PDSERVE + [kind, "--model", str(model_dir), "--host", net.hosts[name].address, "--port",
                          str(NODE_PORT), "--node-id", name, "--cluster-secret", CLUSTER_SECRET, *NODE_ARGS]
        cluster.start(name, net.hosts[name].command(argv), log_dir)
    proxy_argv = PDSERVE + ["proxy", "--model", str(model_dir), "--host", net.hosts["proxy"].address,
                            "--port", str(PROXY_PORT), "--local-prefill-min-wait-s", "-1",
                            "--cluster-secret", CLUSTER_SECRET,
                            "--prefill", ",".join(addresses[n] for n in ("prefill0", "prefill1")),
                            "--decode", ",".join(addresses[n] for n in ("decode0", "decode1"))]
    cluster.start("proxy", net.hosts["proxy"].command(proxy_argv), log_dir)
    return Deployment(cluster, f"http://{net.hosts['proxy'].address}:{PROXY_PORT}", addresses, log_dir)


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


def test_32_concurrent_greedy_requests_across_five_hosts_equal_transformers(multihost, hf):  # noqa: F811
    deployment, net = multihost
    prompts = random_prompts(32, [5, 17, 40, 130, 300], seed=21)
    expected = [hf_greedy(hf, p, 8)[0] for p in prompts]
    _, tokenizer = hf

    async def run_all():
        client = openai.AsyncOpenAI(base_url=deployment.base_url + "/v1", api_key="unused", max_retries=0,
                                    timeout=300)
        name = (await client.models.list()).data[0].id
        return await asyncio.gather(*[client.completions.create(model=name, prompt=p, max_tokens=8, temperature=0)
                                      for p in prompts])

    results = asyncio.run(run_all())
    for i, (result, want) in enumerate(zip(results, expected)):
        assert result.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), f"prompt {i}"
    keys = curve_keys(CLUSTER_SECRET)
    assert_kv_path_only(deployment, keys)
    # Each node listens on its own host's address, not loopback, and holds nothing afterwards.
    for name, address in deployment.node_addresses.items():
        assert address.startswith(net.hosts[name].address + ":")
        report = wait_blocks_free(address, keys=keys)
        assert report.num_free_blocks == report.num_total_blocks, name
