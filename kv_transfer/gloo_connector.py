"""torch.distributed connector (gloo on CPU, NCCL-capable layout on GPU) for clusters without UCX.

Each reader/holder pair gets its own two-rank process group, made on demand: the reader hosts
a TCPStore and names it in the handshake; both sides then join (holder rank 0, reader rank 1).
A read posts a receive into a staging buffer and asks the holder over the side channel to
send the blocks under a unique tag; the holder's sender thread gathers and sends them (a thread
blocked in send, never spinning). On completion the reader scatters the staging buffer into
its blocks and tells the holder it may free them.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from kv_transfer import side_channel
from kv_transfer.base import ReadResult
from kv_transfer.peered import PendingRead, Peer, SideChannelConnector
from kv_transfer.config import TransferConfig
from kv_transfer.errors import HandshakeFailed, LayoutMismatch, TransferFailed
from kv_transfer.layout import KVLayout, check_compatible

logger = logging.getLogger(__name__)

_HOLDER_RANK = 0
_READER_RANK = 1


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class GlooConnector(SideChannelConnector):
    backend = "gloo"

    def __init__(self, config: TransferConfig, kv_cache: torch.Tensor, layout: KVLayout, engine_id: str) -> None:
        self._timeout = datetime.timedelta(seconds=config.transfer_timeout_s)
        self._groups: dict[str, dist.ProcessGroup] = {}  # holder side: reader engine id -> group
        self._ready_groups: dict[str, tuple] = {}  # reader side: made in the handshake thread
        self._sends: queue.SimpleQueue = queue.SimpleQueue()
        self._tags = itertools.count(1)
        self._staging: dict[str, torch.Tensor] = {}
        self._waiters = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-gloo-recv")
        super().__init__(config, kv_cache, layout, engine_id)
        self._sender = threading.Thread(target=self._send_loop, name="kv-gloo-sender", daemon=True)
        self._sender.start()

    # ---- reader side --------------------------------------------------------------------------

    def _hello_extra(self) -> dict:
        return {}

    def _handshake(self, address: str) -> side_channel.HelloReply:
        """Worker thread: host a store, handshake, then join the pair's group as rank 1."""
        store_port = _free_port(self.config.host)
        store = dist.TCPStore(self.config.host, store_port, 2, True, timeout=self._handshake_timeout(),
                              wait_for_workers=False)
        hello = side_channel.Hello(self.engine_id, self.layout, self.backend,
                                   {"store_host": self.config.host, "store_port": store_port})
        reply = side_channel.request(address, hello, self.config.handshake_timeout_s)
        if not isinstance(reply, side_channel.HelloReply):
            raise HandshakeFailed(f"KV side channel {address} answered {type(reply).__name__}")
        if reply.error:
            raise LayoutMismatch(reply.error) if "layouts differ" in reply.error else HandshakeFailed(reply.error)
        check_compatible(self.layout, reply.layout)
        try:
            group = dist.ProcessGroupGloo(store, _READER_RANK, 2, self._timeout)
        except RuntimeError as exc:
            raise HandshakeFailed(f"gloo group with {address} could not form: {exc}") from exc
        self._ready_groups[reply.engine_id] = (group, store)
        return reply

    def _handshake_timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.config.handshake_timeout_s)

    def _connect_peer(self, peer: Peer) -> None:
        peer.state = self._ready_groups.pop(peer.engine_id)

    def _start_transfer(self, read: PendingRead, peer: Peer) -> None:
        group, _ = peer.state
        tag = next(self._tags)
        staging = torch.empty((len(read.local_block_ids), *self.kv_cache.shape[1:]), dtype=self.kv_cache.dtype,
                              device=self.kv_cache.device)
        self._staging[read.request_id] = staging
        try:
            work = group.recv([staging], _HOLDER_RANK, tag)
        except RuntimeError as exc:  # the pair's connection is already broken
            self._staging.pop(read.request_id, None)
            raise TransferFailed(f"gloo receive could not start: {exc}") from exc
        # NOTE: gloo progresses a receive only inside wait() (polling is_completed() never
        # turns true), so a waiter thread blocks there; poll() checks its future.
        read.state = self._waiters.submit(work.wait, self._timeout)
        self._notifier.send(peer.address, side_channel.ReadRequest(self.engine_id, read.request_id,
                                                                   read.remote_block_ids, tag))

    def _poll_backend(self) -> list[ReadResult]:
        results = []
        for read in list(self._reads.values()):
            waiter = read.state
            if waiter is None or not waiter.done():
                continue
            staging = self._staging.pop(read.request_id)
            error = waiter.exception()
            if error is not None:
                read.state = None
                results.append(self._fail(read, f"gloo receive failed: {error}"))
                continue
            self.kv_cache[torch.tensor(read.local_block_ids, device=self.kv_cache.device)] = staging
            self._notifier.send(read.remote_address, side_channel.Release([read.request_id]))
            read.state = None
            results.append(self._succeed(read))
        return results

    def _cancel(self, read: PendingRead) -> None:
        # NOTE: a posted gloo receive cannot be withdrawn; it lands in its own staging buffer,
        # never in the cache, so dropping our references is enough.
        self._staging.pop(read.request_id, None)
        read.state = None

    def _forget_peer(self, peer: Peer) -> None:
        peer.state = None

    # ---- holder side --------------------------------------------------------------------------

    def _hello_extra_for(self, hello: side_channel.Hello) -> dict:
        """Side-channel thread: answer, and join the reader's group from another thread (the
        reader joins only after it has this answer)."""
        extra = dict(hello.extra)
        threading.Thread(target=self._join_group, args=(hello.engine_id, extra), daemon=True).start()
        return {}

    def _join_group(self, reader_id: str, extra: dict) -> None:
        try:
            store = dist.TCPStore(extra["store_host"], extra["store_port"], 2, False, timeout=self._handshake_timeout())
            self._groups[reader_id] = (dist.ProcessGroupGloo(store, _HOLDER_RANK, 2, self._timeout), store)
        except (RuntimeError, KeyError) as exc:
            logger.warning("gloo group with reader %s could not form: %s", reader_id, exc)

    def _on_backend_message(self, message):
        if isinstance(message, side_channel.ReadRequest):
            self._sends.put(message)
            return None
        return super()._on_backend_message(message)

    def _send_loop(self) -> None:
        while True:
            message = self._sends.get()
            if message is None:
                return
            self._send_blocks(message)

    def _send_blocks(self, message: side_channel.ReadRequest) -> None:
        group_and_store = self._wait_for_group(message.engine_id)
        if group_and_store is None:
            logger.warning("no gloo group with %s for request %s", message.engine_id, message.request_id)
            return
        group, _ = group_and_store
        ids = torch.tensor(message.block_ids, device=self.kv_cache.device)
        try:
            group.send([self.kv_cache[ids].contiguous()], _READER_RANK, message.tag).wait(self._timeout)
        except RuntimeError as exc:
            logger.warning("gloo send of request %s failed: %s", message.request_id, exc)

    def _wait_for_group(self, reader_id: str):
        deadline = threading.Event()
        for _ in range(int(self.config.handshake_timeout_s * 100)):
            if reader_id in self._groups:
                return self._groups[reader_id]
            deadline.wait(0.01)
        return self._groups.get(reader_id)

    def close(self) -> None:
        self._sends.put(None)
        super().close()
        self._waiters.shutdown(wait=False, cancel_futures=True)
