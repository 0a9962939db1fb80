"""`pdserve up` supervises: a node process that dies is restarted with backoff and serves again,
the rest keep serving, and SIGTERM stops every process it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.cluster import Cluster, Supervisor
from pdserve.ports import free_port, wait_http_ok
from tests.conftest import assert_every_request_answered, live_processes

EXIT_AT_ONCE = [sys.executable, "-c", "import sys; sys.exit(3)"]
SLEEP_LONG = [sys.executable, "-c", "import time; time.sleep(60)"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_process_that_keeps_dying_is_restarted_with_doubling_backoff(tmp_path):
    cluster, clock = Cluster(), Clock()
    supervisor = Supervisor(cluster, initial_backoff_s=1.0, max_backoff_s=4.0, clock=clock)
    try:
        cluster.start("decode0", EXIT_AT_ONCE, tmp_path)
        cluster.start("prefill0", SLEEP_LONG, tmp_path)
        waits = []
        for _ in range(4):
            wait_for(lambda: cluster.dead_names() == ["decode0"])
            [event] = supervisor.tick()
            assert "decode0 ended (exit 3)" in event
            waits.append(float(event.rsplit("in ", 1)[1].split()[0]))
            assert supervisor.tick() == []  # not before its backoff
            clock.now += waits[-1]
            [restarted] = supervisor.tick()
            assert re.fullmatch(r"decode0 restarted \(pid \d+, a new process\)", restarted)
        assert waits == [1.0, 2.0, 4.0, 4.0]
        assert supervisor.num_restarts == 4
        assert cluster.process("prefill0").poll() is None  # the others keep running
    finally:
        cluster.stop(timeout_s=5)
    assert all(proc.poll() is not None for _, proc in cluster.procs)


class _StandbyCluster(Cluster):
    """Records standby starts instead of starting one."""

    def __init__(self) -> None:
        super().__init__()
        self.standby_starts: list[float] = []
        self.standing_by = False

    @property
    def has_standby(self) -> bool:
        return self.standing_by

    def start_standby(self) -> None:
        self.standing_by = True
        self.standby_starts.append(-1.0)


def test_the_standby_starts_once_the_host_is_quiet_or_at_the_latest_after_15_s():
    cluster, clock, load = _StandbyCluster(), Clock(), iter([])
    supervisor = Supervisor(cluster, keep_standby=True, clock=clock, host_load=lambda: next(load))

    def ticks(shares: list[float | None]) -> None:
        nonlocal load
        load = iter(shares)
        for _ in shares:
            supervisor.tick()
            clock.now += 0.2

    ticks([None, 0.9, 0.6, 0.2, 0.2, 0.2, 0.2, 0.9])  # the first requests after ready: never quiet for 1 s
    assert cluster.standby_starts == []
    ticks([0.1] * 6)  # quiet for 1 s
    assert len(cluster.standby_starts) == 1
    cluster.standing_by = False  # it became a node (a restart): a new one is due again, once quiet
    ticks([0.9] * 74)
    assert len(cluster.standby_starts) == 1
    ticks([0.9] * 3)  # 15 s after it was due, busy or not
    assert len(cluster.standby_starts) == 2


def test_backoff_starts_over_after_a_long_healthy_run(tmp_path):
    cluster, clock = Cluster(), Clock()
    supervisor = Supervisor(cluster, initial_backoff_s=1.0, reset_after_s=60.0, clock=clock)
    try:
        cluster.start("decode0", EXIT_AT_ONCE, tmp_path)
        for expected in (1.0, 2.0):
            wait_for(lambda: cluster.dead_names() == ["decode0"])
            assert supervisor.tick()[0].endswith(f"in {expected:g} s")
            clock.now += expected
            supervisor.tick()
        clock.now += 61  # the restarted process "ran" a long time before dying again
        wait_for(lambda: cluster.dead_names() == ["decode0"])
        assert supervisor.tick()[0].endswith("in 1 s")  # initial_backoff_s
    finally:
        cluster.stop(timeout_s=5)


def test_stop_ends_the_proxy_first_then_prefill_then_decode(tmp_path):
    cluster = Cluster()
    marker = tmp_path / "order"
    script = ("import signal, sys, time\n"
              "def bye(*_):\n    open(sys.argv[2], 'a').write(sys.argv[1] + '\\n'); sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, bye)\ntime.sleep(60)\n")
    for name in ("decode0", "prefill0", "proxy"):
        cluster.start(name, [sys.executable, "-c", script, name, str(marker)], tmp_path)
    time.sleep(0.5)  # let each install its handler (a bare start-up; nothing to poll for)
    cluster.stop(timeout_s=5)
    assert marker.read_text().split() == ["proxy", "prefill0", "decode0"]


def _children_of(pid: int) -> dict[int, str]:
    """pid -> command line of every live process whose parent is pid."""
    return {child: cmdline for child, (parent, cmdline) in live_processes().items() if parent == pid}


@pytest.fixture
def pdserve_up(tiny_model_dir, tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(tiny_model_dir), "--port", str(port),
            "--log-dir", str(tmp_path / "logs"), "--max-num-batched-tokens", "256", "--no-enable-prefix-caching"]
    out = open(tmp_path / "up.log", "wb")  # noqa: SIM115 - closed in the finalizer
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc, f"http://127.0.0.1:{port}", tmp_path / "up.log"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        out.close()


def _total_blocks(health_url: str) -> int:
    text = httpx.get(health_url + "/metrics", timeout=10).text
    return int(float(re.search(r"^pdserve_node_kv_blocks_total\{.*\} (\S+)$", text, re.MULTILINE).group(1)))


def _complete(base_url: str) -> httpx.Response:
    body = {"model": "tiny-seed0", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
    return httpx.post(base_url + "/v1/completions", json=body, timeout=60)


def test_pdserve_up_restarts_a_killed_decode_node_and_stops_everything_on_sigterm(pdserve_up):
    proc, base_url, log = pdserve_up
    wait_http_ok(base_url + "/health", 180, check=lambda: proc.poll() is None or pytest.fail(log.read_text()))
    assert _complete(base_url).status_code == 200
    children = _children_of(proc.pid)
    # Node switches reach every node; each node serves /metrics on the health port it printed.
    assert all("--no-enable-prefix-caching" in cmd for cmd in children.values() if "--node-id" in cmd)
    [metrics_url] = re.findall(r"prefill0: (http://\S+)/health", log.read_text())
    assert "vllm:prompt_tokens_total" in httpx.get(metrics_url + "/metrics", timeout=10).text
    [decode_url] = re.findall(r"decode0: (http://\S+)/health", log.read_text())
    blocks = _total_blocks(decode_url)  # sized by the node from free memory (no --num-blocks given)
    [decode_pid] = [pid for pid, cmd in children.items() if "--node-id decode0" in cmd]
    # The standby process starts once the host is quiet (not beside the first requests after ready).
    wait_for(lambda: any("pdserve.standby" in cmd for cmd in _children_of(proc.pid).values()), timeout_s=90)
    os.kill(decode_pid, signal.SIGKILL)
    wait_for(lambda: "decode0 restarted" in log.read_text(), timeout_s=30)
    # The standby process (imports done, kept ready by the launcher) became the node.
    [new_pid] = [int(pid) for pid in re.findall(r"decode0 restarted \(pid (\d+), the standby process\)",
                                                 log.read_text())]
    assert new_pid != decode_pid and "pdserve.standby" in _children_of(proc.pid)[new_pid]
    # The proxy routes around the dead node and back to the restarted one without a restart.
    wait_for(lambda: _complete(base_url).status_code == 200, timeout_s=120)
    assert _total_blocks(decode_url) == blocks  # the capacity it sized at first, whatever memory is free now
    assert proc.poll() is None
    assert_every_request_answered(base_url)
    started = set(_children_of(proc.pid))
    os.killpg(proc.pid, signal.SIGTERM)  # the launcher's own group: its children lead their own
    proc.wait(timeout=60)
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in started), timeout_s=10)
