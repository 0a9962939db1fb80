"""The load a node reports to its proxies: the LoadReport fields the loop records (record_load)
and the snapshot the heartbeat thread builds each proxy's LoadReport from (LoadSnapshot)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine import protocol
from node.prefix_cache import PrefixDigests

if TYPE_CHECKING:
    from node.server import NodeServer


@dataclass(frozen=True)
class LoadSnapshot:
    """LoadReport fields as the loop last recorded them, and the proxies it has heard from with
    the seq of each one's last request (the report to a proxy echoes its own)."""

    fields: dict
    last_request_seqs: dict[bytes, int] = field(default_factory=dict)
    prefix_digests: PrefixDigests | None = None  # the prefix-cache digest, for the proxies it is due to

    def report_for(self, identity: bytes) -> protocol.LoadReport:
        digest = self.prefix_digests.due_for(identity) if self.prefix_digests is not None else None
        return protocol.LoadReport(**self.fields, sent_at=time.time(), prefix_cache=digest,
                                   last_request_seq=self.last_request_seqs.get(identity, 0))


def record_load(server: NodeServer, metrics_port: int) -> LoadSnapshot:
    """Snapshot server's load, on the loop's thread (the heartbeat thread then reads only the
    returned snapshot, never the loop's state); refreshes server's prefix-cache digest."""
    fields = _load_fields(server, metrics_port)
    server.prefix_digests.refresh()
    return LoadSnapshot(fields, dict(server.proxies.last_request_seqs), server.prefix_digests)


def _load_fields(server: NodeServer, metrics_port: int) -> dict:
    engine = server.engine
    scheduler = engine.scheduler
    return dict(
        node_id=server.config.node_id,
        role=server.role,
        protocol_version=protocol.PROTOCOL_VERSION,
        model_name=engine.config.model.name,
        max_model_len=engine.max_total_tokens,
        block_size=engine.block_size,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_queued_prompt_tokens=scheduler.num_queued_prompt_tokens,
        num_free_blocks=engine.num_free_blocks,
        num_promised_blocks=server.num_promised_blocks(),
        num_total_blocks=engine.block_pool.num_blocks,
        num_kv_fallbacks=server.num_kv_fallbacks,
        prefill_tokens_per_s=engine.prefill_rate.tokens_per_s,
        kv_layout=server.kv_layout_info(),
        num_kv_fallbacks_by_reason=dict(server.num_kv_fallbacks_by_reason),
        num_rejected_messages=server.num_rejected_messages,
        num_orphaned_requests=server.num_orphaned_requests,
        boot_id=server.boot_id,
        progress=server.progress,
        is_draining=server.is_draining,
        max_num_waiting=server.config.max_num_waiting,
        max_num_seqs=engine.config.scheduler.max_num_seqs,
        num_prefix_query_tokens=engine.prefix_stats.num_query_tokens,
        num_prefix_hit_tokens=engine.prefix_stats.num_hit_tokens,
        num_computed_prefill_tokens=engine.prefix_stats.num_computed_prefill_tokens,
        metrics_port=metrics_port,
        **server.load_extras(),
    )
