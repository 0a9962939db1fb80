"""FakeConnector: KVConnector in one process, for node tests: connectors sharing a FakeRegistry
reach each other by address and copy blocks directly, with failures injected on demand. Leases
behave as over the side channel: hold() renews at once and on renew_held(), a read copies the
blocks and then confirms (ends) the holder's lease, failing LEASE_LOST when it had ended (a part
of a stream, read without confirm, only copies)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kv_transfer.base import FailureCode, KVConnector, ReadResult, RemoteLease, check_read
from kv_transfer.config import TransferConfig
from kv_transfer.errors import LayoutMismatch
from kv_transfer.layout import KVLayout, check_compatible
from kv_transfer.lease import LeaseTable
from kv_transfer.shards import CacheShard, as_shards, check_shards, gather_heads, scatter_heads

# fail: the read fails when it would finish; hang: it never finishes; stuck: it never finishes and
# its transfer cannot be stopped (abort_read() says so, results wait) until unstick().
FAILURES = ("fail", "hang", "stuck")


class FakeRegistry:
    """The in-process network: address -> live connector."""

    def __init__(self) -> None:
        self._connectors: dict[str, FakeConnector] = {}
        self._ports = itertools.count(1)

    def add(self, connector: FakeConnector, port: int | None) -> str:
        address = f"fake:{port if port else next(self._ports)}"
        if address in self._connectors:
            raise ValueError(f"address {address} is taken by engine {self._connectors[address].engine_id}")
        self._connectors[address] = connector
        return address

    def remove(self, address: str) -> None:
        self._connectors.pop(address, None)

    def get(self, address: str) -> FakeConnector | None:
        return self._connectors.get(address)


@dataclass
class _FakeRead:
    request_id: str
    lease: RemoteLease
    local_block_ids: list[int]
    started_at: float
    num_polls_left: int
    failure: str | None
    confirm: bool = True


class FakeConnector(KVConnector):
    """A read finishes on its num_polls_per_read-th poll() (so a test can abort it mid-way),
    copying the holder's blocks, then confirming the lease with the holder's LeaseTable."""

    backend = "fake"

    def __init__(self, config: TransferConfig, kv_cache: torch.Tensor | list[CacheShard], layout: KVLayout,
                 engine_id: str, registry: FakeRegistry, clock: Callable[[], float] = time.monotonic,
                 num_polls_per_read: int = 1) -> None:
        self.shards = as_shards(kv_cache)
        check_shards(self.shards, layout)
        if num_polls_per_read < 1:
            raise ValueError(f"num_polls_per_read must be >= 1, got {num_polls_per_read}")
        self.config, self.kv_cache, self.layout, self.engine_id = config, self.shards[0].cache, layout, engine_id
        self._registry, self._clock, self._num_polls_per_read = registry, clock, num_polls_per_read
        self._reads: dict[str, _FakeRead] = {}
        self._failures: dict[str, str] = {}
        self._held: dict[str, RemoteLease] = {}
        self._draining: dict[str, tuple[ReadResult, float]] = {}  # set aside: (result, since), as the real ones do
        self._unstuck: set[str] = set()
        self.leases: LeaseTable | None = None  # holder side, once served
        self.agent_address = registry.add(self, config.side_channel_port or None)

    def inject(self, request_id: str, failure: str) -> None:
        """Make the read of request_id (started now or later) end as failure (see FAILURES)."""
        if failure not in FAILURES:
            raise ValueError(f"failure must be one of {FAILURES}, got {failure!r}")
        self._failures[request_id] = failure

    def hold(self, request_id: str, lease: RemoteLease) -> None:
        self._held[request_id] = lease
        self._renew(request_id, lease)

    def renew_held(self) -> None:
        """What the real connector's keeper thread does every lease_timeout_s / 3."""
        for request_id, lease in self._held.items():
            self._renew(request_id, lease)

    def start_read(self, request_id: str, lease: RemoteLease, local_block_ids: list[int],
                   confirm: bool = True) -> None:
        check_read(request_id, lease, local_block_ids, self._reads)
        if request_id in self._draining:
            raise ValueError(f"request {request_id!r} already has a read in flight (aborted, its transfer not "
                             "yet stopped)")
        self._reads[request_id] = _FakeRead(request_id, lease, list(local_block_ids), self._clock(),
                                            self._num_polls_per_read, self._failures.pop(request_id, None), confirm)

    def unstick(self, request_id: str) -> None:
        """The stuck transfer of request_id has ended (see FAILURES)."""
        self._unstuck.add(request_id)

    def poll(self) -> list[ReadResult]:
        results = []
        for request_id, (result, since) in list(self._draining.items()):
            if request_id in self._unstuck:
                results.append(result)
            elif self._clock() - since > self.config.transfer_timeout_s:
                results.append(replace(result, blocks_held=True))
            else:
                continue
            del self._draining[request_id]
        for read in list(self._reads.values()):
            result = self._advance(read)
            if result is not None:
                del self._reads[read.request_id]
                if read.confirm:
                    self._held.pop(read.request_id, None)
                if self._is_stuck(read):
                    self._draining[read.request_id] = (result, self._clock())
                else:
                    results.append(result)
        return results

    def abort_read(self, request_id: str) -> bool:
        read = self._reads.pop(request_id, None)
        if read is not None and self._is_stuck(read):
            self._draining[request_id] = (self._failed(read, "aborted", FailureCode.ABORTED), self._clock())
            return False
        return True  # a fake read's copy happens whole inside poll(): none is ever under way here

    def release_remote(self, request_id: str, lease: RemoteLease) -> None:
        self._held.pop(request_id, None)
        holder = self._holder(lease)
        if holder is not None and holder.leases is not None:
            holder.leases.end(request_id, lease.generation)

    @property
    def num_reads_in_flight(self) -> int:
        return len(self._reads) + len(self._draining)

    def serve_leases(self, leases: LeaseTable) -> None:
        self.leases = leases

    def close(self) -> None:
        self._reads.clear()
        if self._registry.get(self.agent_address) is self:
            self._registry.remove(self.agent_address)

    def _holder(self, lease: RemoteLease) -> FakeConnector | None:
        holder = self._registry.get(lease.address)
        return holder if holder is not None and holder.engine_id == lease.engine_id else None

    def _renew(self, request_id: str, lease: RemoteLease) -> None:
        holder = self._holder(lease)
        if holder is not None and holder.leases is not None:
            holder.leases.renew(request_id, lease.generation)

    def _advance(self, read: _FakeRead) -> ReadResult | None:
        if self._clock() - read.started_at > self.config.transfer_timeout_s:
            return self._failed(read, f"no completion within {self.config.transfer_timeout_s} s", FailureCode.TIMEOUT)
        read.num_polls_left -= 1
        if read.failure in ("hang", "stuck") or read.num_polls_left > 0:
            return None
        lease = read.lease
        holder = self._registry.get(lease.address)
        if holder is None or holder.engine_id != lease.engine_id:
            found = "nothing" if holder is None else f"engine {holder.engine_id!r}"
            return self._failed(read, f"handshake failed: {found} at {lease.address}, "
                                      f"expected engine {lease.engine_id!r}", FailureCode.HANDSHAKE)
        try:
            check_compatible(self.layout, holder.layout)
        except LayoutMismatch as exc:
            return self._failed(read, f"handshake failed: {exc}", FailureCode.LAYOUT_MISMATCH)
        if read.failure == "fail":
            return self._failed(read, "injected transfer failure", FailureCode.TRANSFER)
        bad = [b for b in lease.block_ids if not 0 <= b < holder.layout.num_blocks]
        if bad:
            return self._failed(read, f"block ids {bad[:5]} are outside the holder's cache", FailureCode.BAD_BLOCKS)
        scatter_heads(self.shards, read.local_block_ids,
                      gather_heads(holder.shards, lease.block_ids, holder.layout.num_kv_heads))
        if not read.confirm:
            return ReadResult(read.request_id, True)  # a part: confirmed with the stream's last read
        if holder.leases is None or not holder.leases.end(read.request_id, lease.generation):
            return self._failed(read, "the lease was not confirmed after the read", FailureCode.LEASE_LOST)
        return ReadResult(read.request_id, True)

    def _is_stuck(self, read: _FakeRead) -> bool:
        return read.failure == "stuck" and read.request_id not in self._unstuck

    @staticmethod
    def _failed(read: _FakeRead, error: str, code: FailureCode) -> ReadResult:
        return ReadResult(read.request_id, False, f"request {read.request_id}: {error}", code)
