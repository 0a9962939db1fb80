"""Cores a prefill node lends to a decode node on the same host while it has nothing to prefill.

`pdserve up` pins each node to cores of its own. At the end of a burst the prefill node runs out of
prompts while the decode node still generates their tokens, on its own cores alone. With lending,
the prefill node keeps one byte in a shared file (tmpfs) saying whether its engine has work, and the
decode node, before each step, runs on its own cores plus the lender's while that byte says idle
(more torch/OpenMP threads, the stepping thread's affinity widened), and on its own again once the
lender has work. The lender's new work waits for at most one decode step, during which both share
its cores.

Lending only helps while nothing else runs on the lender's cores. A decode step's threads meet at
every op's barrier, so a step waits for its slowest thread: with n own cores and m lent ones whose
threads get a fraction f of their cores, it takes 1/((n+m)f) of its work's time against 1/n on its
own cores (with a busy loop on the lent core, SmolLM2's decode step took 2.5x its time on the decode
node's own core). Borrowing pays where (n+m)f/n is at least _MIN_GAIN (lent_share_needed). So the
borrower measures, and borrows only while
- the lender's cores were idle enough (another process busy at most 1 - lent_share_needed of their
  time in /proc/stat) over the last window of at least _WINDOW_S in which the lender said idle and
  this node was off them, and
- its borrowed steps got their cores: over each span of borrowed steps of at least _JUDGE_SPAN_S,
  the process CPU time over (wall time x threads) is at least min_cpu_share (the own cores'
  threads run or wait spinning throughout, the lent ones get f). A span under it sends the
  borrower back to its own cores for a back-off that doubles on each such span (from _BACKOFF_S
  to _MAX_BACKOFF_S).

Only the stepping thread's affinity changes: the node's other threads (heartbeat, health server,
ZMQ) stay on its own cores. OpenMP's extra threads are made while the stepping thread may run on
every core, so they inherit that affinity and sleep while the decode node runs on its own cores.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from engine.cpu_quota import read_core_times

logger = logging.getLogger(__name__)

# The shared file (pdserve.cores makes it: one byte, "busy"; each side extends it to _FLAG_SIZE):
# byte 0 says whether the lender is busy, bytes 8-15 hold its process id (little-endian; 0: none
# yet), which the borrower reads to tell the lender's own CPU time on its cores from another's.
_BUSY, _IDLE = 1, 0
_FLAG_SIZE = 16
_PID = slice(8, 16)

# Borrowing must promise this speed-up over the own cores: the model above is optimistic (measured on
# a 2-core Xeon, float32 `small` at batch 32, one own and one lent core, a duty-cycled load on the
# lent one: break-even at a CPU share of 0.78, where the model with 1.1 asks 0.775).
_MIN_GAIN = 1.1
# Borrowed steps are judged together over at least this long: one step's share swings with a
# proxy's burst of replies.
_JUDGE_SPAN_S = 0.4
# /proc/stat counts in ticks of 10 ms: a window of 0.2 s gives each core 20 of them.
_WINDOW_S = 0.2
# A window's verdict stands this long (across the lender's busy spells, when no window can be read).
_VERDICT_TTL_S = 5.0
_BACKOFF_S, _MAX_BACKOFF_S = 1.0, 30.0
_LOG_EVERY_S = 60.0  # the cores' verdict changes at INFO at most this often (DEBUG otherwise)


def lent_share_needed(own: int, lent: int) -> float:
    """The fraction of its core each thread on a lent core must get for a borrowed step to run
    _MIN_GAIN times as fast as on the own cores alone (the module's model)."""
    return min(1.0, _MIN_GAIN * own / (own + lent))


def min_cpu_share(own: int, lent: int) -> float:
    """The process CPU share (CPU time over wall time x threads) of borrowed steps that got
    lent_share_needed of the lent cores."""
    return (own + lent * lent_share_needed(own, lent)) / (own + lent)


class _Flag:
    def __init__(self, path: str | Path) -> None:
        with open(path, "r+b") as f:
            if os.fstat(f.fileno()).st_size < _FLAG_SIZE:
                os.ftruncate(f.fileno(), _FLAG_SIZE)  # zeros past the end: the bytes written stay
            self._map = mmap.mmap(f.fileno(), _FLAG_SIZE)

    def close(self) -> None:
        self._map.close()


class Lender(_Flag):
    """The prefill node's side: tell() whether its engine has work (written only on a change)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._busy: bool | None = None
        self._map[_PID] = os.getpid().to_bytes(8, "little")
        self.tell(True)  # NOTE: a restarted lender warms up first; the last one may have left "idle"

    def tell(self, busy: bool) -> None:
        if busy != self._busy:
            self._map[0] = _BUSY if busy else _IDLE
            self._busy = busy


class Borrower(_Flag):
    """The decode node's side: before each step (update), take the lender's cores while it is idle
    and they are free, and run each step inside step() so that it can judge the borrowed ones."""

    def __init__(self, path: str | Path, cores: set[int], *, clock: Callable[[], float] = time.monotonic,
                 core_times: Callable[[set[int], int], tuple[int, int] | None] = read_core_times,
                 cpu_time: Callable[[], float] = time.process_time) -> None:
        super().__init__(path)
        self._own = os.sched_getaffinity(0)
        self._lent = set(cores) - self._own
        self._all = self._own | self._lent
        self._clock, self._core_times, self._cpu_time = clock, core_times, cpu_time
        self._window: tuple[float, int, tuple[int, int]] | None = None  # (when, lender, core times) at its start
        self._free_at: float | None = None  # when a window last found the lender's cores free
        self._reported_busy = False
        self._logged_at = -_LOG_EVERY_S
        # The borrowed steps not yet judged (wall and CPU time, count); None until the first after a
        # switch has run (not judged: its extra threads wake up, or are made, during it).
        self._span: tuple[float, float, int] | None = None
        self._min_cpu_share = min_cpu_share(len(self._own), len(self._lent))
        self._max_foreign_busy = 1.0 - lent_share_needed(len(self._own), len(self._lent))
        self._off_until = 0.0
        self._backoff_s = _BACKOFF_S
        self.is_borrowing = False
        self.cores_free = False  # as the last window found them (see update)
        self.num_switches = 0
        self.num_preempted_steps = 0

    def update(self, *, prefilling: bool, has_work: bool = True) -> None:
        """Run on the lender's cores too if it is idle now, its cores are free (see the module), this
        node has work (has_work) and its next step has no prompt tokens to prefill (prefilling
        False); on our own if not. Call from the thread that runs the engine's steps, before each
        step and while idle (the lender's cores are watched meanwhile).

        A prefill step may run for seconds, and a burst that brings this node prompts brings the
        lender its own: its first chunk and ours then shared its core (measured on a 2-core Xeon,
        float32 `small`: our 256-token step took 2.2 s against 0.43 s on our core alone, and the
        lender's 2,048-token chunk 3.7 s against 3.3). A decode step takes tens of milliseconds."""
        now = self._clock()
        lender_idle = self._map[0] == _IDLE
        if lender_idle and not self.is_borrowing:
            self._watch(now)
        else:
            self._window = None  # the lender's own work or ours is on its cores: no window to read
        self.cores_free = self._free_at is not None and now - self._free_at <= _VERDICT_TTL_S
        borrow = (lender_idle and has_work and not prefilling and now >= self._off_until
                  and (self.is_borrowing or self.cores_free))
        if borrow != self.is_borrowing:
            self._switch(borrow)
            self._span = None

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one engine step: borrowed steps that did not get their cores (another process
        preempted a thread) end borrowing for a back-off."""
        if not self.is_borrowing:
            yield
            return
        wall, cpu = self._clock(), self._cpu_time()
        yield
        wall, cpu = self._clock() - wall, self._cpu_time() - cpu
        if self._span is None:
            self._span = (0.0, 0.0, 0)
            return
        wall, cpu, steps = self._span[0] + wall, self._span[1] + cpu, self._span[2] + 1
        if wall < _JUDGE_SPAN_S:
            self._span = (wall, cpu, steps)
            return
        self._span = (0.0, 0.0, 0)
        share = cpu / (wall * len(self._all))
        if share >= self._min_cpu_share:  # the cores were ours: as good as a free window
            self._backoff_s = _BACKOFF_S
            self._free_at = self._clock()
            return
        self.num_preempted_steps += steps
        logger.info("steps on cores %s got %.0f%% of them over %.1f s (another process runs there; borrowing "
                    "pays from %.0f%%): back on cores %s for %.0f s", sorted(self._all), 100 * share, wall,
                    100 * self._min_cpu_share, sorted(self._own), self._backoff_s)
        self._off_until = self._clock() + self._backoff_s
        self._backoff_s = min(2 * self._backoff_s, _MAX_BACKOFF_S)
        self._free_at = None
        self._switch(False)

    def _watch(self, now: float) -> None:
        """Read the lender's cores' busy share over windows of at least _WINDOW_S."""
        lender = int.from_bytes(self._map[_PID], "little")
        if self._window is None or self._window[1] != lender:  # none yet, or the lender restarted
            times = self._core_times(self._lent, lender)
            if times is None:  # no /proc/stat: judge by the steps alone
                self._window, self._free_at = None, now
            else:
                self._window = (now, lender, times)
            return
        started, _, (busy0, total0) = self._window
        if now - started < _WINDOW_S:
            return
        times = self._core_times(self._lent, lender)
        if times is None:
            self._window, self._free_at = None, now
            return
        busy, total = times[0] - busy0, times[1] - total0
        share = busy / total if total > 0 else 0.0
        free = share <= self._max_foreign_busy
        self._free_at = now if free else None
        if free == self._reported_busy:
            self._reported_busy = not free
            level = logging.INFO if now - self._logged_at >= _LOG_EVERY_S else logging.DEBUG
            self._logged_at = now if level == logging.INFO else self._logged_at
            logger.log(level, "cores %s were %.0f%% busy over %.1f s while their prefill node was idle: %s",
                       sorted(self._lent), 100 * share, now - started,
                       "borrowing them while it is idle" if free else "not borrowing them")
        self._window = (now, lender, times)

    def _switch(self, borrow: bool) -> None:
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
