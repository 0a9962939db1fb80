"""Issue 4, point 4: an idle process with a registered NIXL agent does not poll a core (a few
percent of one, measured over 4 s), and a transfer completes promptly while both sides' loops are busy with
(simulated) model steps that never call into NIXL."""

import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch

from benchmarks.cpu_time import process_cpu_s
from kv_transfer.base import RemoteLease
from kv_transfer.config import TransferConfig
from kv_transfer.factory import create_connector
from kv_transfer.layout import KVLayout
from kv_transfer.lease import LeaseTable
from tests.conftest import child_env
from tests.kv_transfer.helpers import json_line

# Alone on the machine (make test's serial part): a CPU share and a read's time are bounded here.
pytestmark = pytest.mark.serial

REPO = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32", num_blocks=160,
                  model_fingerprint="idle", code_version="1")
HOLDER = """
import json, sys, time, os, msgspec, torch
from kv_transfer.config import TransferConfig
from kv_transfer.factory import create_connector
from kv_transfer.layout import KVLayout
from kv_transfer.lease import LeaseTable
from kv_transfer.ucx import exit_now
layout = msgspec.json.decode(sys.argv[1], type=KVLayout)
mode = sys.argv[2]
shape = (layout.num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
cache = torch.randn(shape, generator=torch.Generator().manual_seed(4))
connector = create_connector(TransferConfig(), cache, layout, "h")
leases = LeaseTable(60.0)
connector.serve_leases(leases)
generations = {"warm": leases.add("warm", [0]), "busy": leases.add("busy", list(range(1, 129)))}
print(json.dumps({"address": connector.agent_address, "engine_id": connector.engine_id,
                  "generations": generations}), flush=True)
sys.stdin.readline()
if mode == "idle":  # a node's idle loop: wait for work with a timeout, look at ended leases
    deadline = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < deadline:
        time.sleep(0.05)
        leases.pop_ended()
else:  # model steps of 300 ms that never call into NIXL, ended leases read between steps
    released = []
    deadline = time.monotonic() + 5
    while "busy" not in released and time.monotonic() < deadline:
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            pass
        released += [request_id for request_id, _ in leases.pop_ended()]
    print(json.dumps({"released": released}), flush=True)
exit_now(0)
"""


def start_holder(mode: str, *args: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, msgspec.json.encode(LAYOUT).decode(), mode, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=REPO, env=child_env(), start_new_session=True)
    return proc, json_line(proc)


def _lease(hello: dict, request_id: str, block_ids: list[int]) -> RemoteLease:
    return RemoteLease(hello["engine_id"], hello["address"], block_ids, hello["generations"][request_id], 60.0)


def test_idle_registered_agent_does_not_poll_a_core():
    proc, _ = start_holder("idle", "12")
    try:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(1.0)  # past start-up work
        before, start = process_cpu_s(proc.pid), time.monotonic()
        time.sleep(4.0)  # a busy poll would take ~4 s of CPU here
        share = (process_cpu_s(proc.pid) - before) / (time.monotonic() - start)
        print(f"\nidle NIXL process: {100 * share:.2f}% of one core over 4 s")
        # NOTE: measured at 2-5% on an idle 2-core machine (5.25% once in a clean-clone make
        # test); the bound separates "sleeps between looks" from a polling loop with room for a
        # loaded machine, and test_progress_is_frequent_only_while_a_lease_may_be_read counts the
        # progress thread's calls themselves.
        assert share < 0.15
    finally:
        proc.kill()
        proc.wait()


def test_transfer_completes_promptly_while_both_loops_run_model_steps():
    proc, hello = start_holder("busy")
    shape = (LAYOUT.num_blocks, LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    cache = torch.zeros(shape)
    connector = create_connector(TransferConfig(), cache, LAYOUT, "reader")
    try:
        connector.start_read("warm", _lease(hello, "warm", [0]), [0])
        deadline = time.monotonic() + 20
        while not connector.poll() and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        blocks = list(range(1, 129))  # 2,048 tokens of the small preset's shape: 23.6 MB
        started = time.monotonic()
        connector.start_read("busy", _lease(hello, "busy", blocks), blocks)
        results, steps = [], 0
        while not results and time.monotonic() - started < 10:
            end = time.perf_counter() + 0.02  # a 20 ms model step, then the loop polls
            while time.perf_counter() < end:
                pass
            steps += 1
            results = connector.poll()
        elapsed = time.monotonic() - started
        print(f"\n128-block read during busy loops: {elapsed * 1000:.0f} ms, {steps} reader steps")
        assert results and results[0].is_ok
        assert elapsed < 1.0  # the holder's 300 ms steps never stall it
        expected = torch.randn(shape, generator=torch.Generator().manual_seed(4))
        assert torch.equal(cache[blocks], expected[blocks])
        assert "busy" in json_line(proc)["released"]
    finally:
        connector.close()
        proc.kill()
        proc.wait()


class _CountedAgent:
    """The connector's NIXL agent, counting get_new_notifs() calls (its progress thread's)."""

    def __init__(self, agent) -> None:
        self._agent = agent
        self.num_progress_calls = 0

    def get_new_notifs(self):
        self.num_progress_calls += 1
        return self._agent.get_new_notifs()

    def __getattr__(self, name):
        return getattr(self._agent, name)


def _progress_calls_over(agent: _CountedAgent, seconds: float) -> int:
    before = agent.num_progress_calls
    time.sleep(seconds)
    return agent.num_progress_calls - before


def test_progress_is_frequent_only_while_a_lease_may_be_read():
    shape = (LAYOUT.num_blocks, LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    connector = create_connector(TransferConfig(), torch.zeros(shape), LAYOUT, "holder")
    agent = connector._agent = _CountedAgent(connector._agent)
    leases = LeaseTable(60.0)
    connector.serve_leases(leases)
    try:
        assert not connector.may_transfer()
        idle_calls = _progress_calls_over(agent, 1.0)  # every 100 ms: ~10
        leases.add("r", [0, 1])
        assert connector.may_transfer()
        leased_calls = _progress_calls_over(agent, 1.0)  # every 5 ms: up to 200
        leases.release("r")
        assert not connector.may_transfer()
        print(f"\nprogress calls in 1 s: {idle_calls} idle, {leased_calls} with a lease held")
        assert idle_calls <= 15
        assert leased_calls >= 5 * max(idle_calls, 1)
    finally:
        connector.close()
