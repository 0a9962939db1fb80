"""Scheduler: continuous batching with chunked prefill and preemption by recompute (FCFS).

Each step gives every running request its next tokens (one for a decode, a chunk of the prompt
for a prefill) under a token budget, then admits waiting requests with what budget is left.
When blocks run out, the most recently admitted running request is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later.

Prefix caching (enable_prefix_caching): a request admitted from the queue first takes the
longest cached prefix of its tokens (whole blocks, never its last token: that one's logits
give the next token) and computes only the rest; once a step has computed a full block, the
block is cached (BlockPool.cache_block). Requests owed prompt logprobs compute every position
and look nothing up (their blocks are still cached for others).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.block_pool import ROOT_ENTRY, BlockPool
from engine.config import SchedulerConfig
from engine.protocol import num_blocks_for, prefix_block_hashes
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


@dataclass
class PrefixCacheStats:
    """Counters since start. query/hit: tokens looked up in the cache and found there, once per
    request (its first admission, or a decode node's pull); reused: tokens taken from the cache
    at every admission (a preempted request's recompute included); computed: prefill tokens run."""

    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    num_reused_tokens: int = 0
    num_computed_prefill_tokens: int = 0

    def count_lookup(self, num_query: int, num_hit: int) -> None:
        self.num_query_tokens += num_query
        self.num_hit_tokens += num_hit


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, block_size: int,
                 enable_prefix_caching: bool = False) -> None:
        self.config = config
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_chunked_prefill_steps = 0
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def has_prompt_work(self) -> bool:
        """Whether a request here still has prompt tokens to compute (queued, mid-prefill, or
        preempted and waiting to be recomputed): the next steps prefill."""
        return bool(self.waiting) or any(True for _ in self._prefilling())

    def _prefilling(self) -> Iterator[Request]:
        """The running requests with more than their next token to compute (mid-prefill)."""
        return (r for r in self.running if r.num_computed_tokens + 1 < r.num_tokens)

    @property
    def num_queued_prompt_tokens(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    @property
    def num_promised_blocks(self) -> int:
        """Blocks accepted requests still need for the tokens they hold (their prompt, plus the
        outputs of a preempted one) and do not have yet: blocks are taken per prefill chunk, so a
        node just handed a prompt reports them free until it schedules it. The proxy counts them
        as taken when it picks the node with the most free KV."""
        return sum(max(0, num_blocks_for(r.num_tokens, self.block_size) - len(r.block_ids))
                   for r in (*self.waiting, *self._prefilling()))

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
        self.prefix_stats.num_computed_prefill_tokens += output.num_prefill_tokens
        return output

    # ---- prefix cache ---------------------------------------------------------------------------

    def acquire_cached_prefix(self, request: Request, max_blocks: int) -> int:
        """Give a request without blocks the longest cached run of its leading blocks (at most
        max_blocks), holding a reference to each; returns how many. 0 when caching is off."""
        assert not request.block_ids, f"request {request.request_id} holds blocks already"
        if not self.enable_prefix_caching or max_blocks <= 0 or request.is_caching_stopped:
            return 0
        self._hash_blocks(request, max_blocks)
        size = self.block_size
        token_blocks = [tuple(request.token_ids_slice(i * size, (i + 1) * size)) for i in range(max_blocks)]
        hit = self.block_pool.match_prefix(request.block_hashes[:max_blocks], token_blocks)
        self.block_pool.acquire(hit.block_ids)
        request.block_ids = list(hit.block_ids)
        request.cache_entries = list(hit.entry_ids)
        return len(hit.block_ids)

    def cache_full_blocks(self, request: Request) -> None:
        """Cache the request's full blocks whose KV is complete (all below num_computed_tokens)
        and not cached yet. Never raises but for a bug."""
        if not self.enable_prefix_caching or request.is_caching_stopped:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if len(request.cache_entries) >= num_full:
            return
        self._hash_blocks(request, num_full)
        size = self.block_size
        parent = request.cache_entries[-1] if request.cache_entries else ROOT_ENTRY
        for idx in range(len(request.cache_entries), num_full):
            tokens = tuple(request.token_ids_slice(idx * size, (idx + 1) * size))
            entry = self.block_pool.cache_block(request.block_ids[idx], request.block_hashes[idx], tokens, parent)
            if entry is None:
                request.is_caching_stopped = True  # a colliding key in use: this request caches no more
                return
            request.cache_entries.append(entry)
            parent = entry

    def _hash_blocks(self, request: Request, num_blocks: int) -> None:
        """Extend request.block_hashes to its first num_blocks full blocks (each key chains the
        previous one's, exactly as protocol.prefix_block_hashes computes them)."""
        size = self.block_size
        hashes = request.block_hashes
        while len(hashes) < num_blocks:
            idx = len(hashes)
            parent = hashes[-1].to_bytes(8, "little") if hashes else b""
            hashes.extend(prefix_block_hashes(request.token_ids_slice(idx * size, (idx + 1) * size), size, parent))

    def _take_cached_prefix(self, request: Request) -> int:
        """On admission from the queue: take the cached prefix; tokens it covers."""
        if request.needs_prompt_logprobs:
            return 0  # every prompt position's logits are owed
        num_blocks = self.acquire_cached_prefix(request, (request.num_tokens - 1) // self.block_size)
        request.num_computed_tokens = num_blocks * self.block_size
        return request.num_computed_tokens

    def _give_back_cached_prefix(self, request: Request) -> None:
        """Undo _take_cached_prefix for a request that could not be admitted after all."""
        self._free_blocks(request)
        request.num_computed_tokens = 0

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

    def reserve_next_token(self, request: Request) -> bool:
        """Make room for a running request's next token (its KV slot); False when the pool is
        out of blocks (schedule() would preempt)."""
        return self._reserve_blocks(request, 1)

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
            num_cached = self._take_cached_prefix(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve_blocks(request, num_new):
                self._give_back_cached_prefix(request)
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            self._count_admission(request, num_cached)
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
        request.cache_entries = []

    def _count_admission(self, request: Request, num_cached: int) -> None:
        if not self.enable_prefix_caching:
            return
        self.prefix_stats.num_reused_tokens += num_cached
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached
            if not request.needs_prompt_logprobs:
                self.prefix_stats.count_lookup(request.num_tokens, num_cached)

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
