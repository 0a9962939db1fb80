"""Scheduler: continuous batching with chunked prefill and preemption by recompute (FCFS).

Each step gives every running request its next tokens (one for a decode, a chunk of the prompt
for a prefill) under a token budget, then admits waiting requests with what budget is left.
When blocks run out, the most recently admitted running request is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_pool import BlockPool
from engine.config import SchedulerConfig
from engine.protocol import num_blocks_for
from engine.request import FinishReason, Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What runs in one step: (request, number of new tokens) pairs, decodes first."""

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + self.num_prefill_tokens

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    def scheduled(self) -> list[tuple[Request, int]]:
        return [(r, 1) for r in self.decodes] + self.prefills


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, block_size: int) -> None:
        self.config = config
        self.block_pool = block_pool
        self.block_size = block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_chunked_prefill_steps = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_queued_prompt_tokens(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    def add_waiting(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Join a request whose KV is already in its blocks (decode role after a pull)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        if output.num_preemptions == 0:
            self._schedule_waiting(output, budget)
        self._count_chunks(output)
        return output

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Take the request out of the queues and free its blocks, except for PREFILLED, where
        the caller takes over request.block_ids (the prefill node's lease)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if reason is not FinishReason.PREFILLED:
            self._free_blocks(request)

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve_or_preempt(request, num_new, output):
                break  # request itself was preempted, and so was everything after it
            self._add_to_output(output, request, num_new)
            budget -= num_new
            idx += 1
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve_blocks(request, num_new):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_to_output(output, request, num_new)
            budget -= num_new

    def _reserve_or_preempt(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        while not self._reserve_blocks(request, num_new):
            victim = self.running.pop()  # the latest admitted; never one scheduled this step
            self._preempt(victim)
            output.num_preemptions += 1
            if victim is request:
                return False
        return True

    def _reserve_blocks(self, request: Request, num_new: int) -> bool:
        num_needed = num_blocks_for(request.num_computed_tokens + num_new, self.block_size)
        num_missing = num_needed - len(request.block_ids)
        if num_missing <= 0:
            return True
        block_ids = self.block_pool.allocate(num_missing)
        if block_ids is None:
            return False
        request.block_ids.extend(block_ids)
        return True

    def _preempt(self, request: Request) -> None:
        self._free_blocks(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _free_blocks(self, request: Request) -> None:
        if request.block_ids:
            self.block_pool.free(request.block_ids)
            request.block_ids = []

    @staticmethod
    def _add_to_output(output: SchedulerOutput, request: Request, num_new: int) -> None:
        is_decode = num_new == 1 and request.num_computed_tokens + 1 == request.num_tokens
        if is_decode:
            output.decodes.append(request)
        else:
            output.prefills.append((request, num_new))

    def _count_chunks(self, output: SchedulerOutput) -> None:
        for request, num_new in output.prefills:
            if request.num_computed_tokens + num_new < request.num_tokens:
                self.num_chunked_prefill_steps += 1
