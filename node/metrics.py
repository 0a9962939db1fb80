"""NodeMetrics: a node's Prometheus metrics per phase (queue, prefill, KV pull and lease, decode
steps, TTFT, inter-token, end to end), served on /metrics of its health port.

Names follow vLLM's (`vllm:*`, labels `model_name` and `engine`) where the meaning is the same,
so dashboards made for vLLM work; the rest start with `pdserve_node_`. Every series also has a
`role` label (prefill, decode, colocated) and `engine` is the node id. Times are as the node's
loop sees them: a request arrives when the loop takes its message, is scheduled at the start of
the step that first runs it, and gets a token at the end of the step that sampled it.

Cost: one small record per request in flight (never per token), a few histogram observes per
request and one per token (inter-token latency); per step, the ids of the scheduler's waiting
queue when it is not empty. Gauges and counters kept elsewhere (load, fallbacks, preemptions,
prefix-cache counters) are read at scrape time from the loop's latest load snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from engine.protocol import KVFallbackReason, KVOutcome, KVSource

LABELS = ["model_name", "engine", "role"]
# vLLM's buckets (vllm/v1/metrics/loggers.py), with finer ones below vLLM's first where a
# CPU node's phases often fall (a tiny model's decode step takes ~5 ms; vLLM's ITL starts at 10).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PULL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PULL_BYTES_BUCKETS = tuple(float(1 << shift) for shift in range(12, 36, 2))  # 4 KiB .. 32 GiB
# The finish reasons a request ends with here (engine.request.FinishReason values, and abort and
# error for requests ended outside a step), each shown from the start at 0.
FINISH_REASONS = ("stop", "length", "prefilled", "abort", "error")


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 series up to max_model_len (request prompt and generation lengths)."""
    buckets, base = [], 1
    while base <= max_model_len:
        buckets += [base * m for m in (1, 2, 5) if base * m <= max_model_len]
        base *= 10
    return buckets


@dataclass
class _Timeline:
    """One request in flight on this node: when each phase began (time.monotonic())."""

    arrived_at: float
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float = 0.0
    num_tokens: int = 0  # generated here


class NodeMetrics:
    """The node's registry and its per-request bookkeeping. Called by the node's loop only (not
    thread-safe); render() may run on any thread (it reads histograms, which lock, and the
    load snapshot, which the loop replaces whole)."""

    def __init__(self, model_name: str, node_id: str, role: str, max_model_len: int,
                 load_fields: Callable[[], dict], num_preemptions: Callable[[], int],
                 connector: Callable[[], object] = lambda: None,
                 grammar_gate: Callable[[], object] = lambda: None) -> None:
        self.labels = {"model_name": model_name, "engine": node_id, "role": role}
        self.registry = CollectorRegistry()
        self._requests: dict[str, _Timeline] = {}
        self._leases: dict[str, float] = {}  # request id -> when its lease began (prefill node)
        self._add_request_metrics(max_model_len)
        self._add_step_metrics()
        self.registry.register(_LoadCollector(self.labels, load_fields, num_preemptions))
        self.registry.register(_TransferCollector(connector, self.labels))
        self.registry.register(_GrammarCollector(grammar_gate, self.labels))

    def _histogram(self, name: str, help_text: str, buckets) -> Histogram:
        return Histogram(name, help_text, LABELS, buckets=buckets, registry=self.registry).labels(**self.labels)

    def _counter(self, name: str, help_text: str) -> Counter:
        return Counter(name, help_text, LABELS, registry=self.registry).labels(**self.labels)

    def _add_request_metrics(self, max_model_len: int) -> None:
        h = self._histogram
        self.queue_time = h("vllm:request_queue_time_seconds", "arrival at the node to first scheduled (requests "
                            "prefilled here)", PHASE_BUCKETS)
        self.prefill_time = h("vllm:request_prefill_time_seconds", "first scheduled to first token (requests "
                              "prefilled here: prefill compute, chunks included)", PHASE_BUCKETS)
        self.decode_time = h("vllm:request_decode_time_seconds", "first to last token generated here",
                             PHASE_BUCKETS)
        self.inference_time = h("vllm:request_inference_time_seconds", "first scheduled to finished", PHASE_BUCKETS)
        self.ttft = h("vllm:time_to_first_token_seconds", "arrival at the node to the first token it sends (on a "
                      "decode node that pulled the KV: its first decoded token)", TTFT_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "time between a request's successive tokens here",
                     ITL_BUCKETS)
        self.tpot = h("vllm:request_time_per_output_token_seconds", "per request: decode time / (tokens "
                      "generated here - 1)", ITL_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds", "arrival at the node to finished", PHASE_BUCKETS)
        self.request_prompt_tokens = h("vllm:request_prompt_tokens", "prompt tokens of each request prefilled here",
                                       token_buckets(max_model_len))
        self.request_generation_tokens = h("vllm:request_generation_tokens", "tokens each request generated here",
                                           token_buckets(max_model_len))
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "prompt tokens prefilled here (not pulled KV)")
        self.generation_tokens = self._counter("vllm:generation_tokens", "tokens generated here")
        success = Counter("vllm:request_success", "requests finished here, by reason (prefilled: handed to a "
                          "decode node)", [*LABELS, "finished_reason"], registry=self.registry)
        self.finished = {reason: success.labels(**self.labels, finished_reason=reason) for reason in FINISH_REASONS}

    def _add_step_metrics(self) -> None:
        h = self._histogram
        self.step_time = h("pdserve_node_step_seconds", "one engine step (schedule, forward, sample)", STEP_BUCKETS)
        self.decode_batch = h("pdserve_node_decode_batch_size", "requests decoded in one step (steps with any)",
                              BATCH_BUCKETS)
        self.borrowed_steps = self._counter("pdserve_node_borrowed_core_steps", "decode node: steps run on its "
                                            "prefill node's cores too, lent while that one had nothing to prefill")
        self.preempted_borrowed_steps = self._counter(
            "pdserve_node_preempted_borrowed_core_steps", "decode node: borrowed steps that did not get enough of "
            "their cores (judged over spans of steps; another process ran there), each such span followed by a "
            "back-off on its own cores")
        self.lent_cores_free = Gauge("pdserve_node_lent_cores_free", "decode node: 1 while its prefill node's "
                                     "cores were last found free of other processes' work (it may borrow them)",
                                     LABELS, registry=self.registry).labels(**self.labels)
        self.lease_hold = h("pdserve_node_kv_lease_hold_seconds", "prefill node: a finished prompt's blocks held "
                            "for its reader, from the lease to its end (read, released, expired)", PHASE_BUCKETS)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- the loop's events ------------------------------------------------------------------

    def request_arrived(self, request_id: str) -> None:
        self._requests[request_id] = _Timeline(time.monotonic())

    def request_ended(self, request_id: str, reason: str) -> None:
        """A request ended outside a step (abort, error reply); no-op for one already finished."""
        timeline = self._requests.pop(request_id, None)
        if timeline is not None:
            self.finished[reason].inc()
            self.e2e.observe(time.monotonic() - timeline.arrived_at)

    def forget(self, request_id: str) -> None:
        """Drop whatever is kept for request_id (every way a request leaves the node ends here)."""
        self._requests.pop(request_id, None)

    def waiting_ids(self, waiting: Iterable) -> set[str] | None:
        """Before a step: the ids of the scheduler's waiting requests (None when there are none)."""
        return {request.request_id for request in waiting} or None

    def step_done(self, started_at: float, waiting_before: set[str] | None, waiting_after: Iterable,
                  outputs: list, kv_outcomes: dict[str, KVOutcome]) -> None:
        """After a step that began at started_at: who left the waiting queue (scheduled at
        started_at), the tokens and finishes of outputs (engine StepOutputs)."""
        now = time.monotonic()
        self.step_time.observe(now - started_at)
        if waiting_before:
            self._note_scheduled(waiting_before - {request.request_id for request in waiting_after}, started_at)
        num_decodes = num_tokens = 0
        for out in outputs:
            timeline = self._requests.get(out.request_id)
            if timeline is None:
                continue  # not sent by a proxy (warm-up), or ended already
            if out.new_tokens:
                num_tokens += len(out.new_tokens)
                num_decodes += self._note_tokens(timeline, out, kv_outcomes, now)
            if out.finish_reason is not None:
                self._finish(out.request_id, timeline, out.finish_reason.value, now)
        if num_tokens:
            self.generation_tokens.inc(num_tokens)
        if num_decodes:
            self.decode_batch.observe(num_decodes)

    def _note_scheduled(self, request_ids: set[str], started_at: float) -> None:
        for request_id in request_ids:
            timeline = self._requests.get(request_id)
            if timeline is not None and timeline.scheduled_at is None:
                timeline.scheduled_at = started_at
                self.queue_time.observe(started_at - timeline.arrived_at)

    def _note_tokens(self, timeline: _Timeline, out, kv_outcomes: dict[str, KVOutcome], now: float) -> int:
        """Time out's tokens; returns 1 if they came from a decode (not from a prompt run here)."""
        is_decode = timeline.first_token_at is not None
        if is_decode:
            self.itl.observe(now - timeline.last_token_at)
        else:
            timeline.first_token_at = now
            self.ttft.observe(now - timeline.arrived_at)
            kv = kv_outcomes.get(out.request_id)
            is_decode = kv is not None and kv.source is KVSource.PULLED
            if not is_decode:
                self.prompt_tokens.inc(out.num_prompt_tokens)
                self.request_prompt_tokens.observe(out.num_prompt_tokens)
                if timeline.scheduled_at is not None:
                    self.prefill_time.observe(now - timeline.scheduled_at)
        timeline.last_token_at = now
        timeline.num_tokens += len(out.new_tokens)
        return 1 if is_decode else 0

    def _finish(self, request_id: str, timeline: _Timeline, reason: str, now: float) -> None:
        del self._requests[request_id]
        self.finished[reason].inc()
        self.e2e.observe(now - timeline.arrived_at)
        self.request_generation_tokens.observe(timeline.num_tokens)
        if timeline.scheduled_at is not None:
            self.inference_time.observe(now - timeline.scheduled_at)
        if timeline.first_token_at is not None and timeline.num_tokens > 1:
            decode_s = timeline.last_token_at - timeline.first_token_at
            self.decode_time.observe(decode_s)
            self.tpot.observe(decode_s / (timeline.num_tokens - 1))

    # ---- leases (prefill node) --------------------------------------------------------------

    def lease_started(self, request_id: str) -> None:
        """A prefilled request's blocks now wait on a lease (called when the lease is added,
        before its handle is sent: a reader may confirm, and so end it, at once)."""
        self._leases[request_id] = time.monotonic()

    def poll_leases(self, is_held: Callable[[str], bool]) -> None:
        """Observe the hold time of every lease that ended since the last call (read and confirmed,
        released, aborted, expired: whichever way, as the loop sees it)."""
        if not self._leases:
            return
        now = time.monotonic()
        for request_id in [rid for rid in self._leases if not is_held(rid)]:
            self.lease_hold.observe(now - self._leases.pop(request_id))

    @property
    def num_tracked(self) -> int:
        """Requests and leases kept here (0 once the node is idle: nothing leaks)."""
        return len(self._requests) + len(self._leases)


class _LoadCollector:
    """Gauges and counters read at scrape time from the node's load snapshot (LoadReport fields)
    and the engine's preemption count."""

    def __init__(self, labels: dict[str, str], load_fields: Callable[[], dict],
                 num_preemptions: Callable[[], int]) -> None:
        self._names = list(labels)
        self._values = list(labels.values())
        self._load_fields = load_fields
        self._num_preemptions = num_preemptions

    def _gauge(self, name: str, help_text: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, help_text, labels=self._names)
        family.add_metric(self._values, value)
        return family

    def _counter(self, name: str, help_text: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, help_text, labels=self._names)
        family.add_metric(self._values, value)
        return family

    def collect(self) -> Iterator[Metric]:
        load = self._load_fields()
        total, free = load.get("num_total_blocks", 0), load.get("num_free_blocks", 0)
        num_pulls = load.get("num_pending_pulls", 0)
        yield self._gauge("vllm:num_requests_running", "requests in the running batch", load.get("num_running", 0))
        yield self._gauge("vllm:num_requests_waiting", "requests waiting to run (queued, or for their KV pull)",
                          load.get("num_waiting", 0) + num_pulls)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV blocks in use (1 = all)", (total - free) / total if total
                          else 0.0)
        yield self._gauge("pdserve_node_kv_blocks_free", "free KV blocks", free)
        yield self._gauge("pdserve_node_kv_blocks_total", "KV blocks", total)
        yield self._gauge("pdserve_node_kv_pulls_pending", "decode node: requests waiting for or pulling KV",
                          num_pulls)
        yield self._gauge("pdserve_node_leases_held", "prefill node: prompts whose blocks wait for a pull",
                          load.get("num_leases", 0))
        yield self._gauge("pdserve_node_queued_prompt_tokens", "prompt tokens waiting for prefill",
                          load.get("num_queued_prompt_tokens", 0))
        yield self._gauge("pdserve_node_draining", "1 while draining (refusing new requests)",
                          1 if load.get("is_draining") else 0)
        yield self._counter("vllm:num_preemptions", "requests preempted (recomputed later)", self._num_preemptions())
        yield self._counter("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                            load.get("num_prefix_query_tokens", 0))
        yield self._counter("vllm:prefix_cache_hits", "prompt tokens found in the prefix cache",
                            load.get("num_prefix_hit_tokens", 0))
        yield self._counter("pdserve_node_rejected_messages", "messages refused (malformed, unauthenticated, "
                            "oversized, wrong version, unexpected)", load.get("num_rejected_messages", 0))
        yield self._fallbacks(load.get("num_kv_fallbacks_by_reason", {}))
        yield self._counter("pdserve_node_kv_blocks_lost", "decode node: KV blocks taken out of use for good (a "
                            "transfer into them never stopped)", load.get("num_kv_blocks_lost", 0))
        yield self._counter("pdserve_node_kv_streamed", "prefill node: prompts whose KV was offered chunk by chunk "
                            "while prefilled; decode node: pulls that read a prompt's KV so",
                            load.get("num_kv_streamed", 0))

    def _fallbacks(self, by_reason: dict[str, int]) -> CounterMetricFamily:
        family = CounterMetricFamily("pdserve_node_kv_pull_fallbacks", "decode node: KV pulls that failed and were "
                                     "prefilled here instead, by reason", labels=[*self._names, "reason"])
        for reason in sorted({r.value for r in KVFallbackReason} | set(by_reason)):
            family.add_metric([*self._values, reason], by_reason.get(reason, 0))
        return family


class _GrammarCollector:
    """The grammar gate's figures (node.grammar_gate), read at scrape time (plain ints the loop
    and the compile threads update)."""

    def __init__(self, gate: Callable[[], object], labels: dict[str, str]) -> None:
        self._gate = gate
        self._names = list(labels)
        self._values = list(labels.values())

    def collect(self) -> Iterator[Metric]:
        gate = self._gate()
        if gate is None:
            return
        for name, help_text, value, family_type in (
            ("pdserve_node_grammar_waiting", "requests waiting for their grammar to compile", len(gate),
             GaugeMetricFamily),
            ("pdserve_node_grammar_runaway_compiles", "compiles past their time budget still running on a grammar "
             "thread", gate.num_runaway, GaugeMetricFamily),
            ("pdserve_node_grammar_timeouts", "grammar compiles refused past --grammar-compile-timeout-s",
             gate.num_timeouts, CounterMetricFamily),
            ("pdserve_node_grammar_busy_refusals", "requests refused because no grammar thread started their "
             "compile in time", gate.num_busy_refusals, CounterMetricFamily),
        ):
            family = family_type(name, help_text, labels=self._names)
            family.add_metric(self._values, value)
            yield family


class _TransferCollector:
    """The node's KV connector's TransferMeter, when it has one (node.transfer.connector_for
    gives every connector one), and the transport its reads take where the connector knows it
    (NIXL: what UCX reported, once a read completed); looked up at each scrape, so the order of
    construction is free."""

    def __init__(self, connector: Callable[[], object], labels: dict[str, str]) -> None:
        self._connector = connector
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        connector = self._connector()
        meter = getattr(connector, "meter", None)
        if meter is not None:
            yield from meter.collect()
        transport = getattr(connector, "transport", None)
        if transport is not None:
            family = InfoMetricFamily("pdserve_kv_transport", "how this node's KV reads travel: device copies from a "
                                      "node on the same GPU, else as UCX reported it (transport/device, method, "
                                      "memory kind)", labels=list(self._labels))
            family.add_metric(list(self._labels.values()), {"transport": transport.transport,
                                                             "method": transport.method, "memory": transport.memory})
            yield family


class TransferMeter:
    """KV pull metrics of a decode node (bytes, blocks, seconds, the wait before a pull starts,
    failures by code), fed by MeteredConnector. Per pull: a few dict operations and observes."""

    def __init__(self, labels: dict[str, str], block_bytes: int, num_ranks: int = 1) -> None:
        """block_bytes: a block of every rank's cache; num_ranks: the tensor-parallel ranks whose
        caches every pull writes (each its own KV heads)."""
        self.block_bytes = block_bytes
        self._registry = CollectorRegistry()
        r = self._registry

        def histogram(name: str, help_text: str, buckets) -> Histogram:
            return Histogram(name, help_text, LABELS, buckets=buckets, registry=r).labels(**labels)

        self.wait = histogram("pdserve_node_kv_pull_wait_seconds", "decode node: admitted (lease held) to the "
                              "pull's start (waiting for free blocks or a batch slot)", PHASE_BUCKETS)
        self.seconds = histogram("pdserve_node_kv_pull_seconds", "decode node: a pull's start to the loop seeing it "
                                 "done (includes up to one engine step)", PULL_BUCKETS)
        self.size = histogram("pdserve_node_kv_pull_bytes", "decode node: bytes of one successful pull",
                              PULL_BYTES_BUCKETS)
        self.bytes_total = Counter("pdserve_node_kv_pulled_bytes", "decode node: KV bytes pulled (successful "
                                   "pulls)", LABELS, registry=r).labels(**labels)
        self.blocks_total = Counter("pdserve_node_kv_pulled_blocks", "decode node: KV blocks (one descriptor each) "
                                    "pulled (successful pulls)", LABELS, registry=r).labels(**labels)
        self._failures = Counter("pdserve_node_kv_pull_failures", "decode node: pulls that failed, by code",
                                 [*LABELS, "code"], registry=r)
        rank_blocks = Counter("pdserve_node_kv_pulled_rank_blocks", "decode node: KV blocks written into each "
                              "tensor-parallel rank's cache (its own KV heads) by successful pulls",
                              [*LABELS, "rank"], registry=r)
        self._rank_blocks = [rank_blocks.labels(**labels, rank=str(rank)) for rank in range(num_ranks)]
        self._labels = labels
        self._held_at: dict[str, float] = {}
        self._started: dict[str, tuple[float, int]] = {}

    def collect(self) -> Iterator[Metric]:
        yield from self._registry.collect()

    def held(self, request_id: str) -> None:
        self._held_at[request_id] = time.monotonic()

    def started(self, request_id: str, num_blocks: int) -> None:
        now = time.monotonic()
        held_at = self._held_at.pop(request_id, None)
        if held_at is not None:
            self.wait.observe(now - held_at)
        self._started[request_id] = (now, num_blocks)

    def done(self, request_id: str, failure_code: str | None) -> None:
        started = self._started.pop(request_id, None)
        if started is None:
            return
        if failure_code is not None:
            self._failures.labels(**self._labels, code=failure_code).inc()
            return
        started_at, num_blocks = started
        num_bytes = num_blocks * self.block_bytes
        self.seconds.observe(time.monotonic() - started_at)
        self.size.observe(num_bytes)
        self.bytes_total.inc(num_bytes)
        self.blocks_total.inc(num_blocks)
        for rank_blocks in self._rank_blocks:
            rank_blocks.inc(num_blocks)

    def forget(self, request_id: str) -> None:
        self._held_at.pop(request_id, None)
        self._started.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._held_at) + len(self._started)


class MeteredConnector:
    """A KVConnector that reports its pulls to a TransferMeter; everything else goes straight to
    the connector it wraps (so new connector methods need nothing here)."""

    def __init__(self, connector, meter: TransferMeter) -> None:
        self.inner = connector
        self.meter = meter

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def hold(self, request_id: str, lease, *args, **kwargs) -> None:
        self.inner.hold(request_id, lease, *args, **kwargs)
        self.meter.held(request_id)

    def start_read(self, request_id: str, lease, local_block_ids: list[int], *args, **kwargs) -> None:
        self.inner.start_read(request_id, lease, local_block_ids, *args, **kwargs)
        self.meter.started(request_id, len(local_block_ids))

    def poll(self, *args, **kwargs) -> list:
        results = self.inner.poll(*args, **kwargs)
        for result in results:
            self.meter.done(result.request_id, None if result.is_ok else _code_of(result.failure))
        return results

    def abort_read(self, request_id: str, *args, **kwargs) -> bool:
        self.meter.forget(request_id)
        return self.inner.abort_read(request_id, *args, **kwargs)

    def release_remote(self, request_id: str, *args, **kwargs) -> None:
        self.meter.forget(request_id)
        self.inner.release_remote(request_id, *args, **kwargs)


def _code_of(failure) -> str:
    return getattr(failure, "value", None) or str(failure)
