"""A split model's node failing as a whole: a colocated node of TP=2 (a rank-0 process and one
worker rank over gloo) beside a one-rank node; killing the split node's worker rank fails that
node (it exits 1 and leaves no rank behind) while every stream in flight completes unchanged on
the other. (Greedy output of split nodes through the endpoint: test_tensor_parallel_disagg.py.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from pdserve.launcher import wait_healthy
from tests.e2e.conftest import start_nodes
from tests.e2e.test_availability import MAX_TOKENS, _Streams
from tests.e2e.test_pipeline import client_for, model_name


@pytest.fixture(scope="module")
def split(tiny_model_dir, tmp_path_factory):
    deployment = start_nodes(tiny_model_dir, tmp_path_factory.mktemp("tp-logs"), [],
                             [["--colocated", "--tensor-parallel-size", "2"], ["--colocated"]])
    try:
        wait_healthy(deployment, 120)
    except BaseException:
        deployment.stop()
        raise
    yield deployment
    deployment.stop()


def worker_pids(pid: int) -> list[int]:
    """The child processes of pid (a TP node's worker ranks)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in children.read_text().split()] if children.exists() else []


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_a_killed_rank_fails_its_node_and_every_stream_completes_elsewhere(split):
    client = client_for(split)
    prompts = [f"stream {i}: " + "the quick brown fox " * (2 + i) for i in range(4)]
    reference = [_text(client, p) for p in prompts]
    node = split.cluster.process("decode0")
    [worker] = worker_pids(node.pid)
    streams = _Streams(client, prompts)
    streams.wait_started(min_chunks=4)
    os.kill(worker, signal.SIGKILL)
    assert streams.results() == reference
    assert node.wait(timeout=30) == 1, "the node whose rank died exits 1 (its supervisor restarts it)"
    deadline = time.monotonic() + 10
    while is_alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_alive(worker)
    assert _text(client, prompts[0]) == reference[0]  # the other node serves on


def _text(client, prompt: str) -> str:
    response = client.completions.create(model=model_name(client), prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    return response.choices[0].text
