"""Overload control: which requests the proxy takes on. Nothing waits in the proxy: a request is
refused at once with a 429 and Retry-After when the proxy already holds max_num_requests
choices, or its client max_client_requests, when every node that could take it is full, when its
estimated queue wait passes max_queue_wait_s, or when its predicted time to first token misses
the TTFT target."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

from engine import protocol
from proxy.choices import ChoiceState
from proxy.clients import ClientCounts
from proxy.errors import ApiError, rate_limited
from proxy.metrics import ProxyMetrics
from proxy.node_client import NodeClient
from proxy.nodes import NodePool
from proxy.routing import decode_held, decode_slots

logger = logging.getLogger(__name__)

# Longest Retry-After given: past it an estimate says little more than "much later".
MAX_RETRY_AFTER_S = 60
# Finishes the drain rate is measured over, and how old one may be before it no longer counts.
_RATE_WINDOW = 32
_RATE_MAX_AGE_S = 60.0
_RATE_MIN_FINISHES = 3  # fewer: no rate yet (a wait is then not estimated)


@dataclass(frozen=True)
class AdmissionLimits:
    """max_num_requests: choices in the proxy at once (each choice is one request on the nodes;
    /tokenize and /detokenize hold one while they run). max_queue_wait_s: the longest estimated
    wait accepted, None: not checked. slo_ttft_s: the TTFT target, None: not checked.
    max_node_waiting: requests queued on a node that make it full, None: only its KV blocks.
    max_client_requests: choices one client (proxy.clients.client_id) may hold, None: no cap."""

    max_num_requests: int
    max_queue_wait_s: float | None = None
    slo_ttft_s: float | None = None
    max_node_waiting: int | None = None
    max_client_requests: int | None = None


@dataclass(frozen=True)
class WaitEstimate:
    """queue_s: until the request's own prefill can start (the longer of the prefill queue and
    the wait for a decode slot); prefill_s: its own prefill; ttft_s: until its first token.
    Parts that cannot be estimated yet (no measured rate) count as 0."""

    queue_s: float
    prefill_s: float
    ttft_s: float
    decode_queue_s: float  # the wait for a decode slot alone


class DrainRate:
    """Choices finished per second, over the last _RATE_WINDOW finishes within _RATE_MAX_AGE_S.
    While requests queue, it is the rate at which slots free up (Little's law)."""

    def __init__(self) -> None:
        self._finished_at: deque[float] = deque(maxlen=_RATE_WINDOW)

    def record(self, now: float) -> None:
        self._finished_at.append(now)

    def per_s(self, now: float) -> float | None:
        """None until _RATE_MIN_FINISHES recent finishes; falls while none come (a stuck node)."""
        while self._finished_at and now - self._finished_at[0] > _RATE_MAX_AGE_S:
            self._finished_at.popleft()
        if len(self._finished_at) < _RATE_MIN_FINISHES:
            return None
        return (len(self._finished_at) - 1) / max(now - self._finished_at[0], 1e-3)


class Ticket:
    """One request's hold on the proxy: num_slots choices of max_num_requests, counted to its
    client too. attach() hands the slots to the running choices (each frees its own when it
    ends); release() frees the slots not handed over, and is safe to call any number of times."""

    def __init__(self, admission: Admission, client: str) -> None:
        self._admission = admission
        self.client = client
        self.num_slots = 1

    def resize(self, num_choices: int) -> None:
        """Hold num_choices slots instead; raises ApiError 429 past a limit (the ticket keeps
        its slots), 400 when no number of free slots could ever hold the request."""
        self._admission.take(num_choices - self.num_slots, num_choices, self.client)
        self.num_slots = num_choices

    def attach(self, tasks: list[asyncio.Task], states: dict[int, ChoiceState]) -> None:
        """Each task (one choice, its state at the same position of states' values) frees its slot
        when it ends, and counts toward the drain rate if the choice finished."""
        for task, state in zip(tasks, states.values()):
            task.add_done_callback(lambda _t, s=state: self._admission.free(1, s.finish_reason is not None,
                                                                            self.client))
        self.num_slots -= min(len(tasks), len(states))
        self.release()

    def release(self) -> None:
        if self.num_slots:
            self._admission.free(self.num_slots, False, self.client)
            self.num_slots = 0


class Admission:
    """Counts the choices in flight and decides, from the nodes' load reports and what this
    proxy has sent since, whether a new request can be served in time."""

    def __init__(self, limits: AdmissionLimits, pool: NodePool, metrics: ProxyMetrics) -> None:
        self.limits = limits
        self.pool = pool
        self.metrics = metrics
        self.num_in_flight = 0
        self.clients = ClientCounts(limits.max_client_requests)  # slots per client
        self.is_draining = False  # the proxy is shutting down (proxy.drain): new requests get 503
        self.drain = DrainRate()
        # Per decode node (by address): requests it ran while others queued, its capacity as last
        # seen (max_num_seqs, or fewer when KV blocks ran short); see _slots.
        self.num_slots: dict[str, int] = {}
        pool.is_full = lambda node: is_full(node, limits.max_node_waiting)  # routing passes over full nodes

    def precheck(self, client: str) -> None:
        """Raises what enter(client) would raise now, holding nothing: a request refused anyway
        is refused before its body is read."""
        self._check_open()
        self._check_room(1, client)

    def enter(self, client: str) -> Ticket:
        """A ticket for one slot, taken once the request's body has arrived (a stalled upload
        holds none); raises ApiError 429 when the proxy or the client is full, 503 while the
        proxy drains."""
        self._check_open()
        self.take(1, 1, client)
        return Ticket(self, client)

    def take(self, num_more: int, num_choices: int, client: str) -> None:
        """Raises ApiError: 400 if num_choices exceeds max_num_requests or max_client_requests,
        429 if num_more more slots do not fit now."""
        for name, limit in (("max_num_requests", self.limits.max_num_requests),
                            ("max_client_requests", self.limits.max_client_requests)):
            if limit is not None and num_choices > limit:
                raise ApiError(400, f"the request asks for {num_choices} choices; this server runs at most {limit} "
                                    f"at once ({name})", "n")
        if num_more > 0:
            self._check_room(num_more, client)
        self.num_in_flight += num_more
        self.clients.take(client, num_more)

    def free(self, num_slots: int, is_finished: bool, client: str) -> None:
        self.num_in_flight -= num_slots
        assert self.num_in_flight >= 0, f"freed more slots than taken ({self.num_in_flight})"
        self.clients.free(client, num_slots)
        if is_finished:
            self.drain.record(time.monotonic())

    def _check_open(self) -> None:
        if self.is_draining:
            raise ApiError(503, "the server is shutting down; send this request to another replica",
                           kind="server_error", code="shutting_down")

    def _check_room(self, num_more: int, client: str) -> None:
        """Raises ApiError 429 unless num_more more slots fit, in all and for client."""
        limit = self.limits.max_num_requests
        if self.num_in_flight + num_more > limit:
            retry_s = self._slot_wait_s(self.num_in_flight + num_more - limit)
            raise self._reject("max_num_requests", f"the server is at its limit of {limit} requests in flight; "
                               "retry later", retry_s)
        if not self.clients.can_take(client, num_more):
            raise self._reject("max_client_requests", f"this client has {self.clients.held(client)} requests in "
                               f"flight; the limit per client is {self.clients.limit} (max_client_requests); "
                               "retry later", None)

    def check(self, prompt_lens: list[int]) -> None:
        """Raises ApiError 429 if every node that could serve the request is full, if its
        estimated wait passes max_queue_wait_s, or if its predicted TTFT misses the target.
        prompt_lens: its choices' prompt lengths in tokens."""
        full = self._all_full()
        if full is not None:
            raise self._reject("nodes_full", f"every {full} node is full; retry later",
                               self._slot_wait_s(1) or 1.0)
        limits = self.limits
        if limits.max_queue_wait_s is None and limits.slo_ttft_s is None:
            return
        wait = self.estimate(max(prompt_lens, default=0))
        logger.debug("estimated wait: queue %.3f s (decode slots %.3f s), prefill %.3f s, TTFT %.3f s",
                     wait.queue_s, wait.decode_queue_s, wait.prefill_s, wait.ttft_s)
        if limits.max_queue_wait_s is not None and wait.queue_s > limits.max_queue_wait_s:
            raise self._reject("queue_wait", f"the estimated queue wait ({wait.queue_s:.1f} s) is over the limit "
                               f"({limits.max_queue_wait_s:g} s); retry later", wait.queue_s - limits.max_queue_wait_s)
        if limits.slo_ttft_s is not None and wait.ttft_s > limits.slo_ttft_s:
            raise self._reject("slo_ttft", f"the predicted time to first token ({1000 * wait.ttft_s:.0f} ms) misses "
                               f"the target ({1000 * limits.slo_ttft_s:.0f} ms); retry later",
                               wait.ttft_s - limits.slo_ttft_s)

    def estimate(self, num_prompt_tokens: int) -> WaitEstimate:
        """How long a request with a prompt of num_prompt_tokens would wait now (see WaitEstimate).
        The prefill queue: the best node's queued prompt tokens (reported plus sent since) over its
        measured prefill rate. The decode slot: none to wait for while a decode node has one free;
        else the slots that must free first (one per request queued past the nodes' slots, and one
        for this request) over the drain rate. Routing sends a request to a node with a free slot
        while one has one (proxy.routing.has_free_slot), round-robin excepted."""
        decode = [n for n in self.pool.decode if n.is_routable]
        is_colocated = not self.pool.prefill
        prefillers = decode if is_colocated else [n for n in self.pool.prefill if n.is_routable]
        prefill_queue_s, prefill_s = _prefill_wait(prefillers, num_prompt_tokens, self.limits.max_node_waiting)
        rate = self.drain.per_s(time.monotonic())
        slots = [self._slots(n) for n in decode]
        num_waits = 0 if not slots or any(free > 0 for _, free in slots) else 1 + sum(q for q, _ in slots)
        decode_queue_s = num_waits / rate if rate and num_waits else 0.0
        queue_s = max(prefill_queue_s, decode_queue_s)
        # NOTE: disaggregated, the first token comes from the prefill node, before any decode wait.
        ttft_s = (queue_s if is_colocated else prefill_queue_s) + prefill_s
        return WaitEstimate(queue_s, prefill_s, ttft_s, decode_queue_s)

    def _slots(self, node: NodeClient) -> tuple[int, int]:
        """(requests queued past its slots, free slots) on a decode node, counting those sent since
        its report. Its slots: proxy.routing.decode_slots (what routing goes by too), or for a node
        that does not say, as many as it ran when it last queued; unknown (never said, never
        queued): taken as free."""
        report = node.last_report
        num_slots = decode_slots(node)
        if report.num_waiting + report.num_pending_pulls:
            self.num_slots[node.address] = num_slots
        elif num_slots is None:
            num_slots = self.num_slots.get(node.address)
        if num_slots is None:
            return 0, 1
        num_held = decode_held(node)
        return max(0, num_held - num_slots), max(0, num_slots - num_held)

    def _all_full(self) -> str | None:
        """The kind of node ("prefill", "decode") of which every healthy one is full; None if a
        request can go somewhere (or no node is healthy: routing answers that with a 503)."""
        for kind, nodes in (("prefill", self.pool.prefill), ("decode", self.pool.decode)):
            healthy = [n for n in nodes if n.is_routable]
            if healthy and all(is_full(n, self.limits.max_node_waiting) for n in healthy):
                return kind
        return None

    def _slot_wait_s(self, num_slots: int) -> float | None:
        rate = self.drain.per_s(time.monotonic())
        return num_slots / rate if rate else None

    def _reject(self, reason: str, message: str, retry_after_s: float | None) -> ApiError:
        self.metrics.rejections.labels(reason).inc()
        seconds = 1 if retry_after_s is None else min(MAX_RETRY_AFTER_S, max(1, math.ceil(retry_after_s)))
        logger.info("refused a request (%s): %s; Retry-After %d s", reason, message, seconds)
        return rate_limited(message, reason, seconds)


def is_full(node: NodeClient, max_node_waiting: int | None) -> bool:
    """The node's latest report (and what was sent since) shows no free KV block while requests
    queue, or as many queued requests as max_node_waiting or as the node's own bound
    (LoadReport.max_num_waiting: past it the node refuses them). A node that never reported is
    not full (nor healthy)."""
    report = node.last_report
    if report is None:
        return False
    num_queued = report.num_waiting + report.num_pending_pulls + len(node.unreported)
    num_free_blocks = report.num_free_blocks - protocol.num_blocks_for(node.num_unreported_tokens, report.block_size)
    if num_free_blocks <= 0 and num_queued > 0:
        return True
    limits = [n for n in (max_node_waiting, report.max_num_waiting) if n]
    return bool(limits) and num_queued >= min(limits)


def _prefill_wait(nodes: list[NodeClient], num_prompt_tokens: int,
                  max_node_waiting: int | None) -> tuple[float, float]:
    """(queue wait, own prefill time) on the node that would prefill the prompt soonest, among
    those not full; (0, 0) while none has measured its rate."""
    candidates = [n for n in nodes if not is_full(n, max_node_waiting)] or nodes
    best: tuple[float, float] | None = None
    for node in candidates:
        rate = node.last_report.prefill_tokens_per_s
        if rate <= 0:
            continue
        queue_s = node.prefill_wait_s(0)
        if best is None or queue_s + num_prompt_tokens / rate < sum(best):
            best = (queue_s, num_prompt_tokens / rate)
    return best or (0.0, 0.0)
