"""Prefill and decode nodes of different tensor-parallel degrees, real processes: 1P(TP=1)+1D(TP=2),
1P(TP=2)+1D(TP=1) and 1P(TP=2)+1D(TP=2), over NIXL (DRAM) and over gloo. Through the OpenAI
endpoint greedy output equals transformers' (so a colocated one-rank node's), every prompt's KV
went through the pull (local prefill off, zero fallbacks), every decode rank's cache got every
pulled block (its own heads), and a client gone mid-pull leaves no block held on either node.

Per transport, four nodes (prefill and decode of TP=1 and TP=2) serve three proxies, one per pair
(a node serves any number of proxies): the three pairs for the start-up of four nodes. A fourth
proxy sends to both decode nodes; last, killing the split decode node's worker rank fails that
node as a whole (it exits 1, leaving no rank behind) while every stream in flight on it completes
unchanged on the other.

On a GPU (nixl-cuda) the same runs with every node on it, float32: a split node's ranks share the
one GPU (engine.tp_group.ranks_share_gpu: NCCL takes one rank per GPU), so the KV moves between GPU
caches over NIXL, each worker rank's cache allocated by rank 0 and opened by the worker."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.tp_group import SHARE_GPU_VARIABLE
from pdserve.cluster import Cluster
from pdserve.launcher import Deployment, wait_healthy
from pdserve.ports import free_port
from tests.conftest import assert_every_request_answered, is_alive
from tests.e2e.conftest import KV_PATH_ONLY, NODE_ARGS, assert_kv_path_only, node_load, wait_blocks_free
from tests.e2e.test_availability import MAX_TOKENS, _Streams
from tests.e2e.test_pipeline import client_for, hf, hf_greedy, hf_greedy_ignoring_eos, model_name, random_prompts  # noqa: F401 - hf: fixture
from tests.kernels.conftest import gpu, requires_cuda

PAIRS = [(1, 2), (2, 1), (2, 2)]


@pytest.fixture(scope="module", params=["nixl", "gloo", pytest.param("nixl-cuda", marks=[gpu, requires_cuda])])
def split_nodes(request, tiny_model_dir, tmp_path_factory):
    """{(prefill TP, decode TP): a Deployment of that pair's proxy and its two nodes}."""
    backend, _, device = request.param.partition("-")
    on_gpu = ["--device", "cuda", "--dtype", "float32"] if device else []
    env = {SHARE_GPU_VARIABLE: "1"} if device else None
    log_dir = tmp_path_factory.mktemp(f"tp-{request.param}")
    cluster, addresses, health = Cluster(), {}, {}
    pdserve = [sys.executable, "-m", "pdserve.cli"]
    try:
        for kind in ("prefill", "decode"):
            for size in (1, 2):
                name, port, health_port = f"{kind}-tp{size}", free_port(), free_port()
                addresses[name], health[name] = f"127.0.0.1:{port}", f"http://127.0.0.1:{health_port}"
                cluster.start(name, pdserve + [kind, "--model", str(tiny_model_dir), "--port", str(port), "--node-id",
                                               name, "--health-port", str(health_port), *NODE_ARGS, *on_gpu,
                                               "--transfer-backend", backend, "--tensor-parallel-size", str(size)],
                              log_dir, env)
        pairs = {}
        for prefill_tp, decode_tp in PAIRS:
            port, prefill, decode = free_port(), f"prefill-tp{prefill_tp}", f"decode-tp{decode_tp}"
            cluster.start(f"proxy-{prefill_tp}-{decode_tp}",
                          pdserve + ["proxy", "--model", str(tiny_model_dir), "--port", str(port), "--prefill",
                                     addresses[prefill], "--decode", addresses[decode], *KV_PATH_ONLY], log_dir)
            pairs[prefill_tp, decode_tp] = Deployment(
                cluster, f"http://127.0.0.1:{port}", {"prefill0": addresses[prefill], "decode0": addresses[decode]},
                log_dir, {"prefill0": health[prefill], "decode0": health[decode]})
        port = free_port()
        cluster.start("proxy-failover", pdserve + ["proxy", "--model", str(tiny_model_dir), "--port", str(port),
                                                   "--prefill", addresses["prefill-tp1"], "--decode",
                                                   f"{addresses['decode-tp2']},{addresses['decode-tp1']}",
                                                   *KV_PATH_ONLY], log_dir)
        pairs["failover"] = Deployment(cluster, f"http://127.0.0.1:{port}", dict(addresses), log_dir, dict(health))
        for deployment in pairs.values():
            wait_healthy(deployment, 120)
    except BaseException:
        cluster.stop()
        raise
    try:
        yield pairs
        for deployment in pairs.values():  # the proxies started here, beside any Deployment's (tests/conftest.py)
            assert_every_request_answered(deployment.base_url)
    finally:
        cluster.stop()


@pytest.fixture(params=PAIRS, ids=[f"P{p}-D{d}" for p, d in PAIRS])
def split_pair(request, split_nodes):
    return split_nodes[request.param], request.param[1]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of series name with labels (among others) in a Prometheus text page."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} {labels} not in the page")


def test_greedy_through_the_pull_equals_transformers_and_every_rank_gets_every_block(split_pair, hf):  # noqa: F811
    deployment, decode_tp = split_pair
    client = client_for(deployment)
    _, tokenizer = hf
    for prompt in random_prompts(3, [7, 40, 150], seed=5):
        want, want_logprobs = hf_greedy(hf, prompt, 12)
        response = client.completions.create(model=model_name(client), prompt=prompt, max_tokens=12, temperature=0.0,
                                             logprobs=1, extra_body={"ignore_eos": True})
        choice = response.choices[0]
        assert choice.text == tokenizer.decode(want, skip_special_tokens=True)
        assert all(abs(a - b) < 1e-4 for a, b in zip(choice.logprobs.token_logprobs, want_logprobs))
        assert response.system_fingerprint == "pdserve-kv:pulled"
    page = httpx.get(deployment.health_urls["decode0"] + "/metrics", timeout=5).text
    pulled = metric(page, "pdserve_node_kv_pulled_blocks_total")  # a decode node's, over the proxies it serves
    assert pulled >= 1 + 3 + 10  # the three prompts' blocks (16-token blocks)
    assert [metric(page, "pdserve_node_kv_pulled_rank_blocks_total", rank=str(r)) for r in range(decode_tp)] == \
        [pulled] * decode_tp
    assert not re.search(rf'pdserve_node_kv_pulled_rank_blocks_total{{[^}}]*rank="{decode_tp}"', page)
    assert_kv_path_only(deployment)


def test_a_client_gone_during_the_pull_leaves_no_block_held(split_pair):
    deployment, _ = split_pair
    body = {"model": model_name(client_for(deployment)), "prompt": random_prompts(1, [300], seed=8)[0],
            "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", deployment.base_url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # the first token: the prefill node's, while the decode node pulls
    for node, address in deployment.node_addresses.items():
        report = wait_blocks_free(address, timeout_s=10)
        assert report.num_free_blocks == report.num_total_blocks, f"{node} still holds blocks"
        assert report.num_running == 0 and report.num_leases == 0, node
    assert_kv_path_only(deployment)


def worker_pids(pid: int) -> list[int]:
    """The child processes of pid (a split node's worker ranks)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in children.read_text().split()] if children.exists() else []


def test_a_killed_rank_fails_its_node_and_its_streams_complete_on_the_other(split_nodes, hf):  # noqa: F811
    """Runs last for each transport: it leaves the split decode node dead."""
    deployment = split_nodes["failover"]
    _, tokenizer = hf
    prompts = [f"stream {i}: " + "the quick brown fox " * (2 + i) for i in range(6)]
    # the streams ignore EOS: so does the reference (generate() would stop there)
    reference = [tokenizer.decode(hf_greedy_ignoring_eos(hf, tokenizer.encode(p), MAX_TOKENS), skip_special_tokens=True)
                 for p in prompts]
    node = deployment.cluster.process("decode-tp2")
    [worker] = worker_pids(node.pid)
    streams = _Streams(client_for(deployment), prompts)
    streams.wait_started(min_chunks=4)
    assert node_load(deployment.node_addresses["decode-tp2"]).num_running > 0, "no stream on the split node"
    os.kill(worker, signal.SIGKILL)
    assert streams.results() == reference
    assert node.wait(timeout=30) == 1, "the node whose rank died exits 1 (its supervisor restarts it)"
    deadline = time.monotonic() + 10
    while is_alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_alive(worker)
