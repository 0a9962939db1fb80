"""The CPU ranks' small collectives through shared memory: a decode step's sums are a few KB each,
and gloo takes milliseconds for one over loopback TCP (2.3 ms measured for 2 KB on a 2-core EPYC
VM whose TCP round trip is 32 us: benchmarks/tensor_parallel.py), sixty times a step for a
30-layer model. Each rank writes its part into its slot of a file on /dev/shm every rank maps,
then bumps its step counter; the others wait for every counter to reach the step and read.

Ordering: the counter is stored after the data, by the same thread, and x86-64 keeps stores in
order (and loads in order): whoever sees the counter sees the data. Two buffers alternate by
step, and a rank reaches step s + 2 only after every rank read step s (it waited for them at s + 1),
so a slot is never written while another rank reads it. Tensors past the slot go to gloo."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

# NOTE: a decode step's sums (rows x hidden x 4 bytes) fit up to 256 rows of a 4,096-wide model;
# prefill chunks, larger and compute-bound, take gloo.
SLOT_BYTES = 4 << 20
_COUNTER_STRIDE = 8  # int64s per rank's counter (64 bytes: no two counters share a cache line)
_SPIN_S = 50e-6  # busy-wait this long before yielding the core
_CHECK_PEERS_S = 0.05


def channel_bytes(size: int, slot_bytes: int = SLOT_BYTES) -> int:
    return size * _COUNTER_STRIDE * 8 + 2 * size * slot_bytes


class ShmChannel:
    """Rank rank's view of the group's channel in file path (made by rank 0, mapped by all).
    peers_alive: called while waiting; False ends the wait with peer_gone (a rank died)."""

    def __init__(self, path: str, rank: int, size: int, peers_alive: Callable[[], bool],
                 timeout_s: float, slot_bytes: int = SLOT_BYTES) -> None:
        memory = torch.from_file(path, shared=True, size=channel_bytes(size, slot_bytes), dtype=torch.uint8)
        header = size * _COUNTER_STRIDE * 8
        self._counters = memory[:header].view(torch.int64).numpy()
        self._slots = memory[header:].view(2, size, slot_bytes)
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self._peers_alive, self._timeout_s = peers_alive, timeout_s
        self._step = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes and x.device.type == "cpu"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks in place (every rank adds the parts in rank order: the same
        bits everywhere). Needs fits(x) on every rank. Raises TimeoutError or ChildProcessError."""
        parts = self._post(x)
        self._wait_for(range(self.size))
        x.copy_(parts[0])
        for part in parts[1:]:
            x.add_(part)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x (equal shapes) side by side along the last dimension, in rank order, on
        rank 0; None on the others, who wait until rank 0 has read them."""
        if self.rank != 0:
            self._post(x)
            self._wait_for([0])
            return None
        self._step += 1
        parts = self._views(x)
        parts[0].copy_(x)
        self._wait_for(range(1, self.size))
        gathered = torch.cat(parts, dim=-1)  # NOTE: the one copy out, before the others may write again
        self._counters[0] = self._step  # NOTE: after the reads: the others may write this buffer again
        return gathered

    def _post(self, x: torch.Tensor) -> list[torch.Tensor]:
        self._step += 1
        parts = self._views(x)
        parts[self.rank].copy_(x)
        self._counters[self.rank * _COUNTER_STRIDE] = self._step
        return parts

    def _views(self, x: torch.Tensor) -> list[torch.Tensor]:
        nbytes = x.numel() * x.element_size()
        buffer = self._slots[self._step % 2]
        return [buffer[r, :nbytes].view(x.dtype).view(x.shape) for r in range(self.size)]

    def _wait_for(self, ranks) -> None:
        step, counters = self._step, self._counters
        pending = [r * _COUNTER_STRIDE for r in ranks]
        started = time.monotonic()
        checked = started
        while True:
            pending = [i for i in pending if counters[i] < step]
            if not pending:
                return
            now = time.monotonic()
            if now - started > _SPIN_S:
                os.sched_yield()
            if now - checked > _CHECK_PEERS_S:
                checked = now
                if not self._peers_alive():
                    raise ChildProcessError("a tensor-parallel rank is gone")
                if now - started > self._timeout_s:
                    raise TimeoutError(f"tensor-parallel ranks {[i // _COUNTER_STRIDE for i in pending]} did not "
                                       f"reach step {step} in {self._timeout_s:.0f} s")


def create_channel_file(path: str, size: int, slot_bytes: int = SLOT_BYTES) -> None:
    """Make the zeroed channel file (rank 0, before the others map it)."""
    torch.from_file(path, shared=True, size=channel_bytes(size, slot_bytes), dtype=torch.uint8)
