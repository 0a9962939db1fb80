"""End-to-end fixtures: real node and proxy processes on 127.0.0.1, always stopped (by pid)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from engine import protocol
from pdserve.launcher import Deployment, start_local, wait_healthy

# Small enough that a long prompt is split across prefill steps (chunked prefill).
NODE_ARGS = ("--max-num-batched-tokens", "256", "--num-blocks", "512", "--max-num-seqs", "32")
# Disaggregated tests prove the KV path: no prompt is prefilled on a decode node by choice
# (conditional disaggregation off), and each test checks that no pull fell back either.
KV_PATH_ONLY = ("--local-prefill-min-wait-s", "-1")


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


def assert_kv_path_only(deployment: Deployment) -> None:
    for name, address in deployment.node_addresses.items():
        assert node_load(address).num_kv_fallbacks == 0, f"{name}: a KV pull fell back to local prefill"
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


def node_load(address: str, timeout_s: float = 5.0) -> protocol.LoadReport:
    """Ask a node for its LoadReport directly over its control socket."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
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


def wait_blocks_free(address: str, timeout_s: float = 5.0) -> protocol.LoadReport:
    """Poll a node until every block is free and nothing runs; returns the last report."""
    deadline = time.monotonic() + timeout_s
    report = node_load(address)
    while time.monotonic() < deadline:
        report = node_load(address)
        idle = report.num_running == 0 and report.num_waiting == 0 and report.num_leases == 0
        if idle and report.num_free_blocks == report.num_total_blocks and report.num_pending_pulls == 0:
            return report
        time.sleep(0.05)
    return report
