"""LeaseTable: a prefill node's blocks held for a pull, each until read, released or expired."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Lease:
    block_ids: list[int]
    expires_at: float


class LeaseTable:
    """Not thread-safe: the node's loop owns it. The caller frees the block ids returned."""

    def __init__(self, lease_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_timeout_s <= 0:
            raise ValueError(f"lease_timeout_s must be > 0, got {lease_timeout_s}")
        self.lease_timeout_s = lease_timeout_s
        self._clock = clock
        self._leases: dict[str, _Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def request_ids(self) -> list[str]:
        return list(self._leases)

    def add(self, request_id: str, block_ids: list[int]) -> None:
        if request_id in self._leases:
            raise ValueError(f"request {request_id} already holds a lease")
        self._leases[request_id] = _Lease(list(block_ids), self._clock() + self.lease_timeout_s)

    def release(self, request_id: str) -> list[int] | None:
        """The lease's block ids, now the caller's to free; None if there is no such lease."""
        lease = self._leases.pop(request_id, None)
        return lease.block_ids if lease else None

    def pop_expired(self, now: float | None = None) -> list[tuple[str, list[int]]]:
        now = self._clock() if now is None else now
        expired = [rid for rid, lease in self._leases.items() if lease.expires_at <= now]
        return [(rid, self._leases.pop(rid).block_ids) for rid in expired]
