"""BlockPool: the free queue and reference counts of the paged KV cache's blocks."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out KV block ids. A block is free when its reference count is zero.

    Reference counts leave room for prefix caching (a block shared by several requests); today
    every allocation holds one reference.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free_ids: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take num_blocks free blocks; None if the pool is short (the caller retries later).
        The caller owns the blocks until it passes them to free()."""
        if num_blocks > len(self._free_ids):
            return None
        block_ids = [self._free_ids.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block with none left returns to the free queue.
        Raises ValueError for a block that is not allocated (a double free is a bug)."""
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks or self._ref_counts[block_id] == 0:
                raise ValueError(f"block {block_id} is not allocated (double free?)")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_ids.append(block_id)
