"""The proxy's liveness view of one node (proxy.node_client.NodeClient), without sockets: a new boot
id fails the old process's requests, a loop that stops progressing with work is down although it
reports, a draining node gets no new requests but keeps its running ones."""

from __future__ import annotations

import msgspec

from engine import protocol
from proxy.errors import NodeDied
from proxy.node_client import MessageQueue, NodeClient, take_report

_REPORT = protocol.LoadReport(node_id="d", role=protocol.Role.DECODE, protocol_version=protocol.PROTOCOL_VERSION,
                              model_name="m", max_model_len=64, block_size=16, num_running=0, num_waiting=0,
                              num_queued_prompt_tokens=0, num_free_blocks=8, num_total_blocks=8, boot_id="a",
                              progress=1)


def _report(**changes) -> protocol.LoadReport:
    return msgspec.structs.replace(_REPORT, **changes)


def test_a_new_boot_id_fails_the_old_processes_requests():
    node = NodeClient("127.0.0.1:1", "decode", heartbeat_timeout_s=3.0)
    take_report(node, _report())
    queue = node.queues["r1"] = MessageQueue()
    take_report(node, _report(progress=2))
    assert queue.empty()
    take_report(node, _report(boot_id="b", progress=1))
    assert isinstance(queue.get_nowait(), NodeDied)
    assert node.is_healthy and node.boot_id == "b"


def test_a_node_whose_loop_stands_still_with_work_is_down_although_it_reports():
    node = NodeClient("127.0.0.1:1", "decode", heartbeat_timeout_s=3.0, stall_timeout_s=0.05)
    take_report(node, _report(num_running=1))
    assert node.is_healthy
    node.progress_changed_at -= 1.0
    take_report(node, _report(num_running=1))  # the same progress: no step since
    assert node.is_stalled and not node.is_healthy
    take_report(node, _report(num_running=1, progress=2))
    assert node.is_healthy
    node.progress_changed_at -= 1.0
    take_report(node, _report(num_running=0, progress=2))  # idle: no progress needed
    assert node.is_healthy


def test_a_draining_node_stays_healthy_but_takes_no_new_requests():
    node = NodeClient("127.0.0.1:1", "prefill", heartbeat_timeout_s=3.0)
    take_report(node, _report(is_draining=True))
    assert node.is_healthy and not node.is_routable


def test_the_proxys_own_stall_is_not_held_against_its_nodes(start_proxy):
    """The whole process (proxy and fake nodes alike) frozen for twice the heartbeat timeout, as
    a starved machine freezes it: when it runs again the proxy's watch must not judge the nodes
    by reports that could not be sent or read meanwhile, and the stream across it completes."""
    import os
    import signal
    import subprocess

    from tests.proxy.conftest import MODEL_NAME

    proxy = start_proxy(node={"step_s": 0.05}, heartbeat_timeout_s=1.0)
    pool = proxy.app.state.pool
    stream = proxy.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=60, stream=True)
    chunks = [next(iter(stream))]
    # NOTE: another process wakes this one: SIGCONT in 2 s, then SIGSTOP to ourselves.
    waker = subprocess.Popen(["sh", "-c", f"sleep 2; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)
    waker.wait(timeout=10)
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(node.is_healthy for node in pool.all)
