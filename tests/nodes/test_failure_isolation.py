"""One request never takes others down on a node: a step fault fails only its request (the rest
decode on, and the node serves new requests), a duplicate request id is refused to its sender
alone, one proxy cannot abort another's request, bad admissions are per-request errors, and the
requests of a proxy that goes silent past the orphan timeout end with their blocks freed."""

from __future__ import annotations

import time

import pytest

from engine import protocol
from node.config import ServerConfig
from node.server import NodeServer
from tests.conftest import dealer, poison_sampling
from tests.nodes.conftest import DEFAULT_MAX_NUM_SEQS, make_engine

PROXY, OTHER = b"proxy-a", b"proxy-b"
GREEDY = protocol.SamplingOptions(max_tokens=5, temperature=0.0, ignore_eos=True)


class Node:
    """A colocated NodeServer driven by hand; what it sends lands in sent as (identity, message)."""

    def __init__(self, model_dir, orphan_timeout_s: float = 10.0) -> None:
        engine = make_engine(model_dir, max_num_seqs=DEFAULT_MAX_NUM_SEQS)
        self.server = NodeServer(engine, ServerConfig("iso", orphan_timeout_s=orphan_timeout_s))
        self.sent: list[tuple[bytes, object]] = []
        self.server.send = lambda identity, message: self.sent.append((identity, message))

    def request(self, identity: bytes, request_id: str, prompt: list[int],
                sampling: protocol.SamplingOptions = GREEDY) -> None:
        self.server.proxies.heard(identity)
        self.server.handle_message(identity, protocol.DecodeRequest(request_id, prompt, sampling))

    def run(self, until, max_rounds: int = 200) -> None:
        for _ in range(max_rounds):
            if until():
                return
            self.server.run_once()
        raise AssertionError(f"not done; sent: {self.sent}")

    def tokens(self, request_id: str) -> list[int] | None:
        deltas = [d for _, m in self.sent if isinstance(m, protocol.TokenBatch) for d in m.deltas
                  if d.request_id == request_id]
        if not deltas or deltas[-1].finish_reason is None:
            return None
        assert [d.first_token_idx for d in deltas] == list(range(len(deltas)))  # consecutive, from 0
        return [t.token_id for d in deltas for t in d.tokens]

    def errors(self, request_id: str) -> list[tuple[bytes, protocol.ErrorReply]]:
        return [(i, m) for i, m in self.sent if isinstance(m, protocol.ErrorReply) and m.request_id == request_id]

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def make_node(tiny_model_dir, close_at_end):
    """make_node(orphan_timeout_s=10.0) -> Node; every node made is closed when the test ends."""
    return lambda **kwargs: close_at_end(Node(tiny_model_dir, **kwargs))


@pytest.fixture
def node(make_node):
    return make_node()


def test_step_fault_fails_its_request_alone_and_the_node_serves_on(node, make_node):
    reference = make_node()
    reference.request(PROXY, "a", [5, 6, 7])
    reference.request(PROXY, "b", [8, 9, 10, 11])
    reference.run(lambda: reference.tokens("a") and reference.tokens("b"))
    engine = node.server.engine
    # a fault that belongs to one request (say, its sampling settings)
    poison_sampling(engine.sampler, "poison", FloatingPointError("injected per-request fault"))
    node.request(PROXY, "a", [5, 6, 7])
    node.request(PROXY, "poison", [1, 2, 3])
    node.request(PROXY, "b", [8, 9, 10, 11])
    node.run(lambda: node.tokens("a") and node.tokens("b") and node.errors("poison"))
    [(identity, error)] = node.errors("poison")
    assert identity == PROXY and error.kind == "StepFailed" and not error.is_client_error
    assert "injected per-request fault" in error.message
    assert node.tokens("a") == reference.tokens("a") and node.tokens("b") == reference.tokens("b")
    node.request(PROXY, "after", [5, 6, 7])  # the node keeps serving
    node.run(lambda: node.tokens("after"))
    assert node.tokens("after") == reference.tokens("a")
    engine.check_leaks()


def test_duplicate_id_is_refused_to_its_sender_and_foreign_aborts_change_nothing(node):
    node.request(PROXY, "r", [5, 6, 7])
    node.request(OTHER, "r", [9, 9, 9])  # the same id from another proxy
    [(identity, error)] = node.errors("r")
    assert identity == OTHER and error.kind == "DuplicateRequestId" and error.is_client_error
    node.server.handle_message(OTHER, protocol.Abort(["r", "unknown"]))  # not its request; unknown: no-op
    node.server.handle_message(PROXY, protocol.ReleaseKV(["unknown"]))
    node.run(lambda: node.tokens("r"))
    assert len(node.tokens("r")) == GREEDY.max_tokens
    assert node.server.control.rejects.counts == {"duplicate_request_id": 1, "foreign_abort": 1}
    node.server.engine.check_leaks()


@pytest.mark.parametrize("sampling, param", [
    (protocol.SamplingOptions(top_k=2**64 - 1), "top_k"),
    (protocol.SamplingOptions(temperature=float("nan")), "temperature"),
    (protocol.SamplingOptions(logit_bias={10**6: 1.0}), "logit_bias"),
    (protocol.SamplingOptions(stop_token_ids=[2**40]), "stop_token_ids"),
])
def test_out_of_range_options_are_client_errors_of_that_request_alone(node, sampling, param):
    node.request(PROXY, "ok", [5, 6, 7])
    node.request(PROXY, "bad", [5, 6, 7], sampling)
    [(_, error)] = node.errors("bad")
    assert error.is_client_error and param in error.message
    node.run(lambda: node.tokens("ok"))
    node.server.engine.check_leaks()


def test_requests_of_a_silent_proxy_end_after_the_orphan_timeout(make_node):
    node = make_node(orphan_timeout_s=1.0)
    long = protocol.SamplingOptions(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    node.request(PROXY, "orphan", [5, 6, 7], long)
    node.request(OTHER, "alive", [5, 6, 7], long)
    node.server.run_once()
    engine = node.server.engine
    assert engine.num_unfinished == 2 and engine.num_free_blocks < engine.block_pool.num_blocks
    deadline = time.monotonic() + 10
    while "orphan" in engine.request_ids() and time.monotonic() < deadline:
        node.server.proxies.heard(OTHER)  # OTHER keeps pinging
        node.server.run_once()
        time.sleep(0.01)  # paced: unpaced, a fast CPU decodes "orphan" to its length limit within 1 s
    assert engine.request_ids() == ["alive"] and node.server.num_orphaned_requests == 1
    # answered all the same: a proxy judged silent may still be there, and its client waiting
    [(identity, reply)] = node.errors("orphan")
    assert identity == PROXY and reply.kind == "Orphaned" and not reply.is_client_error
    node.server.handle_message(OTHER, protocol.Abort(["alive"]))
    engine.check_leaks()


def test_the_nodes_own_absence_is_not_its_proxys_silence(make_node):
    """A loop away past the orphan timeout (a long step, a stall) aborts nothing on its return; a
    proxy silent while the loop runs is still caught."""
    node = make_node(orphan_timeout_s=1.0)
    long = protocol.SamplingOptions(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    node.request(PROXY, "kept", [5, 6, 7], long)
    node.server.run_once()
    time.sleep(1.6)  # the loop is away (as in a 40 s grammar compile): the proxy's pings would wait unread
    node.server.run_once()
    engine = node.server.engine
    assert engine.request_ids() == ["kept"] and node.server.num_orphaned_requests == 0
    deadline = time.monotonic() + 10
    while "kept" in engine.request_ids() and time.monotonic() < deadline:
        node.server.run_once()  # the loop runs and the proxy says nothing: silence
        time.sleep(0.01)
    assert node.server.num_orphaned_requests == 1
    engine.check_leaks()


@pytest.mark.serial  # bounds a wait in seconds: alone on the machine (make test's serial part)
def test_send_to_a_proxy_that_stops_reading_waits_a_bounded_time_and_never_drops_a_frame(monkeypatch):
    from node import control

    monkeypatch.setattr(control, "_SNDHWM", 8)
    socket = control.ControlSocket("127.0.0.1", 0, None)
    proxy = dealer(socket.address, rcvhwm=1)
    try:
        proxy.send(protocol.encode(protocol.Ping()))
        assert socket.poll(5000)
        [(identity, _)] = socket.receive(10)
        frame = b"x" * 65536
        num_sent, took_s = 0, 0.0
        for _ in range(10_000):  # the proxy reads nothing: queues and TCP buffers fill up
            started = time.monotonic()
            if not socket.send(identity, frame, timeout_s=0.3):
                took_s = time.monotonic() - started
                break
            num_sent += 1
        assert num_sent >= 8 and 0.3 <= took_s < 1.0  # waited, boundedly, then said so
        received = 0
        while proxy.poll(1000):
            proxy.recv()
            received += 1
        assert received == num_sent  # every frame the node was told was taken arrived
        assert not socket.send(b"no-such-proxy", frame, timeout_s=5.0)  # gone: at once, not after 5 s
    finally:
        proxy.close(linger=0)
        socket.close()


def test_requests_of_a_proxy_a_send_gave_up_on_end_and_others_go_on(node):
    long = protocol.SamplingOptions(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    node.request(PROXY, "stuck", [5, 6, 7], long)
    node.request(OTHER, "fine", [5, 6, 7], GREEDY)
    server = node.server
    real_send = NodeServer.send.__get__(server)

    def send(identity, message):
        if identity == PROXY:  # its queue stays full past send_timeout_s
            server.control.send = lambda *_: False
            real_send(identity, message)
            del server.control.send
        else:
            node.sent.append((identity, message))

    server.send = send
    dropped = []
    drop = server.proxies.drop
    server.proxies.drop = lambda identity: (dropped.append(identity), drop(identity))
    node.run(lambda: node.tokens("fine") and "stuck" not in server.engine.request_ids())
    assert server.num_orphaned_requests == 1 and len(node.tokens("fine")) == GREEDY.max_tokens
    server.engine.check_leaks()
    for _ in range(5):
        server.run_once()
    assert dropped == [PROXY]  # forgotten once its requests ended, not dropped again at every turn of the loop
