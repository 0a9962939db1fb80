"""benchmarks/profile_serve.py's accounting, from numbers as a run gives them (no deployment
needed): CPU seconds against the run's core-seconds, the tail, and a process's own CPU time
(benchmarks/cpu_time.py, which it reads)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.cpu_time import process_cpu_s
from pdserve.bench_client import RequestRecord


def test_shares_are_of_wall_time_times_cores_and_idle_is_the_rest(profile_serve):
    result = profile_serve.accounting({"prefill0": 9.0, "decode0": 10.0, "proxy": 0.5, "load generator": 0.5},
                                      wall_s=10.0, num_cores=2)
    assert result["core_s"] == 20.0
    assert result["cpu_share"] == {"prefill0": 0.45, "decode0": 0.5, "proxy": 0.025, "load generator": 0.025}
    assert result["idle_share"] == pytest.approx(0.0)
    assert profile_serve.accounting({"decode0": 5.0}, wall_s=10.0, num_cores=2)["idle_share"] == 0.75


def test_the_tail_runs_from_the_last_first_token_to_the_last_token(profile_serve):
    records = [RequestRecord(0, is_ok=True, start_s=0.0, ttft_s=2.0, end_s=9.0),
               RequestRecord(1, is_ok=True, start_s=0.1, ttft_s=5.0, end_s=8.0),
               RequestRecord(2, is_ok=False, start_s=0.1, ttft_s=None, end_s=12.0)]  # failed: not counted
    assert profile_serve.tail_seconds(records) == pytest.approx(9.0 - 5.1)
    assert profile_serve.tail_seconds(records[2:]) is None


def test_a_process_cpu_seconds_grow_with_the_work_it_does():
    before = process_cpu_s(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert process_cpu_s(os.getpid()) - before >= 0.1


def test_another_process_cpu_seconds_are_counted_below_a_clock_tick():
    """A few milliseconds of work (a fake node's short run) read as such, not as 0 or 10 ms."""
    burn = ("import sys, time\nprint(flush=True)\nsys.stdin.readline()\nend = time.process_time() + 0.003\n"
            "while time.process_time() < end: pass\nprint(flush=True)\nsys.stdin.readline()\n")
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()  # its start-up done
        before = process_cpu_s(child.pid)
        child.stdin.write("\n")
        child.stdin.flush()
        child.stdout.readline()
        spent = process_cpu_s(child.pid) - before
    finally:
        child.kill()
        child.wait(timeout=10)
    assert 0.003 <= spent < 0.009
