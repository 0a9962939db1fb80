"""Per-node counters the proxy exports from load reports: KV fallbacks by reason, rejected
messages, orphaned requests, prefix-cache lookups and hits, KV blocks pulled and skipped; and
the proxy's routing decisions per node by reason."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine import protocol
from proxy.metrics import ProxyMetrics


@dataclass
class _Node:
    kind: str
    last_report: protocol.LoadReport
    is_healthy: bool = True
    routing_decisions: Counter = field(default_factory=Counter)


def _report(**fields) -> protocol.LoadReport:
    return protocol.LoadReport(
        node_id="n", role=protocol.Role.PREFILL, protocol_version=protocol.PROTOCOL_VERSION, model_name="m",
        max_model_len=64, block_size=16, num_running=0, num_waiting=0, num_queued_prompt_tokens=0,
        num_free_blocks=8, num_total_blocks=8, **fields)


def test_prefix_cache_hit_rate_cached_and_uncached_tokens_and_routing_decisions_per_node():
    prefill = _Node("prefill", _report(num_prefix_query_tokens=1000, num_prefix_hit_tokens=750),
                    routing_decisions=Counter({"cache": 3, "cap": 1}))
    fresh = _Node("prefill", _report())  # no lookup yet: no hit rate
    names = {id(prefill): "prefill0", id(fresh): "prefill1"}
    text = ProxyMetrics(lambda: [prefill, fresh], node_name=lambda node: names[id(node)]).render().decode()
    for line in ('pdserve_node_prefix_query_tokens_total{kind="prefill",node="prefill0"} 1000.0',
                 'pdserve_node_prefix_hit_tokens_total{kind="prefill",node="prefill0"} 750.0',
                 'pdserve_node_prefix_hit_rate{kind="prefill",node="prefill0"} 0.75',
                 'pdserve_node_prompt_tokens_by_cache_total{kind="prefill",node="prefill0",source="cached"} 750.0',
                 'pdserve_node_prompt_tokens_by_cache_total{kind="prefill",node="prefill0",source="uncached"} 250.0',
                 'pdserve_routing_decisions_total{kind="prefill",node="prefill0",reason="cache"} 3.0',
                 'pdserve_routing_decisions_total{kind="prefill",node="prefill0",reason="cap"} 1.0',
                 'pdserve_node_prefix_query_tokens_total{kind="prefill",node="prefill1"} 0.0'):
        assert line in text, line
    assert 'pdserve_node_prefix_hit_rate{kind="prefill",node="prefill1"}' not in text


def test_kv_blocks_pulled_skipped_and_computed_tokens_are_exported_per_node():
    decode = _Node("decode", _report(num_kv_blocks_pulled=12, num_kv_blocks_skipped=30,
                                     num_computed_prefill_tokens=40))
    text = ProxyMetrics(lambda: [decode], node_name=lambda node: "decode0").render().decode()
    assert 'pdserve_node_kv_blocks_pulled_total{kind="decode",node="decode0"} 12.0' in text
    assert 'pdserve_node_kv_blocks_skipped_total{kind="decode",node="decode0"} 30.0' in text
    assert 'pdserve_node_computed_prefill_tokens_total{kind="decode",node="decode0"} 40.0' in text


def test_fallbacks_by_reason_rejected_and_orphaned_counts_are_exported_per_node():
    report = protocol.LoadReport(
        node_id="d0", role=protocol.Role.DECODE, protocol_version=protocol.PROTOCOL_VERSION, model_name="m",
        max_model_len=64, block_size=16, num_running=0, num_waiting=0, num_queued_prompt_tokens=0,
        num_free_blocks=8, num_total_blocks=8, num_kv_fallbacks=3,
        num_kv_fallbacks_by_reason={"lease_lost": 2, "transfer": 1}, num_rejected_messages=5,
        num_orphaned_requests=4)
    metrics = ProxyMetrics(lambda: [_Node("decode", report)], node_name=lambda node: "decode0")
    text = metrics.render().decode()
    for line in ('pdserve_node_kv_fallbacks_by_reason_total{kind="decode",node="decode0",reason="lease_lost"} 2.0',
                 'pdserve_node_kv_fallbacks_by_reason_total{kind="decode",node="decode0",reason="transfer"} 1.0',
                 'pdserve_node_rejected_messages_total{kind="decode",node="decode0"} 5.0',
                 'pdserve_node_orphaned_requests_total{kind="decode",node="decode0"} 4.0'):
        assert line in text, line
