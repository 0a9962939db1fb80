"""End-to-end fixtures: real node and proxy processes on 127.0.0.1, always stopped (by pid)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from pdserve.launcher import Cluster, free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Deployment:
    """A running proxy with its nodes; base_url is the OpenAI endpoint."""

    cluster: Cluster
    base_url: str
    node_addresses: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None

    def logs(self) -> str:
        if not self.log_dir:
            return ""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.log_dir.glob("*.log")))


def start_deployment(model_dir: Path, log_dir: Path, num_prefill: int = 1, num_decode: int = 1,
                     node_args: tuple[str, ...] = (), proxy_args: tuple[str, ...] = (),
                     transfer_backend: str = "nixl", timeout_s: float = 120.0) -> Deployment:
    """Start the nodes and the proxy as separate processes and wait until /health is 200."""
    cluster = Cluster()
    log_dir.mkdir(parents=True, exist_ok=True)
    pdserve = [sys.executable, "-m", "pdserve.cli"]
    common = ["--model", str(model_dir), "--host", "127.0.0.1", "--transfer-backend", transfer_backend, *node_args]
    addresses: dict[str, str] = {}
    for i in range(num_prefill):
        port = free_port()
        addresses[f"prefill{i}"] = f"127.0.0.1:{port}"
        cluster.start(f"prefill{i}", pdserve + ["prefill", *common, "--port", str(port), "--node-id", f"prefill{i}"], log_dir)
    for i in range(num_decode):
        port = free_port()
        addresses[f"decode{i}"] = f"127.0.0.1:{port}"
        role = "decode" if num_prefill else "both"
        cluster.start(f"decode{i}", pdserve + ["decode", *common, "--port", str(port), "--role", role,
                                               "--node-id", f"decode{i}"], log_dir)
    http_port = free_port()
    proxy_argv = pdserve + ["proxy", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(http_port),
                            "--decode", ",".join(a for n, a in addresses.items() if n.startswith("decode")),
                            *proxy_args]
    if num_prefill:
        proxy_argv += ["--prefill", ",".join(a for n, a in addresses.items() if n.startswith("prefill"))]
    cluster.start("proxy", proxy_argv, log_dir)
    deployment = Deployment(cluster, f"http://127.0.0.1:{http_port}", addresses, log_dir)
    try:
        wait_healthy(deployment, timeout_s)
    except BaseException:
        cluster.stop()
        raise
    return deployment


def wait_healthy(deployment: Deployment, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = deployment.cluster.dead()
        if dead:
            raise RuntimeError(f"processes ended during start-up: {dead}\n{deployment.logs()}")
        try:
            if httpx.get(deployment.base_url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"not healthy after {timeout_s} s\n{deployment.logs()}")


@pytest.fixture
def deployment_factory(tmp_path):
    """Call it to start a deployment; every one started is stopped when the test ends."""
    started: list[Deployment] = []

    def start(model_dir: Path, **kwargs) -> Deployment:
        deployment = start_deployment(model_dir, tmp_path / f"logs{len(started)}", **kwargs)
        started.append(deployment)
        return deployment

    yield start
    for deployment in started:
        deployment.cluster.stop()
