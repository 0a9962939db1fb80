"""Cores a prefill node lends to a decode node on the same host while it has nothing to prefill.

`pdserve up` pins each node to cores of its own. At the end of a burst the prefill node runs out of
prompts while the decode node still generates their tokens, on its own cores alone. With lending,
the prefill node keeps one byte in a shared file (tmpfs) saying whether its engine has work, and the
decode node, before each step, runs on its own cores plus the lender's while that byte says idle
(more torch/OpenMP threads, the stepping thread's affinity widened), and on its own again once the
lender has work. The lender's new work waits for at most one decode step, during which both share
its cores.

Only the stepping thread's affinity changes: the node's other threads (heartbeat, health server,
ZMQ) stay on its own cores. OpenMP's extra threads are made while the stepping thread may run on
every core, so they inherit that affinity and sleep while the decode node runs on its own cores.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# The shared byte (a file of one byte that pdserve.launcher makes, "busy" to start with).
_BUSY, _IDLE = 1, 0


class _Flag:
    def __init__(self, path: str | Path) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 1)

    def close(self) -> None:
        self._map.close()


class Lender(_Flag):
    """The prefill node's side: tell() whether its engine has work (written only on a change)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._busy: bool | None = None
        self.tell(True)  # NOTE: a restarted lender warms up first; the last one may have left "idle"

    def tell(self, busy: bool) -> None:
        if busy != self._busy:
            self._map[0] = _BUSY if busy else _IDLE
            self._busy = busy


class Borrower(_Flag):
    """The decode node's side: before each step, take the lender's cores while it is idle."""

    def __init__(self, path: str | Path, cores: set[int]) -> None:
        super().__init__(path)
        self._own = os.sched_getaffinity(0)
        self._all = self._own | cores
        self.is_borrowing = False
        self.num_switches = 0

    def update(self, *, prefilling: bool) -> None:
        """Run on the lender's cores too if it is idle now and the next step has no prompt tokens
        to prefill (prefilling False), on our own if not. Call from the thread that runs the
        engine's steps.

        A prefill step may run for seconds, and a burst that brings this node prompts brings the
        lender its own: its first chunk and ours then shared its core (measured on a 2-core Xeon,
        float32 `small`: our 256-token step took 2.2 s against 0.43 s on our core alone, and the
        lender's 2,048-token chunk 3.7 s against 3.3). A decode step takes tens of milliseconds."""
        borrow = self._map[0] == _IDLE and not prefilling
        if borrow == self.is_borrowing:
            return
        if borrow:
            os.sched_setaffinity(0, self._all)
            torch.set_num_threads(len(self._all))
        else:
            torch.set_num_threads(len(self._own))
            os.sched_setaffinity(0, self._own)
        self.is_borrowing = borrow
        self.num_switches += 1
        logger.debug("%s cores %s", "borrowing" if borrow else "back on", sorted(
            self._all if borrow else self._own))
