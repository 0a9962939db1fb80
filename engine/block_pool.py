"""BlockPool: the paged KV cache's blocks: free queues, reference counts and the prefix cache.

A block is in use while its reference count is above zero. A full block whose KV was computed
(or pulled) can be cached under its prefix key (protocol.prefix_block_hashes): later requests
with the same prefix take a reference to it instead of computing it again. A cached block whose
count drops to zero stays cached and allocatable: allocate() takes never-cached free blocks
first, then evicts cached ones least recently used first. A block with references (a running
request, a prefill node's lease, a decode node's pull) is never evicted, and a cached block is
never written: requests write only past the blocks they share.

Hash collisions: the 64-bit key finds a candidate; it is used only if its tokens equal the
request's block and its parent entry is the entry the request matched for the previous block,
so a hit means the whole token prefix is equal (by induction), never just the keys. Entry ids
are unique per registration, so a parent evicted and its id reused never passes for the old one.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass

ROOT_ENTRY = 0  # the parent of every prompt's first block


@dataclass(frozen=True)
class CacheEntry:
    block_hash: int
    tokens: tuple[int, ...]
    parent: int  # entry_id of the previous block's entry; ROOT_ENTRY for a first block
    entry_id: int


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks matching a prefix, in order, and the entry each stands for."""

    block_ids: list[int]
    entry_ids: list[int]


class BlockPool:
    """Hands out KV block ids and keeps the prefix cache (see the module docstring)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free_ids: deque[int] = deque(range(num_blocks))  # free and not cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free and cached: LRU first
        self._ref_counts = [0] * num_blocks
        self._entries: dict[int, CacheEntry] = {}  # block id -> its cache entry
        self._block_of_hash: dict[int, int] = {}
        self._entry_ids = itertools.count(ROOT_ENTRY + 1)
        self.cache_version = 0  # grows whenever the set of cached keys changes
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocate() can hand out: never-cached free ones and cached ones nobody uses."""
        return len(self._free_ids) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._entries)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._entries

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take num_blocks free blocks, evicting least recently used cached ones once the
        never-cached ones run out; None if the pool is short (the caller retries later). The
        caller owns one reference to each until it passes them to free()."""
        if num_blocks > self.num_free_blocks:
            return None
        block_ids = []
        for _ in range(num_blocks):
            if self._free_ids:
                block_id = self._free_ids.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._uncache(block_id)
                self.num_evictions += 1
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block. A block with none left becomes free: cached ones
        stay cached (most recently used; a request's last blocks go first, as its prefix is the
        likelier to be shared). Raises ValueError for a block that is not allocated (a double
        free is a bug)."""
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks or self._ref_counts[block_id] == 0:
                raise ValueError(f"block {block_id} is not allocated (double free?)")
        for block_id in reversed(block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] > 0:
                continue
            if block_id in self._entries:
                self._evictable[block_id] = None
            else:
                self._free_ids.append(block_id)

    def match_prefix(self, block_hashes: list[int], token_blocks: list[tuple[int, ...]]) -> PrefixHit:
        """The longest run of cached blocks equal to the prefix whose keys and tokens are given
        (block i: block_hashes[i], token_blocks[i]). Takes no reference (see acquire())."""
        block_ids, entry_ids = [], []
        parent = ROOT_ENTRY
        for block_hash, tokens in zip(block_hashes, token_blocks):
            block_id = self._block_of_hash.get(block_hash)
            if block_id is None:
                break
            entry = self._entries[block_id]
            if entry.tokens != tokens or entry.parent != parent:
                break  # a 64-bit collision, or a child of an evicted parent: a miss
            block_ids.append(block_id)
            entry_ids.append(entry.entry_id)
            parent = entry.entry_id
        return PrefixHit(block_ids, entry_ids)

    def acquire(self, block_ids: list[int]) -> None:
        """Take a reference to each cached block (a prefix hit): it is in use, not evictable."""
        for block_id in block_ids:
            if block_id not in self._entries:
                raise ValueError(f"block {block_id} is not cached")
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def cache_block(self, block_id: int, block_hash: int, tokens: tuple[int, ...], parent: int) -> int | None:
        """Register an in-use full block, whose KV is complete, under block_hash. Returns the
        entry the block's content now stands for: its own, or an equal block's already cached
        (block_id then stays uncached: one copy per prefix); None if another prefix holds the
        key and is in use (a collision: the caller stops caching this request)."""
        entry = self._entries.get(block_id)
        if entry is not None:
            return entry.entry_id if (entry.block_hash, entry.tokens, entry.parent) == (block_hash, tokens, parent) \
                else None
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is not allocated")
        holder = self._block_of_hash.get(block_hash)
        if holder is not None:
            existing = self._entries[holder]
            if existing.tokens == tokens and existing.parent == parent:
                return existing.entry_id
            if self._ref_counts[holder] > 0:
                return None
            del self._evictable[holder]  # stale (its parent was evicted) or colliding, unused: replaced
            self._uncache(holder)
            self._free_ids.append(holder)
        entry = CacheEntry(block_hash, tokens, parent, next(self._entry_ids))
        self._entries[block_id] = entry
        self._block_of_hash[block_hash] = block_id
        self.cache_version += 1
        return entry.entry_id

    def cached_hashes(self, limit: int) -> list[int]:
        """Keys of the cached blocks, most recently used first: blocks in use, then the free
        ones from the most recently freed; at most limit."""
        in_use = [e.block_hash for b, e in self._entries.items() if self._ref_counts[b] > 0]
        hashes = in_use[:limit]
        for block_id in reversed(self._evictable):
            if len(hashes) >= limit:
                break
            hashes.append(self._entries[block_id].block_hash)
        return hashes

    def reset_cache(self) -> int:
        """Forget every cached block nobody uses (they become plain free blocks); returns how
        many. Blocks in use stay cached."""
        num = len(self._evictable)
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._uncache(block_id)
            self._free_ids.append(block_id)
        return num

    def check_consistent(self) -> None:
        """Assert the pool's invariants (tests call it): every block is exactly one of in use,
        free, or cached-free; the hash index matches the entries."""
        free = set(self._free_ids)
        evictable = set(self._evictable)
        assert len(free) == len(self._free_ids) and not free & evictable, "a block is free twice"
        for block_id in range(self.num_blocks):
            in_use = self._ref_counts[block_id] > 0
            assert self._ref_counts[block_id] >= 0
            assert in_use + (block_id in free) + (block_id in evictable) == 1, f"block {block_id} state"
            assert (block_id in evictable) <= (block_id in self._entries), f"block {block_id} evictable uncached"
            assert (block_id in free) <= (block_id not in self._entries), f"block {block_id} free but cached"
        assert {self._block_of_hash[e.block_hash] for e in self._entries.values()} == set(self._entries)

    def _uncache(self, block_id: int) -> None:
        entry = self._entries.pop(block_id)
        del self._block_of_hash[entry.block_hash]
        self.cache_version += 1
