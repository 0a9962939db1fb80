"""LeaseTable: a prefill node's blocks held for a pull, each until read, released or expired.

A lease has a generation, unique in its table and never reused, so a renewal, confirmation or
release meant for one lease never acts on another of the same request id. Its readers renew it
while they hold the request; it expires lease_timeout_s after its start or last renewal.

A streamed prompt's lease starts while its blocks are still its request's in the engine (not
owns_blocks): it grows as chunks complete, and ending it hands no block back, until grow() with
owns_blocks hands it the finished prompt's blocks.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Lease:
    block_ids: list[int]
    generation: int
    expires_at: float
    owner: object  # whoever the node holds the lease for (its proxy), for release_owned()
    owns_blocks: bool = True  # False: the blocks are still a running request's (a stream's)

    def blocks_handed_back(self) -> list[int]:
        return self.block_ids if self.owns_blocks else []


class LeaseTable:
    """Thread-safe. The node's loop adds, releases and expires leases and frees the blocks
    those calls return; the KV side channel's thread renews leases and ends them for readers
    (end()), whose blocks then wait in pop_ended() for the loop. Blocks returned by any call
    are the caller's to free, exactly once."""

    def __init__(self, lease_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_timeout_s <= 0:
            raise ValueError(f"lease_timeout_s must be > 0, got {lease_timeout_s}")
        self.lease_timeout_s = lease_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._ended: list[tuple[str, list[int]]] = []
        self._generations = itertools.count(1)
        self._on_add: list[Callable[[], None]] = []
        self.num_renewals = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._leases

    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._leases)

    def on_add(self, callback: Callable[[], None]) -> None:
        """Call callback (outside the table's lock; it must not block) after each add()."""
        self._on_add.append(callback)

    def add(self, request_id: str, block_ids: list[int], owner: object = None, owns_blocks: bool = True) -> int:
        """Hold block_ids for request_id; returns the new lease's generation. owns_blocks False:
        they stay their running request's (see the module docstring). Raises ValueError if the
        request holds a lease already."""
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id} already holds a lease")
            generation = next(self._generations)
            self._leases[request_id] = _Lease(list(block_ids), generation, self._clock() + self.lease_timeout_s, owner,
                                              owns_blocks)
        for callback in self._on_add:
            callback()
        return generation

    def grow(self, request_id: str, generation: int, block_ids: list[int], owns_blocks: bool = False) -> bool:
        """Make block_ids (a list the lease's blocks begin) a stream's lease's blocks, as its
        chunks complete; owns_blocks: the lease owns them from now on (the prompt finished). False
        (nothing done) if that lease has ended. Raises ValueError if block_ids does not begin
        with the lease's blocks."""
        with self._lock:
            lease = self._held(request_id, generation)
            if lease is None:
                return False
            if block_ids[:len(lease.block_ids)] != lease.block_ids:
                raise ValueError(f"request {request_id}: the lease's blocks {lease.block_ids[:5]}... do not begin "
                                 f"{list(block_ids[:5])}...")
            lease.block_ids = list(block_ids)
            lease.owns_blocks = lease.owns_blocks or owns_blocks
            return True

    def renew(self, request_id: str, generation: int) -> bool:
        """Push the lease's expiry to lease_timeout_s from now; False (nothing done) if that
        lease has ended."""
        with self._lock:
            lease = self._held(request_id, generation)
            if lease is None:
                return False
            lease.expires_at = self._clock() + self.lease_timeout_s
            self.num_renewals += 1
            return True

    def blocks_of(self, request_id: str, generation: int) -> list[int] | None:
        """The held lease's block ids; None if that lease has ended."""
        with self._lock:
            lease = self._held(request_id, generation)
            return list(lease.block_ids) if lease else None

    def holds(self, request_id: str, generation: int, block_ids: list[int]) -> bool:
        """Whether that lease is held and block_ids are all its blocks (a reader may read only
        part of a lease: the blocks past the prefix it found in its own cache)."""
        with self._lock:
            lease = self._held(request_id, generation)
            return lease is not None and set(block_ids) <= set(lease.block_ids)

    def end(self, request_id: str, generation: int) -> bool:
        """End the lease for its reader (read and confirmed, or given up); its blocks, if it owns
        them, go to pop_ended(). True if that lease was held until now: its blocks were never
        freed."""
        with self._lock:
            if self._held(request_id, generation) is None:
                return False
            lease = self._leases.pop(request_id)
            if lease.owns_blocks:
                self._ended.append((request_id, lease.block_ids))
            return True

    def pop_ended(self) -> list[tuple[str, list[int]]]:
        """(request id, block ids) of the leases end() ended since the last call."""
        with self._lock:
            ended, self._ended = self._ended, []
            return ended

    def release(self, request_id: str, owner: object = None) -> list[int] | None:
        """End a lease whatever its generation (the proxy's release or abort, shutdown): its
        block ids, now the caller's to free ([] where it did not own them); None if there is no
        such lease, or owner is given and the lease is someone else's."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or (owner is not None and lease.owner != owner):
                return None
            return self._leases.pop(request_id).blocks_handed_back()

    def release_owned(self, owner: object) -> list[tuple[str, list[int]]]:
        """End every lease held for owner (a proxy that vanished)."""
        with self._lock:
            ids = [rid for rid, lease in self._leases.items() if lease.owner == owner]
            return [(rid, self._leases.pop(rid).blocks_handed_back()) for rid in ids]

    def pop_expired(self, now: float | None = None) -> list[tuple[str, list[int]]]:
        with self._lock:
            now = self._clock() if now is None else now
            expired = [rid for rid, lease in self._leases.items() if lease.expires_at <= now]
            return [(rid, self._leases.pop(rid).blocks_handed_back()) for rid in expired]

    def _held(self, request_id: str, generation: int) -> _Lease | None:
        lease = self._leases.get(request_id)
        return lease if lease is not None and lease.generation == generation else None
