"""The ZMQ transport of the side channel between connectors (its messages: kv_transfer.messages).

Each connector serves a ROUTER from a small thread (it blocks in poll with a timeout, it does
not spin), so a handshake is answered at once even while the node's loop runs a long model
step. Requests to peers go from short-lived DEALER sockets with a deadline.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import msgspec
import zmq

from kv_transfer.errors import HandshakeFailed
from kv_transfer.messages import Ack, SideMessage

logger = logging.getLogger(__name__)

_POLL_MS = 100
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SideMessage)


class SideChannelServer:
    """Serves requests on host:port from a thread; handler(message) -> reply (or None)."""

    def __init__(self, host: str, port: int, handler: Callable[[SideMessage], SideMessage | None]) -> None:
        self._handler = handler
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"{host}:{self.port}"
        self._is_stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kv-side-{self.port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._is_stopping.set()
        self._thread.join(timeout=2)
        self._socket.close(linger=0)

    def _serve(self) -> None:
        while not self._is_stopping.is_set():
            if not self._socket.poll(_POLL_MS):
                continue
            try:
                identity, payload = self._socket.recv_multipart(flags=zmq.NOBLOCK)
                message = _decoder.decode(payload)
            except (zmq.Again, ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("side channel %s: bad message: %s", self.address, exc)
                continue
            try:
                reply = self._handler(message)
            except Exception as exc:  # noqa: BLE001 - a thread edge: answer and keep serving
                logger.exception("side channel %s: handler failed", self.address)
                reply = Ack(error=f"{type(exc).__name__}: {exc}")
            if reply is not None:
                self._socket.send_multipart([identity, _encoder.encode(reply)])


def request(address: str, message: SideMessage, timeout_s: float) -> SideMessage:
    """Send one message and wait for its reply. Raises HandshakeFailed on timeout."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(f"tcp://{address}")
        socket.send(_encoder.encode(message))
        if not socket.poll(int(timeout_s * 1000)):
            raise HandshakeFailed(f"no answer from KV side channel {address} within {timeout_s} s")
        return _decoder.decode(socket.recv())
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HandshakeFailed(f"bad answer from KV side channel {address}: {exc}") from exc
    finally:
        socket.close(linger=0)


class Notifier:
    """Fire-and-forget messages to peers' side channels (one DEALER per address, kept)."""

    def __init__(self) -> None:
        self._sockets: dict[str, zmq.Socket] = {}

    def send(self, address: str, message: SideMessage) -> None:
        socket = self._sockets.get(address)
        if socket is None:
            socket = zmq.Context.instance().socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 1000)
            socket.setsockopt(zmq.SNDHWM, 10000)
            socket.connect(f"tcp://{address}")
            self._sockets[address] = socket
        try:
            socket.send(_encoder.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("could not notify %s: its queue is full", address)

    def close(self) -> None:
        for socket in self._sockets.values():
            socket.close(linger=200)
        self._sockets.clear()
