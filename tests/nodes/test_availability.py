"""A node's side of availability: boot id and loop progress in its reports, draining (new
requests refused with a retryable code, running ones finished, then run() returns), and the HTTP
/health and /ready endpoint."""

from __future__ import annotations

import socket as stdlib_socket
import time
import urllib.error
import urllib.request

import pytest

from engine import protocol
from node.config import ServerConfig
from node.health import HealthServer
from node.server import NodeServer
from tests.nodes.conftest import DEFAULT_MAX_NUM_SEQS, make_engine, next_message

GREEDY = protocol.SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def node(tiny_model_dir, serve_node):
    server = NodeServer(make_engine(tiny_model_dir, max_num_seqs=DEFAULT_MAX_NUM_SEQS),
                        ServerConfig("n", load_report_interval_s=0.05))
    return serve_node(server)


def _report(socket) -> protocol.LoadReport:
    socket.send(protocol.encode(protocol.Ping()))
    return next_message(socket, protocol.LoadReport)


def test_reports_carry_a_fixed_boot_id_and_advancing_progress(node):
    server, _, socket = node
    first = _report(socket)
    time.sleep(0.2)
    second = _report(socket)
    assert first.boot_id == second.boot_id == server.boot_id and len(first.boot_id) == 32
    assert second.progress > first.progress
    assert not second.is_draining


def test_draining_refuses_new_requests_finishes_running_ones_then_returns(node):
    server, thread, socket = node
    socket.send(protocol.encode(protocol.DecodeRequest("running", [5, 6, 7], GREEDY, seq=1)))
    next_message(socket, protocol.TokenBatch)  # it runs
    server.drain()
    socket.send(protocol.encode(protocol.DecodeRequest("late", [5, 6, 7], GREEDY, seq=2)))
    num_tokens, refused = 0, None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (refused is None or num_tokens < GREEDY.max_tokens):
        if not socket.poll(100):
            continue
        message = protocol.decode_from_node(socket.recv())
        if isinstance(message, protocol.ErrorReply):
            refused = message
        elif isinstance(message, protocol.TokenBatch):
            num_tokens = max([num_tokens] + [d.first_token_idx + len(d.tokens) for d in message.deltas])
    assert refused is not None and refused.request_id == "late"
    assert refused.kind == protocol.DRAINING_ERROR_KIND and not refused.is_client_error
    assert num_tokens == GREEDY.max_tokens
    thread.join(timeout=10)
    assert not thread.is_alive()  # drained: run() returned by itself
    assert server.engine.num_free_blocks == server.engine.block_pool.num_blocks


class _FakeNode:
    def __init__(self) -> None:
        self.last_progress_at = time.monotonic()
        self.is_serving = True
        self.is_draining = False


def _status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_health_and_ready_follow_progress_and_draining(monkeypatch):
    """Also: starting it looks up no name for its address (http.server's getfqdn waited ~10 s
    for a resolver's timeouts where none answers, as in a network namespace)."""
    def no_lookups(*args):
        raise AssertionError(f"a DNS lookup of {args}")

    monkeypatch.setattr(stdlib_socket, "getfqdn", no_lookups)
    monkeypatch.setattr(stdlib_socket, "gethostbyaddr", no_lookups)
    fake = _FakeNode()
    health = HealthServer("127.0.0.1", 0, fake)
    health.start()
    try:
        assert (_status(health.port, "/health"), _status(health.port, "/ready")) == (200, 200)
        fake.is_draining = True
        assert (_status(health.port, "/health"), _status(health.port, "/ready")) == (200, 503)
        fake.last_progress_at -= 3600  # the loop is stuck
        assert _status(health.port, "/health") == 503
        assert _status(health.port, "/nope") == 404
    finally:
        health.close()


@pytest.fixture
def one_seq_node(tiny_model_dir, serve_node):
    """A node running one sequence at a time, with a waiting queue of at most one."""
    server = NodeServer(make_engine(tiny_model_dir, max_num_seqs=1),
                        ServerConfig("n", load_report_interval_s=0.05, max_num_waiting=1))
    return serve_node(server)


def _error_for(socket, request_id: str, timeout_s: float = 10.0) -> protocol.ErrorReply:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        message = next_message(socket, protocol.ErrorReply, deadline - time.monotonic())
        if message.request_id == request_id:
            return message
    raise TimeoutError(f"no ErrorReply for {request_id}")


def test_a_full_waiting_queue_refuses_new_requests_with_a_retryable_kind(one_seq_node):
    server, _, socket = one_seq_node
    long = protocol.SamplingOptions(max_tokens=200, temperature=0.0, ignore_eos=True)
    socket.send(protocol.encode(protocol.DecodeRequest("running", [5, 6, 7], long, seq=1)))
    next_message(socket, protocol.TokenBatch)  # it runs: the one slot is taken
    socket.send(protocol.encode(protocol.DecodeRequest("waiting", [5, 6, 8], long, seq=2)))
    socket.send(protocol.encode(protocol.DecodeRequest("refused", [5, 6, 9], long, seq=3)))
    refused = _error_for(socket, "refused")
    assert refused.kind == protocol.QUEUE_FULL_ERROR_KIND and not refused.is_client_error
    assert protocol.QUEUE_FULL_ERROR_KIND in protocol.RETRYABLE_ERROR_KINDS
    report = _report(socket)
    assert (report.max_num_waiting, report.num_waiting, report.num_running) == (1, 1, 1)
    socket.send(protocol.encode(protocol.Abort(["running", "waiting"])))
    deadline = time.monotonic() + 10
    while _report(socket).num_free_blocks != server.engine.block_pool.num_blocks:
        assert time.monotonic() < deadline, "blocks not freed after the aborts"
        time.sleep(0.05)
    socket.send(protocol.encode(protocol.DecodeRequest("later", [5, 6, 9], GREEDY, seq=4)))
    next_message(socket, protocol.TokenBatch)  # room again: taken


def test_a_drain_message_drains_as_sigterm_does(one_seq_node):
    server, thread, socket = one_seq_node
    # long enough to be still running when the drain and the late request come (else the node,
    # drained at once, ends before answering the late one)
    long = protocol.SamplingOptions(max_tokens=200, temperature=0.0, ignore_eos=True)
    socket.send(protocol.encode(protocol.DecodeRequest("running", [5, 6, 7], long, seq=1)))
    next_message(socket, protocol.TokenBatch)
    socket.send(protocol.encode(protocol.Drain("test")))
    deadline = time.monotonic() + 5
    while not next_message(socket, protocol.LoadReport).is_draining:  # NOTE: heartbeats sent before it may come first
        assert time.monotonic() < deadline, "no report says draining"
    socket.send(protocol.encode(protocol.DecodeRequest("late", [5, 6, 7], GREEDY, seq=2)))
    assert _error_for(socket, "late").kind == protocol.DRAINING_ERROR_KIND
    thread.join(timeout=20)
    assert not thread.is_alive() and server.is_draining  # finished "running", then run() returned
    assert server.engine.num_free_blocks == server.engine.block_pool.num_blocks
