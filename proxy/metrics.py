"""Prometheus metrics of the proxy: request counts, latency histograms (TTFT, inter-token, end
to end), admission (requests in flight, refusals by reason), per-node load and prefix-cache
counters read from the nodes' latest LoadReports at scrape time, each node labelled by its
public name, and this proxy's routing decisions per node by reason."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy.ledger import Outcome, RequestLedger

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_NODE_LABELS = ["node", "kind"]
# (metric name, help, LoadReport field): gauges of the node's current state.
_NODE_GAUGES = (
    ("pdserve_node_running", "running requests", "num_running"),
    ("pdserve_node_waiting", "waiting requests", "num_waiting"),
    ("pdserve_node_free_blocks", "free KV blocks", "num_free_blocks"),
    ("pdserve_node_total_blocks", "KV blocks", "num_total_blocks"),
    ("pdserve_node_queued_prompt_tokens", "prompt tokens waiting for prefill", "num_queued_prompt_tokens"),
    ("pdserve_node_kv_leases", "prefilled prompts whose blocks wait for a pull", "num_leases"),
    ("pdserve_node_pending_pulls", "requests waiting for or pulling KV", "num_pending_pulls"),
    ("pdserve_node_max_model_len", "longest sequence the node accepts", "max_model_len"),
)

# (metric name, help, LoadReport field): counters a node keeps since it started.
_NODE_COUNTERS = (
    ("pdserve_node_rejected_messages", "messages a node refused (malformed, unauthenticated, oversized, "
     "wrong version, unexpected)", "num_rejected_messages"),
    ("pdserve_node_orphaned_requests", "requests a node aborted because their proxy vanished", "num_orphaned_requests"),
    ("pdserve_node_computed_prefill_tokens", "prompt tokens a node computed (prefix-cache hits not included)",
     "num_computed_prefill_tokens"),
    ("pdserve_node_kv_blocks_pulled", "KV blocks a decode node pulled from prefill nodes", "num_kv_blocks_pulled"),
    ("pdserve_node_kv_blocks_skipped", "KV blocks a decode node did not pull: its own prefix cache held them",
     "num_kv_blocks_skipped"),
)


class ProxyMetrics:
    """Owns one registry; nodes() gives the NodeClients to read load from at each scrape,
    node_name(node) the label each is shown under (its address unless told otherwise)."""

    def __init__(self, nodes: Callable[[], Iterable] = list, num_local_prefills: Callable[[], int] = int,
                 node_name: Callable[[object], str] = lambda node: node.address) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests", "requests by endpoint and outcome", ["endpoint", "status"],
                                registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "TTFT", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "time between streamed tokens (TPOT)",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "end-to-end request time",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "tokens generated", registry=r)
        self.aborts = Counter("pdserve_aborts", "requests aborted (disconnect, stop string, error)", ["reason"],
                              registry=r)
        self.rejections = Counter("pdserve_admission_rejections", "requests refused with a 429 by reason: "
                                  "max_num_requests, max_client_requests, max_client_uploads, nodes_full, "
                                  "queue_wait, slo_ttft, too_many_uploads", ["reason"], registry=r)
        self.in_flight = Gauge("pdserve_requests_in_flight", "choices held by the proxy (admitted, not ended)",
                               registry=r)
        self.uploads = Gauge("pdserve_uploads_in_progress", "request bodies arriving (not admitted yet)", registry=r)
        self.ledger = RequestLedger()  # every generation request to its end (the service opens and ends them)
        r.register(_LedgerCollector(self.ledger))
        r.register(_NodeCollector(nodes, num_local_prefills, node_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LedgerCollector:
    """The generation requests open now, and how those that ended did, by outcome (proxy.ledger),
    every outcome shown from 0."""

    def __init__(self, ledger: RequestLedger) -> None:
        self._ledger = ledger

    def collect(self) -> Iterable[Metric]:
        ledger = self._ledger
        yield GaugeMetricFamily("pdserve_requests_open", "generation requests taken on and not ended yet",
                                value=ledger.num_open)
        family = CounterMetricFamily("pdserve_request_ends", "generation requests ended, by outcome: tokens, error "
                                     "(an error status or SSE error event), client_gone, unanswered (a bug)",
                                     labels=["outcome"])
        for outcome in Outcome:
            family.add_metric([outcome.value], ledger.ends[outcome])
        yield family


class _NodeCollector:
    """Per-node metrics straight from the latest LoadReport (no state kept here)."""

    def __init__(self, nodes: Callable[[], Iterable], num_local_prefills: Callable[[], int],
                 node_name: Callable[[object], str]) -> None:
        self._nodes = nodes
        self._num_local_prefills = num_local_prefills
        self._node_name = node_name

    def collect(self) -> Iterable[Metric]:
        nodes = list(self._nodes())
        up = GaugeMetricFamily("pdserve_node_up", "1 when the node reports in time", labels=_NODE_LABELS)
        for node in nodes:
            up.add_metric([self._node_name(node), node.kind], 1 if node.is_healthy else 0)
        yield up
        reporting = [n for n in nodes if n.last_report is not None]
        for name, help_text, field in _NODE_GAUGES:
            gauge = GaugeMetricFamily(name, help_text, labels=_NODE_LABELS)
            for node in reporting:
                gauge.add_metric([self._node_name(node), node.kind], getattr(node.last_report, field))
            yield gauge
        fallbacks = CounterMetricFamily("pdserve_node_kv_fallbacks", "requests whose KV pull failed and were "
                                        "prefilled on the decode node instead", labels=_NODE_LABELS)
        for node in reporting:
            fallbacks.add_metric([self._node_name(node), node.kind], node.last_report.num_kv_fallbacks)
        yield fallbacks
        by_reason = CounterMetricFamily("pdserve_node_kv_fallbacks_by_reason", "KV pulls that fell back to local "
                                        "prefill, by reason", labels=[*_NODE_LABELS, "reason"])
        for node in reporting:
            for reason, count in sorted(node.last_report.num_kv_fallbacks_by_reason.items()):
                by_reason.add_metric([self._node_name(node), node.kind, reason], count)
        yield by_reason
        for name, help_text, field in _NODE_COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=_NODE_LABELS)
            for node in reporting:
                counter.add_metric([self._node_name(node), node.kind], getattr(node.last_report, field))
            yield counter
        yield from _prefix_cache_metrics(reporting, self._node_name)
        yield _routing_decisions(nodes, self._node_name)
        yield CounterMetricFamily("pdserve_local_prefills", "prompts prefilled on their decode node because the "
                                  "prefill pool was backed up (conditional disaggregation)",
                                  value=self._num_local_prefills())


def _prefix_cache_metrics(reporting: list, node_name: Callable[[object], str]) -> Iterable[Metric]:
    """Prompt tokens looked up in each node's prefix cache and found there (hit rate = hit /
    query), cached vs uncached prompt tokens (uncached: computed on a prefill or colocated
    node; pulled or computed on a decode node). Computed tokens and KV blocks pulled vs skipped
    are in _NODE_COUNTERS."""
    query = CounterMetricFamily("pdserve_node_prefix_query_tokens", "prompt tokens looked up in the node's prefix "
                                "cache", labels=_NODE_LABELS)
    hit = CounterMetricFamily("pdserve_node_prefix_hit_tokens", "prompt tokens found in the node's prefix cache",
                              labels=_NODE_LABELS)
    rate = GaugeMetricFamily("pdserve_node_prefix_hit_rate", "prefix-cache hit tokens / query tokens since the node "
                             "started (absent before its first lookup)", labels=_NODE_LABELS)
    tokens = CounterMetricFamily("pdserve_node_prompt_tokens_by_cache", "prompt tokens by source: cached (prefix "
                                 "cache hit) or uncached (computed on a prefill or colocated node; pulled or computed "
                                 "on a decode node)", labels=[*_NODE_LABELS, "source"])
    for node in reporting:
        labels = [node_name(node), node.kind]
        report = node.last_report
        query.add_metric(labels, report.num_prefix_query_tokens)
        hit.add_metric(labels, report.num_prefix_hit_tokens)
        if report.num_prefix_query_tokens > 0:
            rate.add_metric(labels, report.num_prefix_hit_tokens / report.num_prefix_query_tokens)
        tokens.add_metric([*labels, "cached"], report.num_prefix_hit_tokens)
        tokens.add_metric([*labels, "uncached"], report.num_prefix_query_tokens - report.num_prefix_hit_tokens)
    yield from (query, hit, rate, tokens)


def _routing_decisions(nodes: list, node_name: Callable[[object], str]) -> Metric:
    """Requests this proxy routed to each node, by reason (proxy.routing)."""
    decisions = CounterMetricFamily("pdserve_routing_decisions", "requests routed to the node, by reason: cache "
                                    "(it caches the longest prefix of the prompt), load (no node caches any, or a "
                                    "less loaded one was worth more), cap (a node caching more was past the load "
                                    "cap), slot (a decode node caching more had no free slot), round_robin, "
                                    "least_loaded, local_prefill (prefilled on this decode node)",
                                    labels=[*_NODE_LABELS, "reason"])
    for node in nodes:
        for reason, count in sorted(getattr(node, "routing_decisions", {}).items()):
            decisions.add_metric([node_name(node), node.kind, reason], count)
    return decisions
