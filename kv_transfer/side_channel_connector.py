"""SideChannelConnector: what the NIXL and gloo connectors share behind KVConnector: peers, the
handshake, pending reads, release notices.

A ZMQ side channel (kv_transfer.side_channel) answers handshakes and release notices from its
own thread. Handshakes run in a worker thread (a dead peer costs the node loop nothing); the
backend's handshake hooks run on those two threads, everything else that touches the backend
on the caller's thread inside poll(). Peers are cached by engine id; a handshake answered by
another engine id (the peer restarted) fails, and a new engine id at a known address drops the
old peer's state.
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
from kv_transfer.errors import HandshakeFailed, KVTransferError
from kv_transfer.handshake import check_reply, refusal_for
from kv_transfer.layout import KVLayout
from kv_transfer.messages import SIDE_CHANNEL_VERSION, Ack, BackendInfo, Hello, HelloReply, Release, SideMessage

logger = logging.getLogger(__name__)


@dataclass
class Peer:
    engine_id: str
    address: str
    layout: KVLayout
    backend_info: BackendInfo | None  # the holder's, from its HelloReply
    handle: object = None  # the backend's per-peer state


@dataclass
class PendingRead:
    request_id: str
    remote_engine_id: str
    remote_address: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    started_at: float = field(default_factory=time.monotonic)
    handle: object = None  # the backend's transfer handle once started


class SideChannelConnector(KVConnector, ABC):
    backend = "none"
    # The BackendInfo types this backend's Hello (reader's) and HelloReply (holder's) carry;
    # None: that message carries none. The handshake refuses any other.
    reader_info_type: type[BackendInfo] | None = None
    holder_info_type: type[BackendInfo] | None = None

    def __init__(self, config: TransferConfig, kv_cache: torch.Tensor, layout: KVLayout, engine_id: str) -> None:
        check_cache(kv_cache, layout)
        self.config = config
        self.kv_cache = kv_cache
        self.layout = layout
        self.engine_id = engine_id
        self.block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._peers: dict[str, Peer] = {}
        self._handshakes: dict[str, tuple[str, Future]] = {}  # engine id -> (address, (reply, handle))
        self._reads: dict[str, PendingRead] = {}
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-handshake")
        self._notifier = side_channel.Notifier()
        self._server = side_channel.SideChannelServer(config.host, config.side_channel_port, self._on_side_message)
        self.agent_address = self._server.address

    # ---- reader side --------------------------------------------------------------------------

    def start_read(self, request_id: str, remote_engine_id: str, remote_address: str,
                   remote_block_ids: list[int], local_block_ids: list[int]) -> None:
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError(f"request {request_id}: {len(remote_block_ids)} remote vs "
                             f"{len(local_block_ids)} local blocks")
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
            if read.handle is None and read.remote_engine_id in self._peers:
                results += self._start(read)
            elif now - read.started_at > self.config.transfer_timeout_s:
                results.append(self._fail(read, f"no completion within {self.config.transfer_timeout_s} s"))
        results += self._poll_backend()
        return results

    def abort_read(self, request_id: str) -> None:
        read = self._reads.pop(request_id, None)
        if read is not None and read.handle is not None:
            self._cancel(read)

    def release_remote(self, request_id: str, remote_engine_id: str, remote_address: str) -> None:
        self._notifier.send(remote_address, Release([request_id]))

    @property
    def num_reads_in_flight(self) -> int:
        return len(self._reads)

    # ---- holder side --------------------------------------------------------------------------

    def poll_released(self) -> list[str]:
        released = []
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

    def _prepare_hello(self) -> tuple[BackendInfo | None, object]:
        """Reader, handshake thread: the backend info of our Hello (of reader_info_type) and any
        state of ours that _on_hello_accepted gets back. Raises HandshakeFailed."""
        return None, None

    def _on_hello_accepted(self, reply: HelloReply, prepared: object) -> object:
        """Reader, handshake thread, after the holder accepted and the reply checked out: finish
        the backend's part of the handshake. Returns the new Peer's handle (before
        _connect_peer). Raises HandshakeFailed."""
        return None

    def _answer_info(self, hello: Hello) -> BackendInfo | None:
        """Holder, side-channel thread, for a Hello the handshake accepted: the backend info of
        our HelloReply (of holder_info_type). Must not block."""
        return None

    def _connect_peer(self, peer: Peer) -> None:
        """Reader, caller's thread: make the backend ready to read from peer (peer.handle holds
        what _on_hello_accepted returned)."""

    @abstractmethod
    def _start_transfer(self, read: PendingRead, peer: Peer) -> None:
        """Start the read; store the backend's handle in read.handle. Raises KVTransferError."""

    @abstractmethod
    def _poll_backend(self) -> list[ReadResult]:
        """Finished and failed transfers (pop them from self._reads)."""

    @abstractmethod
    def _cancel(self, read: PendingRead) -> None:
        """Release a started transfer's backend resources."""

    def _forget_peer(self, peer: Peer) -> None:
        """Drop the backend's state for a peer that failed."""

    def _on_backend_message(self, message: SideMessage) -> SideMessage | None:
        return Ack(error=f"unexpected message {type(message).__name__}")

    # ---- the handshake ------------------------------------------------------------------------

    def _handshake(self, address: str) -> tuple[HelloReply, object]:
        """Handshake thread: exchange layouts and backend details with the holder. Returns its
        accepted reply and the new peer's handle; raises LayoutMismatch or HandshakeFailed."""
        reader_info, prepared = self._prepare_hello()
        hello = Hello(SIDE_CHANNEL_VERSION, self.engine_id, self.layout, self.backend, reader_info)
        reply = side_channel.request(address, hello, self.config.handshake_timeout_s)
        reply = check_reply(reply, address, self.layout, self.holder_info_type)
        return reply, self._on_hello_accepted(reply, prepared)

    def _answer_hello(self, hello: Hello) -> HelloReply:
        """Side-channel thread: accept the reader's Hello with our details, or refuse it by code."""
        refusal = refusal_for(hello, self.backend, self.layout, self.reader_info_type)
        if refusal is not None:
            logger.warning("refused KV handshake from %s: %s", hello.engine_id, refusal.message)
            return HelloReply(SIDE_CHANNEL_VERSION, self.engine_id, self.layout, self.backend, refusal=refusal)
        return HelloReply(SIDE_CHANNEL_VERSION, self.engine_id, self.layout, self.backend,
                          backend_info=self._answer_info(hello))

    def _on_side_message(self, message: SideMessage) -> SideMessage | None:
        """Runs on the side-channel thread."""
        if isinstance(message, Hello):
            return self._answer_hello(message)
        if isinstance(message, Release):
            for request_id in message.request_ids:
                self._released.put(request_id)
            return None
        return self._on_backend_message(message)

    def _finish_handshakes(self) -> list[ReadResult]:
        results = []
        for engine_id, (address, future) in list(self._handshakes.items()):
            if not future.done():
                continue
            del self._handshakes[engine_id]
            try:
                self._add_peer(engine_id, address, *future.result())
            except (KVTransferError, OSError, RuntimeError) as exc:
                logger.warning("KV handshake with %s at %s failed: %s", engine_id, address, exc)
                results += [self._fail(r, f"handshake with {address} failed: {exc}") for r in list(self._reads.values())
                            if r.remote_engine_id == engine_id]
        return results

    def _add_peer(self, engine_id: str, address: str, reply: HelloReply, handle: object) -> None:
        if reply.engine_id != engine_id:
            raise HandshakeFailed(f"{address} is engine {reply.engine_id!r}, not {engine_id!r} (restarted?)")
        for stale in [p for p in self._peers.values() if p.address == address]:
            # NOTE: a new engine at a known address means the old one restarted: its
            # registration is gone, so drop what we hold for it.
            self._forget_peer(self._peers.pop(stale.engine_id))
        peer = Peer(reply.engine_id, address, reply.layout, reply.backend_info, handle)
        self._connect_peer(peer)
        self._peers[engine_id] = peer

    # ---- reads --------------------------------------------------------------------------------

    def _start(self, read: PendingRead) -> list[ReadResult]:
        try:
            self._start_transfer(read, self._peers[read.remote_engine_id])
            return []
        except KVTransferError as exc:
            return [self._fail(read, str(exc))]

    def _fail(self, read: PendingRead, error: str) -> ReadResult:
        self._reads.pop(read.request_id, None)
        if read.handle is not None:
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
