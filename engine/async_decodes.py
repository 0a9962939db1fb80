"""Async scheduling's bookkeeping: which steps are launched without waiting, the launched step's
places in its requests' outputs, and whether the step after it can be launched before it is read."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from engine.decode_graphs import DecodeGraphs, PendingTokens
from engine.request import Request
from engine.sampler import Sampler, samples_on_device
from engine.scheduler import Scheduler, SchedulerOutput

# An output token whose step is still running: its place in output_token_ids.
PENDING_TOKEN = -1


@dataclass
class InFlight:
    """A launched decode step whose tokens are not read yet: each request's token goes to
    output_token_ids[index] (a PENDING_TOKEN until then). late_blocks: blocks of its requests
    that ended (and were freed) after it was launched; it still writes one KV slot in them."""

    decodes: list[Request]
    indices: list[int]
    pending: PendingTokens
    late_blocks: set[int] = field(default_factory=set)


class AsyncDecodes:
    """Launches pure decode steps of requests that sample on the device (greedy or random draws,
    sampler.samples_on_device) on the static decode path (graphs) and says when the next one may
    follow before the one in flight is read."""

    def __init__(self, graphs: DecodeGraphs | None, scheduler: Scheduler, sampler: Sampler, enabled: bool) -> None:
        self.graphs = graphs
        self.scheduler = scheduler
        self.sampler = sampler
        self.enabled = enabled and graphs is not None

    def takes(self, scheduled: SchedulerOutput) -> bool:
        """Whether this scheduled step is launched without waiting for it."""
        return (self.enabled and self.graphs.takes(scheduled.decodes, len(scheduled.prefills))
                and all(samples_on_device(r) for r in scheduled.decodes))

    def launch(self, decodes: list[Request], previous: InFlight | None) -> InFlight:
        """Queue these decodes' step; then (nothing raises after) their progress moves on and a
        PENDING_TOKEN holds each one's place. With previous, each request of previous takes its
        input, its pending token, from previous on the device; one that joined since (decodes_again)
        has its input on the host."""
        fed = None
        if previous is not None:
            rows = {id(r): row for row, r in enumerate(previous.decodes)}
            fed = [rows.get(id(r), -1) for r in decodes]
        # NOTE: draw runs inside launch, before the bookkeeping below: a seeded draw's index is the token's
        draw = partial(self.sampler.draw, requests=decodes)
        pending = self.graphs.launch(decodes, fed, previous.pending if previous else None, draw)
        indices = []
        for request in decodes:
            request.num_computed_tokens += 1
            indices.append(request.num_output_tokens)
            request.output_token_ids.append(PENDING_TOKEN)
        return InFlight(decodes, indices, pending)

    def decodes_again(self, live: list[Request]) -> list[Request] | None:
        """The next step's decodes, where the next schedule() could only be one more decode of
        each running request: live (the step in flight's, none ending on a length limit in it),
        then those that joined the running since (a decode node's pulled requests: their KV in
        place, their next token the only one left to compute); takes their next slots. None where
        schedule() could give anything else (a prompt to admit, a prefill chunk, a request that
        does not sample on the device)."""
        scheduler = self.scheduler
        if scheduler.waiting and len(scheduler.running) < scheduler.config.max_num_seqs:
            return None  # it would admit a prompt
        live_ids = {id(r) for r in live}
        joined = [r for r in scheduler.running if id(r) not in live_ids]
        if len(live) + len(joined) != len(scheduler.running):
            return None  # one of live left the running (a bug elsewhere: nothing preempts between steps)
        if len(scheduler.running) > min(self.graphs.max_size, scheduler.config.max_num_batched_tokens):
            # the graphs' or the step's token budget (schedule() would decode only the first ones; those
            # left out of the step in flight are "joined" here)
            return None
        if any(r.num_computed_tokens != r.num_tokens - 1 for r in joined):
            return None
        decodes = [*live, *joined]
        for request in decodes:
            if (request.num_output_tokens >= request.params.max_tokens or request.num_tokens >= request.max_total_tokens
                    or not samples_on_device(request)):
                return None
        return decodes if all(scheduler.reserve_next_token(r) for r in decodes) else None
