"""SideChannelConnector: what the NIXL and gloo connectors share behind KVConnector: peers, the
handshake, pending reads and their confirmation, lease renewals, the holder's lease service.

A ZMQ side channel (kv_transfer.side_channel) answers handshakes, renewals, confirmations and
releases from its own thread. Handshakes run in worker threads (a dead peer costs the node loop
nothing; each is bounded by handshake_timeout_s); a confirmation is sent from poll() and its
answer picked up there, never waiting (bounded likewise); renewals come from a LeaseKeeper
thread. The backend's handshake hooks run on those threads, everything else that touches the
backend on the caller's thread inside poll(). A thread of ours waits for the GIL while the
node's loop runs Python, up to the interpreter's switch interval each time (5 ms by default):
a connector lowers the process's interval to THREAD_SWITCH_INTERVAL_S, so the side channel
answers a peer within it. Peers are cached by engine id; a
handshake answered by another engine id (the peer restarted) fails, and a new engine id at a
known address drops the old peer's state.

A read goes: handshake (once per peer) -> transfer -> confirmation. Only when the holder
confirms that the lease (request id, generation) was held from its start until after the
transfer completed is the read reported ok: until then the blocks read may have been freed and
reused by the holder (an expired lease), and such a read is reported LEASE_LOST.
"""

from __future__ import annotations

import logging
import sys
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from kv_transfer import side_channel
from kv_transfer.base import FailureCode, KVConnector, ReadResult, RemoteLease, check_address, check_read
from kv_transfer.config import TransferConfig
from kv_transfer.errors import HandshakeFailed, KVTransferError, LayoutMismatch
from kv_transfer.handshake import check_reply, refusal_for
from kv_transfer.layout import KVLayout
from kv_transfer.lease import LeaseTable
from kv_transfer.lease_keeper import LeaseKeeper
from kv_transfer.messages import (
    SIDE_CHANNEL_VERSION,
    Ack,
    BackendInfo,
    ConfirmRead,
    Hello,
    HelloReply,
    LeaseRef,
    ReadConfirmed,
    Release,
    RenewLeases,
    SideMessage,
)
from kv_transfer.security import is_wildcard
from kv_transfer.shards import CacheShard, as_shards, check_shards

logger = logging.getLogger(__name__)
# NOTE: a one-block NIXL read confirmed while the reader's thread ran Python (a node's steps):
# 11 ms at the default 5 ms, 2.9 ms at 1 ms, 1.9 ms at 0.5 ms, 0.8 ms with the reader asleep.
THREAD_SWITCH_INTERVAL_S = 0.0005


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
    lease: RemoteLease
    local_block_ids: list[int]
    started_at: float = field(default_factory=time.monotonic)
    handle: object = None  # the backend's transfer handle once started
    confirmation: Confirmation | Future | None = None  # set once the transfer completed: the holder's answer
    confirm: bool = True  # False: a part of a streamed lease, not confirmed (see KVConnector.start_read)

    @property
    def remote_engine_id(self) -> str:
        return self.lease.engine_id

    @property
    def remote_address(self) -> str:
        return self.lease.address

    @property
    def remote_block_ids(self) -> list[int]:
        return self.lease.block_ids


class Confirmation:
    """A ConfirmRead in flight (side_channel.Exchange): done() picks the holder's answer up;
    result() is True when the holder says the lease held until now (and ended it)."""

    def __init__(self, exchange: side_channel.Exchange, request_id: str, address: str, ref: LeaseRef) -> None:
        self._exchange = exchange
        self._request_id = request_id
        self._address = address
        self._ref = ref

    def done(self) -> bool:
        return self._exchange.done()

    @property
    def socket(self):
        """The socket the holder's answer comes on, while it is awaited (None after)."""
        return self._exchange.socket

    def cancel(self) -> None:
        self._exchange.cancel()

    def result(self) -> bool:
        try:
            reply = self._exchange.reply()
        except HandshakeFailed as exc:  # no answer means not confirmed
            logger.warning("request %s: lease confirmation from %s failed: %s", self._request_id, self._address, exc,
                           extra={"request_id": self._request_id})
            return False
        return isinstance(reply, ReadConfirmed) and reply.lease == self._ref and reply.is_held


class SideChannelConnector(KVConnector, ABC):
    backend = "none"
    # The BackendInfo types this backend's Hello (reader's) and HelloReply (holder's) carry;
    # None: that message carries none. The handshake refuses any other.
    reader_info_type: type[BackendInfo] | None = None
    holder_info_type: type[BackendInfo] | None = None

    def __init__(self, config: TransferConfig, kv_cache: torch.Tensor | list[CacheShard], layout: KVLayout,
                 engine_id: str) -> None:
        """kv_cache: the engine's cache, or each tensor-parallel rank's (kv_transfer.shards)."""
        self.shards = as_shards(kv_cache)
        check_shards(self.shards, layout)
        if sys.getswitchinterval() > THREAD_SWITCH_INTERVAL_S:
            sys.setswitchinterval(THREAD_SWITCH_INTERVAL_S)
        self.config = config
        self.kv_cache = self.shards[0].cache  # rank 0's (the whole cache on one rank)
        self.layout = layout
        self.engine_id = engine_id
        self.block_bytes = sum(s.cache[0].numel() * s.cache.element_size() for s in self.shards)
        self._leases: LeaseTable | None = None  # holder side, once serve_leases() was called
        self._peers: dict[str, Peer] = {}
        self._handshakes: dict[str, tuple[str, Future]] = {}  # engine id -> (address, (reply, handle))
        self._reads: dict[str, PendingRead] = {}
        # Reads that failed or were aborted while their transfer could not be stopped: it may
        # still write their local blocks, so their results wait until it ended (request id ->
        # the read, its result, when it was set aside).
        self._draining: dict[str, tuple[PendingRead, ReadResult, float]] = {}
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-handshake")
        self._notifier = side_channel.Notifier(config.curve_keys)
        self._requester = side_channel.Requester(config.curve_keys)
        self._keeper = LeaseKeeper(config.curve_keys)
        if is_wildcard(config.public_host):
            raise ValueError(f"KV side channel binds {config.host!r}, which peers cannot dial: "
                             "set --advertise-host to this node's address")
        self._server = side_channel.SideChannelServer(config.host, config.side_channel_port, self._on_side_message,
                                                      config.curve_keys, config.advertise_host)
        self.agent_address = self._server.address
        self.num_handshake_failures = 0

    # ---- reader side --------------------------------------------------------------------------

    def hold(self, request_id: str, lease: RemoteLease) -> None:
        check_address(lease.address)
        self._keeper.hold(request_id, lease)

    def start_read(self, request_id: str, lease: RemoteLease, local_block_ids: list[int],
                   confirm: bool = True) -> None:
        check_read(request_id, lease, local_block_ids, self._reads)
        if request_id in self._draining:
            raise ValueError(f"request {request_id!r} already has a read in flight (aborted, its transfer not "
                             "yet stopped)")
        check_address(lease.address)
        self._reads[request_id] = PendingRead(request_id, lease, list(local_block_ids), confirm=confirm)
        if lease.engine_id not in self._peers and lease.engine_id not in self._handshakes:
            future = self._executor.submit(self._handshake, lease.address)
            self._handshakes[lease.engine_id] = (lease.address, future)

    def poll(self) -> list[ReadResult]:
        results = self._finish_draining()
        results += self._finish_handshakes()
        now = time.monotonic()
        for read in list(self._reads.values()):
            if read.confirmation is not None:
                continue  # bounded by the confirmation's own timeout
            if read.handle is None and read.remote_engine_id in self._peers:
                results += self._start(read)
            elif now - read.started_at > self.config.transfer_timeout_s:
                results.append(self._fail(read, f"no completion within {self.config.transfer_timeout_s} s",
                                          FailureCode.TIMEOUT))
        results += self._poll_backend()
        results += self._finish_confirmations()
        return [r for r in results if r.request_id not in self._draining]  # theirs come once drained

    def wake_sockets(self) -> list:
        return [read.confirmation.socket for read in self._reads.values()
                if isinstance(read.confirmation, Confirmation) and read.confirmation.socket is not None]

    def abort_read(self, request_id: str) -> bool:
        read = self._reads.pop(request_id, None)
        if read is None:
            return True
        if read.confirmation is not None:
            read.confirmation.cancel()  # its answer, if any, is ignored
        if read.handle is not None and not self._cancel(read):
            self._set_aside(read, ReadResult(request_id, False, f"request {request_id}: aborted",
                                             FailureCode.ABORTED))
            return False
        self._release_read(read)
        self._drop_unneeded_handshake(read.remote_engine_id)
        return True

    def release_remote(self, request_id: str, lease: RemoteLease) -> None:
        self._keeper.drop(request_id)
        self._notifier.send(lease.address, Release(lease.engine_id, [LeaseRef(request_id, lease.generation)]))

    @property
    def num_reads_in_flight(self) -> int:
        return len(self._reads) + len(self._draining)

    @property
    def num_rejected_messages(self) -> int:
        return self._server.rejects.num_rejected

    # ---- holder side --------------------------------------------------------------------------

    def serve_leases(self, leases: LeaseTable) -> None:
        self._leases = leases

    def close(self) -> None:
        for read in list(self._reads.values()):
            self.abort_read(read.request_id)
        self._keeper.close()
        self._server.close()
        self._notifier.close()
        self._requester.close()
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
        """Failed transfers (via _fail); call _transferred(read) for each one that completed."""

    @abstractmethod
    def _cancel(self, read: PendingRead) -> bool:
        """Stop a started transfer and release its backend resources (read.handle None after).
        False, without waiting: it is under way and cannot be stopped yet (it may still write
        the local blocks); call again later."""

    def _on_confirmed(self, read: PendingRead) -> None:
        """Caller's thread: the holder confirmed the read (or it is a part of a stream, confirmed
        later); make its data the local blocks' (a backend that read into a staging buffer
        copies it now)."""

    def _release_read(self, read: PendingRead) -> None:
        """The read ended (succeeded, failed or aborted; any transfer of it cancelled): free what
        the backend holds for it beyond the transfer (staging buffers)."""

    def _forget_peer(self, peer: Peer) -> None:
        """Drop the backend's state for a peer that failed."""

    def _on_backend_message(self, message: SideMessage) -> SideMessage | None:
        self._server.rejects.reject("unexpected", f"{type(message).__name__} is not for a {self.backend} holder")
        return Ack(error=f"unexpected message {type(message).__name__}")

    # ---- the handshake ------------------------------------------------------------------------

    def _handshake(self, address: str) -> tuple[HelloReply, object]:
        """Handshake thread: exchange layouts and backend details with the holder. Returns its
        accepted reply and the new peer's handle; raises LayoutMismatch or HandshakeFailed."""
        reader_info, prepared = self._prepare_hello()
        hello = Hello(SIDE_CHANNEL_VERSION, self.engine_id, self.layout, self.backend, reader_info)
        reply = self._requester.request(address, hello, self.config.handshake_timeout_s)
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
        if isinstance(message, RenewLeases | Release | ConfirmRead):
            return self._answer_lease_message(message)
        return self._on_backend_message(message)

    def _answer_lease_message(self, message: RenewLeases | Release | ConfirmRead) -> SideMessage | None:
        """Holder, side-channel thread: messages for another engine id (a restarted holder's
        old self) or about leases that ended change nothing."""
        leases = self._leases if message.engine_id == self.engine_id else None
        if isinstance(message, ConfirmRead):
            ref = message.lease
            return ReadConfirmed(ref, leases is not None and leases.end(ref.request_id, ref.generation))
        for ref in message.leases if leases is not None else ():
            if isinstance(message, RenewLeases):
                leases.renew(ref.request_id, ref.generation)
            else:
                leases.end(ref.request_id, ref.generation)
        return None

    def _finish_handshakes(self) -> list[ReadResult]:
        results = []
        for engine_id, (address, future) in list(self._handshakes.items()):
            if not future.done():
                continue
            del self._handshakes[engine_id]
            if future.cancelled():
                continue
            try:
                self._add_peer(engine_id, address, *future.result())
            except Exception as exc:  # noqa: BLE001 - any peer failure (ours, zmq's, the backend's) fails its reads
                self.num_handshake_failures += 1
                code = FailureCode.LAYOUT_MISMATCH if isinstance(exc, LayoutMismatch) else FailureCode.HANDSHAKE
                logger.warning("KV handshake with %s at %s failed: %s", engine_id, address, exc)
                results += [self._fail(r, f"handshake with {address} failed: {exc}", code)
                            for r in list(self._reads.values()) if r.remote_engine_id == engine_id]
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

    def _drop_unneeded_handshake(self, engine_id: str) -> None:
        """Cancel a handshake not yet begun that no read waits for any more (a flood of reads
        naming unreachable holders must not queue handshakes for nothing)."""
        pending = self._handshakes.get(engine_id)
        is_needed = any(r.remote_engine_id == engine_id for r in self._reads.values())
        if pending is not None and not is_needed and pending[1].cancel():
            del self._handshakes[engine_id]

    # ---- reads --------------------------------------------------------------------------------

    def _start(self, read: PendingRead) -> list[ReadResult]:
        peer = self._peers[read.remote_engine_id]
        bad = _outside(read.remote_block_ids, peer.layout.num_blocks) + _outside(read.local_block_ids,
                                                                                 self.layout.num_blocks)
        if bad:
            return [self._fail(read, f"block ids {bad[:5]} are outside the caches ({peer.layout.num_blocks} remote, "
                                     f"{self.layout.num_blocks} local blocks)", FailureCode.BAD_BLOCKS)]
        try:
            self._start_transfer(read, peer)
            return []
        except KVTransferError as exc:
            return [self._fail(read, str(exc), FailureCode.TRANSFER)]

    def _transferred(self, read: PendingRead) -> None:
        """The backend's transfer completed: ask the holder whether the lease held throughout
        (see the module docstring); poll() picks the answer up."""
        read.handle = None
        if read.confirm:
            lease = read.lease
            ref = LeaseRef(read.request_id, lease.generation)
            exchange = self._requester.start(lease.address, ConfirmRead(lease.engine_id, ref),
                                             self.config.handshake_timeout_s)
            read.confirmation = Confirmation(exchange, read.request_id, lease.address, ref)
        else:
            read.confirmation = Future()  # a part of a stream: confirmed with its last read
            read.confirmation.set_result(True)

    def _finish_confirmations(self) -> list[ReadResult]:
        results = []
        for read in list(self._reads.values()):
            if read.confirmation is None or not read.confirmation.done():
                continue
            if read.confirmation.result():
                self._on_confirmed(read)
                results.append(self._succeed(read))
            else:
                results.append(self._fail(read, f"the lease (generation {read.lease.generation}) on "
                                                f"{read.remote_address} was not confirmed after the read: it ended "
                                                f"first, so its blocks may have been reused; the data is discarded",
                                          FailureCode.LEASE_LOST))
        return results

    def _fail(self, read: PendingRead, error: str, code: FailureCode) -> ReadResult:
        """The read's failure result; poll() withholds it while its transfer cannot be stopped."""
        self._reads.pop(read.request_id, None)
        if read.confirm:
            self._keeper.drop(read.request_id)
        result = ReadResult(read.request_id, False, f"request {read.request_id}: {error}", code)
        if read.handle is not None and not self._cancel(read):
            self._set_aside(read, result)
            return result
        return self._ended(read, result)

    def _set_aside(self, read: PendingRead, result: ReadResult) -> None:
        logger.warning("KV read of request %s ended (%s) while its transfer still runs: its blocks stay held "
                       "until it stops", read.request_id, result.failure.value, extra={"request_id": read.request_id})
        self._draining[read.request_id] = (read, result, time.monotonic())

    def _finish_draining(self) -> list[ReadResult]:
        """The results of set-aside reads whose transfer stopped; after transfer_timeout_s more,
        a result with blocks_held (their blocks stay out of use: nothing says the transfer ended)."""
        results = []
        for request_id, (read, result, since) in list(self._draining.items()):
            if self._cancel(read):
                del self._draining[request_id]
                results.append(self._ended(read, result))
            elif time.monotonic() - since > self.config.transfer_timeout_s:
                del self._draining[request_id]
                # NOTE: its staging buffers, if any, stay registered: the transfer may still write them.
                peer = self._peers.pop(read.remote_engine_id, None)
                if peer is not None:
                    self._forget_peer(peer)
                logger.error("KV read of request %s: its transfer did not stop within %s s; its %d local blocks "
                             "stay out of use", request_id, self.config.transfer_timeout_s,
                             len(read.local_block_ids), extra={"request_id": request_id})
                results.append(replace(result, blocks_held=True))
        return results

    def _ended(self, read: PendingRead, result: ReadResult) -> ReadResult:
        """Past a failed or aborted read's transfer: free what remains of it; returns result."""
        self._release_read(read)
        code = result.failure
        if code in (FailureCode.TRANSFER, FailureCode.TIMEOUT):
            # NOTE: a failed transfer may mean the peer died or restarted: forget it, so the next
            # read handshakes again.
            peer = self._peers.pop(read.remote_engine_id, None)
            if peer is not None:
                self._forget_peer(peer)
        self._drop_unneeded_handshake(read.remote_engine_id)
        return result

    def _succeed(self, read: PendingRead) -> ReadResult:
        self._reads.pop(read.request_id, None)
        if read.confirm:
            self._keeper.drop(read.request_id)
        self._release_read(read)
        return ReadResult(read.request_id, True)


def _outside(block_ids: list[int], num_blocks: int) -> list[int]:
    return [b for b in block_ids if not 0 <= b < num_blocks]
