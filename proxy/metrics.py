"""Prometheus metrics of the proxy: request counts, latency histograms, per-node load."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests", "requests by endpoint and outcome", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "TTFT", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "time between streamed tokens (TPOT)",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "end-to-end request time",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "tokens generated", registry=r)
        self.aborts = Counter("pdserve_aborts", "requests aborted (disconnect, stop string, error)", ["reason"], registry=r)
        labels = ["node", "kind"]
        self.node_running = Gauge("pdserve_node_running", "running requests", labels, registry=r)
        self.node_waiting = Gauge("pdserve_node_waiting", "waiting requests", labels, registry=r)
        self.node_free_blocks = Gauge("pdserve_node_free_blocks", "free KV blocks", labels, registry=r)
        self.node_total_blocks = Gauge("pdserve_node_total_blocks", "KV blocks", labels, registry=r)
        self.node_queued_tokens = Gauge("pdserve_node_queued_prompt_tokens", "queued prompt tokens", labels, registry=r)
        self.node_leases = Gauge("pdserve_node_kv_leases", "prefill blocks held for a pull", labels, registry=r)
        self.node_fallbacks = Gauge("pdserve_node_kv_fallbacks", "requests that fell back to local prefill",
                                    labels, registry=r)
        self.node_up = Gauge("pdserve_node_up", "1 when the node reports in time", labels, registry=r)

    def render(self, nodes) -> bytes:
        for node in nodes:
            labels = (node.address, node.kind)
            self.node_up.labels(*labels).set(1 if node.is_healthy else 0)
            report = node.last_report
            if report is None:
                continue
            self.node_running.labels(*labels).set(report.num_running)
            self.node_waiting.labels(*labels).set(report.num_waiting)
            self.node_free_blocks.labels(*labels).set(report.num_free_blocks)
            self.node_total_blocks.labels(*labels).set(report.num_total_blocks)
            self.node_queued_tokens.labels(*labels).set(report.num_queued_prompt_tokens)
            self.node_leases.labels(*labels).set(report.num_leases)
            self.node_fallbacks.labels(*labels).set(report.num_kv_fallbacks)
        return generate_latest(self.registry)
