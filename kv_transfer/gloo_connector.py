"""torch.distributed connector (gloo) for clusters without UCX. A GPU cache's blocks travel through
host memory (NCCL is not used here: it cannot pair two processes on one GPU).

Each reader/holder pair gets its own two-rank process group, made on demand: the reader hosts
a TCPStore (on a port the store picks) and names it in its Hello (GlooStoreInfo); both sides
then join (holder rank 0, reader rank 1). A read posts a receive into a staging buffer and
asks the holder over the side channel to send the lease's blocks under a unique tag; the
holder's sender thread gathers and sends them (a thread blocked in send, never spinning), or
zeros when the lease is not held (the read then fails its confirmation). Once the holder has
confirmed the lease, the reader scatters the staging buffer into its blocks.
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

from kv_transfer.base import FailureCode, ReadResult
from kv_transfer.config import TransferConfig
from kv_transfer.errors import HandshakeFailed, TransferFailed
from kv_transfer.layout import KVLayout
from kv_transfer.messages import GlooStoreInfo, Hello, HelloReply, LeaseRef, ReadRequest, SideMessage
from kv_transfer.shards import CacheShard, gather_heads, scatter_heads
from kv_transfer.side_channel_connector import Peer, PendingRead, SideChannelConnector

logger = logging.getLogger(__name__)

_HOLDER_RANK = 0
_READER_RANK = 1


class GlooConnector(SideChannelConnector):
    backend = "gloo"
    reader_info_type = GlooStoreInfo  # the reader hosts the pair's store; the holder adds nothing

    def __init__(self, config: TransferConfig, kv_cache: torch.Tensor | list[CacheShard], layout: KVLayout,
                 engine_id: str) -> None:
        self._timeout = datetime.timedelta(seconds=config.transfer_timeout_s)
        self._groups: dict[str, tuple] = {}  # holder side: reader engine id -> (group, store)
        self._sends: queue.SimpleQueue = queue.SimpleQueue()
        self._tags = itertools.count(1)
        self._staging: dict[str, torch.Tensor] = {}
        self._waiters = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-gloo-recv")
        super().__init__(config, kv_cache, layout, engine_id)
        self._sender = threading.Thread(target=self._send_loop, name="kv-gloo-sender", daemon=True)
        self._sender.start()

    # ---- reader side --------------------------------------------------------------------------

    def _prepare_hello(self) -> tuple[GlooStoreInfo, dist.TCPStore]:
        """Handshake thread: host the pair's store on a port it picks (port 0)."""
        try:
            store = dist.TCPStore(self.config.host, 0, 2, True, timeout=self._handshake_timeout(),
                                  wait_for_workers=False)
        except RuntimeError as exc:
            raise HandshakeFailed(f"gloo store could not start on {self.config.host}: {exc}") from exc
        return GlooStoreInfo(self.config.public_host, store.port), store

    def _on_hello_accepted(self, reply: HelloReply, prepared: dist.TCPStore) -> tuple:
        """Handshake thread: join the pair's group as rank 1 (the holder joins as it answers)."""
        try:
            group = dist.ProcessGroupGloo(prepared, _READER_RANK, 2, self._timeout)
        except RuntimeError as exc:
            raise HandshakeFailed(f"gloo group with {reply.engine_id} could not form: {exc}") from exc
        return group, prepared  # the pair's store is kept beside its group

    def _handshake_timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.config.handshake_timeout_s)

    def _start_transfer(self, read: PendingRead, peer: Peer) -> None:
        group, _ = peer.handle
        tag = next(self._tags)
        # NOTE: gloo moves host memory only: a GPU cache's blocks land in host memory, then in the cache.
        staging = torch.empty(self._blocks_shape(len(read.local_block_ids)), dtype=self.kv_cache.dtype,
                              pin_memory=self.kv_cache.is_cuda)
        self._staging[read.request_id] = staging
        try:
            work = group.recv([staging], _HOLDER_RANK, tag)
        except RuntimeError as exc:  # the pair's connection is already broken
            self._staging.pop(read.request_id, None)
            raise TransferFailed(f"gloo receive could not start: {exc}") from exc
        # NOTE: gloo progresses a receive only inside wait() (polling is_completed() never
        # turns true), so a waiter thread blocks there; poll() checks its future.
        read.handle = self._waiters.submit(work.wait, self._timeout)
        self._notifier.send(peer.address, ReadRequest(self.engine_id, LeaseRef(read.request_id, read.lease.generation),
                                                      read.remote_block_ids, tag))

    def _poll_backend(self) -> list[ReadResult]:
        results = []
        for read in list(self._reads.values()):
            waiter = read.handle
            if waiter is None or not waiter.done():
                continue
            error = waiter.exception()
            if error is not None:
                read.handle = None
                self._staging.pop(read.request_id, None)
                results.append(self._fail(read, f"gloo receive failed: {error}", FailureCode.TRANSFER))
                continue
            self._transferred(read)  # NOTE: the staging buffer waits for the holder's confirmation
        return results

    def _on_confirmed(self, read: PendingRead) -> None:
        scatter_heads(self.shards, read.local_block_ids, self._staging.pop(read.request_id))

    def _blocks_shape(self, num_blocks: int) -> tuple[int, ...]:
        """What moves: blocks of every head of the model, whatever either side's ranks hold."""
        layout = self.layout
        return num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim

    def _cancel(self, read: PendingRead) -> bool:
        # NOTE: a posted gloo receive cannot be withdrawn; it lands in its own staging buffer,
        # never in the cache, so dropping our references is enough.
        self._staging.pop(read.request_id, None)
        read.handle = None
        return True

    def _fail(self, read: PendingRead, error: str, code: FailureCode) -> ReadResult:
        self._staging.pop(read.request_id, None)  # a confirmed-or-not staging buffer, or a receive's
        return super()._fail(read, error, code)

    def _forget_peer(self, peer: Peer) -> None:
        peer.handle = None

    # ---- holder side --------------------------------------------------------------------------

    def _answer_info(self, hello: Hello) -> None:
        """Side-channel thread: join the reader's group from another thread (the reader joins
        only after it has our answer); the reply carries nothing of ours."""
        threading.Thread(target=self._join_group, args=(hello.engine_id, hello.backend_info), daemon=True).start()

    def _join_group(self, reader_id: str, info: GlooStoreInfo) -> None:
        try:
            store = dist.TCPStore(info.store_host, info.store_port, 2, False, timeout=self._handshake_timeout())
            self._groups[reader_id] = (dist.ProcessGroupGloo(store, _HOLDER_RANK, 2, self._timeout), store)
        except RuntimeError as exc:
            logger.warning("gloo group with reader %s could not form: %s", reader_id, exc)

    def _on_backend_message(self, message: SideMessage) -> SideMessage | None:
        if isinstance(message, ReadRequest):
            self._sends.put(message)
            return None
        return super()._on_backend_message(message)

    def _send_loop(self) -> None:
        while True:
            message = self._sends.get()
            if message is None:
                return
            try:
                self._send_blocks(message)
            except Exception as exc:  # noqa: BLE001 - a thread edge: one bad request must not stop the sender
                logger.warning("gloo send of request %s failed: %s", message.lease.request_id, exc)

    def _send_blocks(self, message: ReadRequest) -> None:
        request_id = message.lease.request_id
        group_and_store = self._wait_for_group(message.engine_id)
        if group_and_store is None:
            logger.warning("no gloo group with %s for request %s", message.engine_id, request_id)
            return
        group, _ = group_and_store
        group.send([self._blocks_for(message).cpu()], _READER_RANK, message.tag).wait(self._timeout)  # host memory

    def _blocks_for(self, message: ReadRequest) -> torch.Tensor:
        """The asked blocks of the lease (all of them, or those past the prefix the reader had
        cached); zeros of the asked shape when the lease is not held or the blocks are not all
        its own (the reader fails its confirmation and discards them), never blocks that are
        someone else's. Raises ValueError for a count past the cache (the reader checks
        against our layout first, so only a broken peer asks that)."""
        lease = message.lease
        if self._leases and message.block_ids and self._leases.holds(lease.request_id, lease.generation,
                                                                     message.block_ids):
            return gather_heads(self.shards, message.block_ids, self.layout.num_kv_heads)
        if len(message.block_ids) > self.layout.num_blocks:
            raise ValueError(f"{len(message.block_ids)} blocks asked of a cache of {self.layout.num_blocks}")
        return torch.zeros(self._blocks_shape(len(message.block_ids)), dtype=self.kv_cache.dtype,
                           device=self.kv_cache.device)

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
