"""side_channel.Requester: request/reply over kept connections (the reader's handshakes and lease
confirmations). A connection answered is kept for the address's next request; one that timed out
or failed is closed, so a late answer never reaches a later request; threads never share a
socket in flight."""

from __future__ import annotations

import threading
import time

import pytest

from engine.protocol import curve_keys
from kv_transfer.errors import HandshakeFailed
from kv_transfer.messages import Ack, ConfirmRead, LeaseRef, ReadConfirmed
from kv_transfer.side_channel import Requester, SideChannelServer


def _confirming(message):
    """Answers each ConfirmRead with its own lease, so a reply shows which request it answers."""
    return ReadConfirmed(message.lease, True) if isinstance(message, ConfirmRead) else Ack(error="unexpected")


def _confirm(requester: Requester, address: str, request_id: str, timeout_s: float = 5.0):
    return requester.request(address, ConfirmRead("holder", LeaseRef(request_id, 1)), timeout_s)


def test_an_answered_connection_is_kept_for_the_next_request():
    server = SideChannelServer("127.0.0.1", 0, _confirming)
    requester = Requester()
    try:
        assert _confirm(requester, server.address, "a") == ReadConfirmed(LeaseRef("a", 1), True)
        [kept] = requester._idle[server.address]
        assert _confirm(requester, server.address, "b") == ReadConfirmed(LeaseRef("b", 1), True)
        assert requester._idle[server.address] == [kept]  # the same socket served both
    finally:
        requester.close()
        server.close()
    assert kept.closed and not requester._idle


def test_a_late_answer_never_reaches_the_next_request():
    """The first answer comes after the first request gave up; the second request must get its
    own answer (with the connection kept after a timeout it would read the first's)."""
    calls = []

    def slow_first(message):
        calls.append(message.lease.request_id)
        if len(calls) == 1:
            time.sleep(0.6)
        return ReadConfirmed(message.lease, True)

    server = SideChannelServer("127.0.0.1", 0, slow_first)
    requester = Requester()
    try:
        with pytest.raises(HandshakeFailed, match="no answer"):
            _confirm(requester, server.address, "first", timeout_s=0.2)
        assert not requester._idle.get(server.address)  # closed, not kept
        assert _confirm(requester, server.address, "second") == ReadConfirmed(LeaseRef("second", 1), True)
        time.sleep(0.2)
        assert _confirm(requester, server.address, "third") == ReadConfirmed(LeaseRef("third", 1), True)
        assert calls == ["first", "second", "third"]
    finally:
        requester.close()
        server.close()


def test_threads_each_get_their_own_answers():
    server = SideChannelServer("127.0.0.1", 0, _confirming)
    requester = Requester(max_idle_per_address=2)
    wrong: list[tuple[str, object]] = []

    def worker(idx: int) -> None:
        for i in range(25):
            request_id = f"t{idx}-{i}"
            reply = _confirm(requester, server.address, request_id)
            if reply != ReadConfirmed(LeaseRef(request_id, 1), True):
                wrong.append((request_id, reply))

    threads = [threading.Thread(target=worker, args=(idx,)) for idx in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
        assert not wrong
        assert 1 <= len(requester._idle[server.address]) <= 2  # at most max_idle kept
    finally:
        requester.close()
        server.close()


def test_kept_connections_carry_curve_and_a_closed_requester_keeps_nothing():
    keys = curve_keys("requester-test-secret-0123456789")
    server = SideChannelServer("127.0.0.1", 0, _confirming, keys=keys)
    requester = Requester(keys)
    try:
        for request_id in ("a", "b"):
            assert _confirm(requester, server.address, request_id) == ReadConfirmed(LeaseRef(request_id, 1), True)
        with pytest.raises(HandshakeFailed):  # without the secret: refused, never answered
            Requester().request(server.address, Ack(), timeout_s=0.5)
        requester.close()
        # A request after close still works, on a connection of its own that is not kept.
        assert _confirm(requester, server.address, "c") == ReadConfirmed(LeaseRef("c", 1), True)
        assert not requester._idle
    finally:
        requester.close()
        server.close()


def test_an_unreachable_address_fails_a_request_as_before_and_ends_a_started_exchange_at_once():
    requester = Requester()
    try:
        with pytest.raises(HandshakeFailed, match="cannot be reached"):
            requester.request("not an address", Ack(), timeout_s=0.5)
        exchange = requester.start("not an address", Ack(), timeout_s=5.0)
        assert exchange.done()
        with pytest.raises(HandshakeFailed, match="cannot be reached"):
            exchange.reply()
    finally:
        requester.close()


class _PausedRequester(Requester):
    """Waits pause_s between connecting and sending: the security handshake's time to fail first."""

    def __init__(self, keys, pause_s: float) -> None:
        super().__init__(keys)
        self._pause_s = pause_s

    def _take(self, address: str):
        socket = super()._take(address)
        time.sleep(self._pause_s)
        return socket


def test_a_request_refused_by_a_secured_server_always_ends_within_its_timeout():
    """A connection that fails its security handshake can leave the DEALER with no peer at all
    (one in ten to one in four fresh connections here without the secret, by when the send comes); a send
    then waits for one. Every request must still end, with HandshakeFailed, within its timeout:
    each one runs on a thread of its own, and the test gives it the timeout and a margin."""
    server = SideChannelServer("127.0.0.1", 0, _confirming, keys=curve_keys("requester-test-secret-0123456789"))
    outcomes = []

    def refused(pause_s: float) -> None:
        requester = _PausedRequester(None, pause_s)
        try:
            requester.request(server.address, Ack(), timeout_s=0.1)
            outcomes.append("answered")
        except HandshakeFailed as exc:
            outcomes.append(str(exc))
        finally:
            requester.close()

    try:
        for attempt in range(48):
            thread = threading.Thread(target=refused, args=(0.002 * (attempt % 6),), daemon=True)
            thread.start()
            thread.join(timeout=2.0)
            assert not thread.is_alive(), f"attempt {attempt}: the request is still waiting after 2 s"
        assert len(outcomes) == 48 and all(o.startswith("no answer") for o in outcomes), outcomes
    finally:
        server.close()


def _wait_done(exchange, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not exchange.done():
        assert time.monotonic() < deadline, "the exchange never ended"
        time.sleep(0.001)


def test_a_started_exchange_is_answered_on_the_callers_thread_and_keeps_its_connection():
    """Requester.start (a read's confirmation): sent at once, done() picks the answer up without
    waiting (no thread between), and the connection goes back for the next request."""
    release = threading.Event()

    def held(message):
        release.wait(5)
        return _confirming(message)

    server = SideChannelServer("127.0.0.1", 0, held)
    requester = Requester()
    try:
        exchange = requester.start(server.address, ConfirmRead("holder", LeaseRef("a", 1)), timeout_s=5.0)
        started = time.monotonic()
        assert not exchange.done() and time.monotonic() - started < 1.0  # never waits for the answer
        with pytest.raises(RuntimeError):
            exchange.reply()
        release.set()
        _wait_done(exchange)
        assert exchange.reply() == ReadConfirmed(LeaseRef("a", 1), True)
        [kept] = requester._idle[server.address]
        assert _confirm(requester, server.address, "b") == ReadConfirmed(LeaseRef("b", 1), True)
        assert requester._idle[server.address] == [kept]
    finally:
        release.set()
        requester.close()
        server.close()


def test_a_started_exchange_times_out_or_is_cancelled_and_its_late_answer_reaches_nobody():
    calls = []

    def slow(message):
        calls.append(message.lease.request_id)
        if message.lease.request_id != "third":
            time.sleep(0.5)
        return ReadConfirmed(message.lease, True)

    server = SideChannelServer("127.0.0.1", 0, slow)
    requester = Requester()
    try:
        timed_out = requester.start(server.address, ConfirmRead("holder", LeaseRef("first", 1)), timeout_s=0.1)
        _wait_done(timed_out)
        with pytest.raises(HandshakeFailed, match="no answer"):
            timed_out.reply()
        cancelled = requester.start(server.address, ConfirmRead("holder", LeaseRef("second", 1)), timeout_s=5.0)
        cancelled.cancel()
        assert cancelled.done()
        with pytest.raises(HandshakeFailed, match="cancelled"):
            cancelled.reply()
        assert not requester._idle.get(server.address)  # neither connection kept
        time.sleep(1.2)  # both late answers have come by now
        assert _confirm(requester, server.address, "third") == ReadConfirmed(LeaseRef("third", 1), True)
        assert calls in (["first", "second", "third"], ["first", "third"])  # a cancel may drop the unsent request
    finally:
        requester.close()
        server.close()

