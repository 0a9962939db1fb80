"""FakeConnector: KVConnector in one process, for node tests: connectors sharing a FakeRegistry
reach each other by address and copy blocks directly, with failures injected on demand."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kv_transfer.base import KVConnector, ReadResult, check_cache
from kv_transfer.config import TransferConfig
from kv_transfer.errors import LayoutMismatch
from kv_transfer.layout import KVLayout, check_compatible

FAILURES = ("fail", "hang")  # fail: the read fails when it would finish; hang: it never finishes


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
    remote_engine_id: str
    remote_address: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    started_at: float
    num_polls_left: int
    failure: str | None


class FakeConnector(KVConnector):
    """A read finishes on its num_polls_per_read-th poll() (so a test can abort it mid-way),
    copying the holder's blocks and queueing the request id for the holder's poll_released()."""

    backend = "fake"

    def __init__(self, config: TransferConfig, kv_cache: torch.Tensor, layout: KVLayout, engine_id: str,
                 registry: FakeRegistry, clock: Callable[[], float] = time.monotonic,
                 num_polls_per_read: int = 1) -> None:
        check_cache(kv_cache, layout)
        if num_polls_per_read < 1:
            raise ValueError(f"num_polls_per_read must be >= 1, got {num_polls_per_read}")
        self.config, self.kv_cache, self.layout, self.engine_id = config, kv_cache, layout, engine_id
        self._registry, self._clock, self._num_polls_per_read = registry, clock, num_polls_per_read
        self._reads: dict[str, _FakeRead] = {}
        self._failures: dict[str, str] = {}
        self._released: list[str] = []
        self.agent_address = registry.add(self, config.side_channel_port or None)

    def inject(self, request_id: str, failure: str) -> None:
        """Make the read of request_id (started now or later) end as failure (see FAILURES)."""
        if failure not in FAILURES:
            raise ValueError(f"failure must be one of {FAILURES}, got {failure!r}")
        self._failures[request_id] = failure

    def start_read(self, request_id: str, remote_engine_id: str, remote_address: str,
                   remote_block_ids: list[int], local_block_ids: list[int]) -> None:
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError(f"request {request_id}: {len(remote_block_ids)} remote vs "
                             f"{len(local_block_ids)} local blocks")
        if request_id in self._reads:
            raise ValueError(f"request {request_id} already has a read in flight")
        self._reads[request_id] = _FakeRead(request_id, remote_engine_id, remote_address, list(remote_block_ids),
                                            list(local_block_ids), self._clock(), self._num_polls_per_read,
                                            self._failures.pop(request_id, None))

    def poll(self) -> list[ReadResult]:
        results = []
        for read in list(self._reads.values()):
            result = self._advance(read)
            if result is not None:
                del self._reads[read.request_id]
                results.append(result)
        return results

    def abort_read(self, request_id: str) -> None:
        self._reads.pop(request_id, None)

    def release_remote(self, request_id: str, remote_engine_id: str, remote_address: str) -> None:
        holder = self._registry.get(remote_address)
        if holder is not None and holder.engine_id == remote_engine_id:
            holder._released.append(request_id)

    @property
    def num_reads_in_flight(self) -> int:
        return len(self._reads)

    def poll_released(self) -> list[str]:
        released, self._released = self._released, []
        return released

    def close(self) -> None:
        self._reads.clear()
        if self._registry.get(self.agent_address) is self:
            self._registry.remove(self.agent_address)

    def _advance(self, read: _FakeRead) -> ReadResult | None:
        if self._clock() - read.started_at > self.config.transfer_timeout_s:
            return self._failed(read, f"no completion within {self.config.transfer_timeout_s} s")
        read.num_polls_left -= 1
        if read.failure == "hang" or read.num_polls_left > 0:
            return None
        holder = self._registry.get(read.remote_address)
        if holder is None or holder.engine_id != read.remote_engine_id:
            found = "nothing" if holder is None else f"engine {holder.engine_id!r}"
            return self._failed(read, f"handshake failed: {found} at {read.remote_address}, "
                                      f"expected engine {read.remote_engine_id!r}")
        try:
            check_compatible(self.layout, holder.layout)
        except LayoutMismatch as exc:
            return self._failed(read, f"handshake failed: {exc}")
        if read.failure == "fail":
            return self._failed(read, "injected transfer failure")
        self.kv_cache[read.local_block_ids] = holder.kv_cache[read.remote_block_ids].to(self.kv_cache.device)
        holder._released.append(read.request_id)
        return ReadResult(read.request_id, True)

    @staticmethod
    def _failed(read: _FakeRead, error: str) -> ReadResult:
        return ReadResult(read.request_id, False, f"request {read.request_id}: {error}")
