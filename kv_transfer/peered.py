"""SideChannelConnector: what the NIXL and gloo connectors share behind KVConnector.

A ZMQ side channel (kv_transfer.side_channel) answers handshakes and release notices from its
own thread. Handshakes run in a worker thread (a dead peer costs the node loop nothing);
everything that touches the backend runs on the caller's thread inside poll(). Peers are
cached by engine id; a handshake answered by another engine id (the peer restarted) fails, and
a new engine id at a known address drops the old peer's state.
"""

from __future__ import annotations

import logging
import queue
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kv_transfer import side_channel
from kv_transfer.base import KVConnector, ReadResult, check_cache
from kv_transfer.config import TransferConfig
from kv_transfer.errors import HandshakeFailed, KVTransferError, LayoutMismatch
from kv_transfer.layout import KVLayout, check_compatible

logger = logging.getLogger(__name__)


@dataclass
class Peer:
    engine_id: str
    address: str
    layout: KVLayout
    extra: dict
    state: object = None  # the backend's per-peer handle


@dataclass
class PendingRead:
    request_id: str
    remote_engine_id: str
    remote_address: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    started_at: float = field(default_factory=time.monotonic)
    state: object = None  # the backend's transfer handle once started


class SideChannelConnector(KVConnector, ABC):
    backend = "none"

    def __init__(self, config: TransferConfig, kv_cache: torch.Tensor, layout: KVLayout, engine_id: str) -> None:
        check_cache(kv_cache, layout)
        self.config = config
        self.kv_cache = kv_cache
        self.layout = layout
        self.engine_id = engine_id
        self.block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._peers: dict[str, Peer] = {}
        self._handshakes: dict[str, tuple[str, Future]] = {}  # engine id -> (address, reply)
        self._reads: dict[str, PendingRead] = {}
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-handshake")
        self._notifier = side_channel.Notifier()
        self._server = side_channel.SideChannelServer(config.host, config.side_channel_port, self._on_side_message)
        self.agent_address = self._server.address

    # ---- reader side --------------------------------------------------------------------------

    def start_read(self, request_id: str, remote_engine_id: str, remote_address: str,
                   remote_block_ids: list[int], local_block_ids: list[int]) -> None:
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError(f"request {request_id}: {len(remote_block_ids)} remote vs {len(local_block_ids)} local blocks")
        if request_id in self._reads:
            raise ValueError(f"request {request_id} already has a read in flight")
        self._reads[request_id] = PendingRead(request_id, remote_engine_id, remote_address,
                                              list(remote_block_ids), list(local_block_ids))
        if remote_engine_id not in self._peers and remote_engine_id not in self._handshakes:
            future = self._executor.submit(self._handshake, remote_address)
            self._handshakes[remote_engine_id] = (remote_address, future)

    def poll(self) -> list[ReadResult]:
        results = self._finish_handshakes()
        now = time.monotonic()
        for read in list(self._reads.values()):
            if read.state is None and read.remote_engine_id in self._peers:
                results += self._start(read)
            elif now - read.started_at > self.config.transfer_timeout_s:
                results.append(self._fail(read, f"no completion within {self.config.transfer_timeout_s} s"))
        results += self._poll_backend()
        return results

    def abort_read(self, request_id: str) -> None:
        read = self._reads.pop(request_id, None)
        if read is not None and read.state is not None:
            self._cancel(read)

    def release_remote(self, request_id: str, remote_engine_id: str, remote_address: str) -> None:
        self._notifier.send(remote_address, side_channel.Release([request_id]))

    @property
    def num_reads_in_flight(self) -> int:
        return len(self._reads)

    # ---- holder side --------------------------------------------------------------------------

    def poll_released(self) -> list[str]:
        released = self._drain_backend_notices()
        while True:
            try:
                released.append(self._released.get_nowait())
            except queue.Empty:
                return released

    def close(self) -> None:
        for read in list(self._reads.values()):
            self.abort_read(read.request_id)
        self._server.close()
        self._notifier.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- backend hooks ------------------------------------------------------------------------

    @abstractmethod
    def _hello_extra(self) -> dict:
        """What a peer needs to read from (or send to) this side, sent in the handshake."""

    @abstractmethod
    def _connect_peer(self, peer: Peer) -> None:
        """Make the backend ready to read from peer (called on the caller's thread)."""

    @abstractmethod
    def _start_transfer(self, read: PendingRead, peer: Peer) -> None:
        """Start the read; store the backend's handle in read.state. Raises KVTransferError."""

    @abstractmethod
    def _poll_backend(self) -> list[ReadResult]:
        """Finished and failed transfers (pop them from self._reads)."""

    @abstractmethod
    def _cancel(self, read: PendingRead) -> None:
        """Release a started transfer's backend resources."""

    def _drain_backend_notices(self) -> list[str]:
        return []

    def _forget_peer(self, peer: Peer) -> None:
        """Drop the backend's state for a peer that failed."""

    def _on_backend_message(self, message) -> side_channel.SideMessage | None:
        return side_channel.Ack(error=f"unexpected message {type(message).__name__}")

    # ---- shared internals ---------------------------------------------------------------------

    def _handshake(self, address: str) -> side_channel.HelloReply:
        """Runs in a worker thread: exchange layouts and backend details with the holder."""
        hello = side_channel.Hello(self.engine_id, self.layout, self.backend, self._hello_extra())
        reply = side_channel.request(address, hello, self.config.handshake_timeout_s)
        if not isinstance(reply, side_channel.HelloReply):
            raise HandshakeFailed(f"KV side channel {address} answered {type(reply).__name__}: {getattr(reply, 'error', '')}")
        if reply.error:
            raise LayoutMismatch(reply.error) if "layouts differ" in reply.error else HandshakeFailed(reply.error)
        check_compatible(self.layout, reply.layout)
        return reply

    def _on_side_message(self, message):
        """Runs on the side-channel thread."""
        if isinstance(message, side_channel.Hello):
            return self._answer_hello(message)
        if isinstance(message, side_channel.Release):
            for request_id in message.request_ids:
                self._released.put(request_id)
            return None
        return self._on_backend_message(message)

    def _answer_hello(self, hello: side_channel.Hello) -> side_channel.HelloReply:
        error = None
        if hello.backend != self.backend:
            error = f"backend mismatch: local {self.backend!r}, remote {hello.backend!r}"
        else:
            try:
                check_compatible(self.layout, hello.layout)
            except LayoutMismatch as exc:
                error = str(exc)
        extra = {} if error else self._hello_extra_for(hello)
        return side_channel.HelloReply(self.engine_id, self.layout, self.backend, error, extra)

    def _hello_extra_for(self, hello: side_channel.Hello) -> dict:
        return self._hello_extra()

    def _finish_handshakes(self) -> list[ReadResult]:
        results = []
        for engine_id, (address, future) in list(self._handshakes.items()):
            if not future.done():
                continue
            del self._handshakes[engine_id]
            try:
                self._add_peer(engine_id, address, future.result())
            except (KVTransferError, OSError, RuntimeError) as exc:
                logger.warning("KV handshake with %s at %s failed: %s", engine_id, address, exc)
                results += [self._fail(r, f"handshake with {address} failed: {exc}") for r in list(self._reads.values())
                            if r.remote_engine_id == engine_id]
        return results

    def _add_peer(self, engine_id: str, address: str, reply: side_channel.HelloReply) -> None:
        if reply.engine_id != engine_id:
            raise HandshakeFailed(f"{address} is engine {reply.engine_id!r}, not {engine_id!r} (restarted?)")
        for stale in [p for p in self._peers.values() if p.address == address]:
            # NOTE: a new engine at a known address means the old one restarted: its
            # registration is gone, so drop what we hold for it.
            self._forget_peer(self._peers.pop(stale.engine_id))
        peer = Peer(reply.engine_id, address, reply.layout, reply.extra)
        self._connect_peer(peer)
        self._peers[engine_id] = peer

    def _start(self, read: PendingRead) -> list[ReadResult]:
        try:
            self._start_transfer(read, self._peers[read.remote_engine_id])
            return []
        except KVTransferError as exc:
            return [self._fail(read, str(exc))]

    def _fail(self, read: PendingRead, error: str) -> ReadResult:
        self._reads.pop(read.request_id, None)
        if read.state is not None:
            self._cancel(read)
        # NOTE: a failed transfer may mean the peer died or restarted: forget it, so the next
        # read handshakes again.
        peer = self._peers.pop(read.remote_engine_id, None)
        if peer is not None:
            self._forget_peer(peer)
        return ReadResult(read.request_id, False, f"request {read.request_id}: {error}")

    def _succeed(self, read: PendingRead) -> ReadResult:
        self._reads.pop(read.request_id, None)
        return ReadResult(read.request_id, True)
