"""Per-node counters the proxy exports from load reports: KV fallbacks by reason, rejected
messages, orphaned requests."""

from __future__ import annotations

from dataclasses import dataclass

from engine import protocol
from proxy.metrics import ProxyMetrics


@dataclass
class _Node:
    kind: str
    last_report: protocol.LoadReport
    is_healthy: bool = True


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
