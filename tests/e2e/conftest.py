"""End-to-end fixtures: real node and proxy processes on 127.0.0.1, always stopped (by pid)."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from engine import protocol
from pdserve.cluster import Cluster
from pdserve.launcher import Deployment, start_local, wait_healthy
from pdserve.ports import free_port

# Small enough that a long prompt is split across prefill steps (chunked prefill).
NODE_ARGS = ("--max-num-batched-tokens", "256", "--num-blocks", "512", "--max-num-seqs", "32")
# Disaggregated tests prove the KV path: no prompt is prefilled on a decode node by choice
# (conditional disaggregation off), and each test checks that no pull fell back either.
KV_PATH_ONLY = ("--local-prefill-min-wait-s", "-1")
CLUSTER_SECRET = "e2e-cluster-secret-not-for-production"


def pytest_collection_modifyitems(items) -> None:
    """Every end-to-end test is serial (make test runs them alone, after the parallel part):
    each starts several processes of its own, and two such tests side by side took 1.5x longer."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.serial)


def _start(model_dir: Path, log_dir: Path, timeout_s: float = 120.0, **kwargs) -> Deployment:
    log_dir.mkdir(parents=True, exist_ok=True)
    kwargs.setdefault("node_args", NODE_ARGS)
    deployment = start_local(model_dir, log_dir=log_dir, pin_cpus=False, **kwargs)
    try:
        wait_healthy(deployment, timeout_s)
    except BaseException:
        deployment.stop()
        raise
    return deployment


@pytest.fixture(scope="module")
def disaggregated(tiny_model_dir, tmp_path_factory):
    """1 prefill + 1 decode node (NIXL) and the proxy, shared by a module's tests; local prefill
    is off, and every test using it ends by asserting that nothing fell back (see below)."""
    deployment = _start(tiny_model_dir, tmp_path_factory.mktemp("pd-logs"), num_prefill=1, num_decode=1,
                        proxy_args=KV_PATH_ONLY)
    yield deployment
    deployment.stop()


@pytest.fixture(autouse=True)
def _every_prompt_went_through_the_kv_path(request):
    """After each test on the disaggregated deployment: zero KV fallbacks on every decode node
    and zero prompts prefilled on a decode node."""
    yield
    if "disaggregated" not in request.fixturenames:
        return
    deployment = request.getfixturevalue("disaggregated")
    assert_kv_path_only(deployment)


def assert_kv_path_only(deployment: Deployment, keys: protocol.CurveKeys | None = None) -> None:
    for name, address in deployment.node_addresses.items():
        assert node_load(address, keys=keys).num_kv_fallbacks == 0, f"{name}: a KV pull fell back to local prefill"
    metrics = httpx.get(deployment.base_url + "/metrics", timeout=5).text
    local = [line for line in metrics.splitlines() if line.startswith("pdserve_local_prefills_total")]
    assert local and float(local[0].split()[-1]) == 0, local


@pytest.fixture(scope="module")
def colocated(tiny_model_dir, tmp_path_factory):
    """One colocated node (prefill and decode in one engine) and the proxy."""
    deployment = _start(tiny_model_dir, tmp_path_factory.mktemp("colo-logs"), num_prefill=0, num_decode=1)
    yield deployment
    deployment.stop()


@pytest.fixture
def deployment_factory(tmp_path):
    """start(model_dir, **start_local kwargs) -> a healthy Deployment; each is stopped when the
    test ends, also when it fails."""
    started: list[Deployment] = []

    def start(model_dir: Path, **kwargs) -> Deployment:
        deployment = _start(model_dir, tmp_path / f"logs{len(started)}", **kwargs)
        started.append(deployment)
        return deployment

    yield start
    for deployment in started:
        deployment.stop()


@contextlib.contextmanager
def environment(**variables: str):
    """os.environ with variables set (children started meanwhile inherit them), restored after."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def secret_disaggregated(tiny_model_dir, tmp_path_factory):
    """As disaggregated, with a cluster secret (given as PDSERVE_CLUSTER_SECRET to every process):
    every proxy-node and KV side-channel socket speaks CURVE."""
    with environment(PDSERVE_CLUSTER_SECRET=CLUSTER_SECRET):
        deployment = _start(tiny_model_dir, tmp_path_factory.mktemp("secret-logs"), num_prefill=1, num_decode=1,
                            proxy_args=KV_PATH_ONLY)
    yield deployment
    deployment.stop()


def start_nodes(model_dir: Path, log_dir: Path, prefill_args: list[list[str]], decode_args: list[list[str]],
                proxy_args: tuple[str, ...] = (), common: tuple[str, ...] = NODE_ARGS) -> Deployment:
    """As pdserve.launcher.start_local, with each node's own arguments (after common); not
    waiting for health. The caller stops the deployment."""
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster, addresses = Cluster(), {}
    pdserve = [sys.executable, "-m", "pdserve.cli"]
    for kind, per_node in (("prefill", prefill_args), ("decode", decode_args)):
        for i, extra in enumerate(per_node):
            name = f"{kind}{i}"
            addresses[name] = f"127.0.0.1:{free_port()}"
            cluster.start(name, pdserve + [kind, "--model", str(model_dir), "--port", addresses[name].rsplit(":")[1],
                                           "--node-id", name, *common, *extra], log_dir)
    http_port = free_port()
    joined = {kind: ",".join(a for n, a in addresses.items() if n.startswith(kind)) for kind in ("prefill", "decode")}
    cluster.start("proxy", pdserve + ["proxy", "--model", str(model_dir), "--port", str(http_port),
                                      "--prefill", joined["prefill"], "--decode", joined["decode"], *proxy_args],
                  log_dir)
    return Deployment(cluster, f"http://127.0.0.1:{http_port}", addresses, log_dir)


def secure(socket: zmq.Socket, keys: protocol.CurveKeys | None) -> zmq.Socket:
    """Make socket a CURVE client of the cluster with keys (no-op for None)."""
    if keys is not None:
        socket.curve_serverkey = keys.server_public
        socket.curve_publickey = keys.client_public
        socket.curve_secretkey = keys.client_secret
    return socket


def node_load(address: str, timeout_s: float = 5.0, keys: protocol.CurveKeys | None = None) -> protocol.LoadReport:
    """Ask a node for its LoadReport directly over its control socket (with the cluster's keys
    when it has a secret)."""
    socket = secure(zmq.Context.instance().socket(zmq.DEALER), keys)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"tcp://{address}")
    try:
        socket.send(protocol.encode(protocol.Ping()))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if socket.poll(100):
                try:
                    message = protocol.decode_from_node(socket.recv())
                except msgspec.DecodeError:
                    continue
                if isinstance(message, protocol.LoadReport):
                    return message
        raise TimeoutError(f"no load report from {address} within {timeout_s} s")
    finally:
        socket.close(linger=0)


def wait_blocks_free(address: str, timeout_s: float = 5.0,
                     keys: protocol.CurveKeys | None = None) -> protocol.LoadReport:
    """Poll a node until every block is free and nothing runs; returns the last report."""
    deadline = time.monotonic() + timeout_s
    report = node_load(address, keys=keys)
    while time.monotonic() < deadline:
        report = node_load(address, keys=keys)
        idle = report.num_running == 0 and report.num_waiting == 0 and report.num_leases == 0
        if idle and report.num_free_blocks == report.num_total_blocks and report.num_pending_pulls == 0:
            return report
        time.sleep(0.05)
    return report


def borrowed_steps(health_url: str) -> float:
    text = httpx.get(health_url + "/metrics", timeout=5).text
    found = re.search(r"^pdserve_node_borrowed_core_steps_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert found, "no pdserve_node_borrowed_core_steps_total on the decode node"
    return float(found.group(1))


def finished_requests(health_url: str, reason: str) -> int:
    """How many requests the node finished for this reason (its vllm:request_success counter)."""
    text = httpx.get(health_url + "/metrics", timeout=10).text
    return sum(int(sample.value) for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "vllm:request_success_total" and sample.labels.get("finished_reason") == reason)
