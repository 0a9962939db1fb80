"""ControlSocket: a node's ROUTER socket towards its proxies (bind, trust, bounded receive, and
sends that wait a bounded time rather than drop a frame)."""

from __future__ import annotations

import enum
import threading
import time

import zmq

from engine import protocol
from kv_transfer.security import CurveKeys, RejectLog, ZapHandler, secure_server

# NOTE: frames queued per proxy before a send waits: at one TokenBatch per engine step, minutes
# of output; a proxy this far behind is stuck, not slow.
_SNDHWM = 100_000
_SEND_RETRY_S = 0.001


class ControlSocket:
    """With the cluster's keys, CURVE: only holders of the secret connect (a ZapHandler checks
    each peer, failed handshakes are counted in rejects). Inbound frames past
    protocol.MAX_MESSAGE_BYTES drop their connection. A proxy's routing id is its own (the
    proxy sets it), and a reconnecting proxy takes its id over (ROUTER_HANDOVER). Thread-safe:
    one lock around the socket (the loop and the heartbeat thread share it)."""

    def __init__(self, host: str, port: int, keys: CurveKeys | None) -> None:
        self.rejects = RejectLog(f"control socket {host}:{port or '?'}")
        self._context = zmq.Context()
        self._zap = ZapHandler(self._context, keys, self.rejects) if keys is not None else None
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue is EAGAIN and a gone peer EHOSTUNREACH, never a drop
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        socket.setsockopt(zmq.SNDHWM, _SNDHWM)
        socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        secure_server(socket, keys)
        if port:
            socket.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = socket.bind_to_random_port(f"tcp://{host}")
        if self._zap is not None:
            self._zap.watch(socket)
        self.address = f"{host}:{self.port}"
        self.rejects.where = f"control socket {self.address}"
        self.is_secured = keys is not None
        self._socket = socket
        self._lock = threading.Lock()

    def poll(self, timeout_ms: int, also: list[zmq.Socket] = ()) -> bool:
        """Whether a frame is waiting (blocks up to timeout_ms holding the lock: call from the loop);
        also: other sockets of the loop's whose message ends the wait as well."""
        with self._lock:  # NOTE: a ZMQ socket is not thread-safe, poll included
            if not also:
                return bool(self._socket.poll(timeout_ms))
            poller = zmq.Poller()
            poller.register(self._socket, zmq.POLLIN)
            for socket in also:
                poller.register(socket, zmq.POLLIN)
            return self._socket in dict(poller.poll(timeout_ms))

    def receive(self, max_frames: int) -> list[tuple[bytes, bytes]]:
        """Up to max_frames waiting (identity, payload) frames, never blocking; frame sets of
        another shape are rejected here."""
        received = []
        while len(received) < max_frames:
            try:
                with self._lock:
                    frames = self._socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2:
                self.rejects.reject("wrong_shape", f"{len(frames) - 1} frames where 1 was expected")
                continue
            received.append((frames[0], frames[1]))
        return received

    def send(self, identity: bytes, data: bytes, timeout_s: float) -> bool:
        """Queue data for the proxy at identity, waiting up to timeout_s while its queue is full.
        False when it was not taken: the proxy is gone (not connected) or stayed that far behind."""
        deadline = time.monotonic() + timeout_s
        while True:
            outcome = self._try_send(identity, data)
            if outcome is not _Sent.FULL:
                return outcome is _Sent.SENT
            if time.monotonic() > deadline:
                return False
            time.sleep(_SEND_RETRY_S)  # NOTE: the lock is free meanwhile (heartbeats still go out)

    def try_send(self, identity: bytes, data: bytes) -> bool:
        """One attempt without waiting; False if the queue is full or the proxy is gone."""
        return self._try_send(identity, data) is _Sent.SENT

    def close(self) -> None:
        with self._lock:
            self._socket.close(linger=0)
        if self._zap is not None:
            self._zap.close()
        self._context.destroy(linger=0)

    def _try_send(self, identity: bytes, data: bytes) -> _Sent:
        with self._lock:
            try:
                self._socket.send_multipart([identity, data], flags=zmq.NOBLOCK)
                return _Sent.SENT
            except zmq.Again:
                return _Sent.FULL
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    return _Sent.GONE
                raise


class _Sent(enum.Enum):
    SENT = "sent"
    FULL = "full"  # the proxy's queue is at its high-water mark
    GONE = "gone"  # no proxy connected under that identity
