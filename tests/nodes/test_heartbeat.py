"""A node keeps reporting its load while one engine step runs longer than a proxy's heartbeat
timeout (a long CPU prefill chunk), and its reports count the requests it has received."""

from __future__ import annotations

import time

import pytest

from engine import protocol
from node.config import ServerConfig
from node.server import NodeServer
from tests.nodes.conftest import DEFAULT_MAX_NUM_SEQS, make_engine

STEP_S = 1.5
REPORT_INTERVAL_S = 0.1


@pytest.fixture
def slow_node(tiny_model_dir, serve_node):
    engine = make_engine(tiny_model_dir, max_num_seqs=DEFAULT_MAX_NUM_SEQS)
    real_step = engine.step

    def slow_step():
        time.sleep(STEP_S)  # stands in for a long model step; like torch ops, sleep frees the GIL
        return real_step()

    engine.step = slow_step
    node = serve_node(NodeServer(engine, ServerConfig("slow", load_report_interval_s=REPORT_INTERVAL_S)))
    return engine, node.socket


def _receive(socket, timeout_s: float) -> list:
    messages, deadline = [], time.monotonic() + timeout_s
    while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
        if socket.poll(left_ms):
            messages.append(protocol.decode_from_node(socket.recv()))
    return messages


def test_reports_keep_coming_during_a_step_longer_than_the_heartbeat_timeout(slow_node):
    engine, socket = slow_node
    options = protocol.SamplingOptions(max_tokens=2, temperature=0.0)
    socket.send(protocol.encode(protocol.DecodeRequest("r1", [5, 6, 7], options, seq=7)))
    messages = _receive(socket, 2 * STEP_S)
    report_times = [m.sent_at for m in messages if isinstance(m, protocol.LoadReport)]
    assert len(report_times) >= STEP_S / REPORT_INTERVAL_S / 2
    # No gap anywhere near a step's length: reports came while the loop was inside a step.
    assert max(b - a for a, b in zip(report_times, report_times[1:])) < STEP_S / 3
    assert any(m.last_request_seq == 7 for m in messages if isinstance(m, protocol.LoadReport))
    tokens = [m for m in messages if isinstance(m, protocol.TokenBatch)]
    assert tokens, "the slow engine still produced its first step's output"
