"""A node's KV connector: the engine's cache layout as kv_transfer describes it, and the
connector built over the engine's cache."""

from __future__ import annotations

from engine import protocol
from engine.engine import LLMEngine
from engine.kv_cache import kv_layout_fields
from engine.weights import model_fingerprint
from kv_transfer.base import KVConnector
from kv_transfer.config import TransferConfig
from kv_transfer.factory import create_connector
from kv_transfer.fake import FakeRegistry
from kv_transfer.layout import KVLayout, fingerprint, must_match_fields
from kv_transfer.shards import CacheShard
from node.metrics import MeteredConnector, TransferMeter


def kv_layout(engine: LLMEngine) -> KVLayout:
    """What a transfer peer must agree on with this engine (layout, model, code version), and the
    KV heads of each of its tensor-parallel ranks."""
    config = engine.config
    ranges = [(heads.start, heads.stop) for _, heads in engine.kv_cache_shards()] \
        if config.tensor_parallel_size > 1 else None
    fields = kv_layout_fields(config.model, engine.block_size, engine.block_pool.num_blocks,
                              model_fingerprint(config.model.model_dir), ranges)
    return KVLayout(**fields, code_version=f"pdserve-{protocol.PROTOCOL_VERSION}")


def kv_layout_info(layout: KVLayout) -> protocol.KVLayoutInfo:
    """The layout as nodes report it, for the proxy to pair only nodes that can exchange KV."""
    return protocol.KVLayoutInfo(fingerprint(layout), must_match_fields(layout))


def connector_for(engine: LLMEngine, config: TransferConfig, node_id: str,
                  fake_registry: FakeRegistry | None = None) -> KVConnector:
    """A connector over the engine's cache (see kv_transfer.factory.create_connector), metered
    (its pulls feed the node's /metrics: node.metrics); the node closes it when it stops."""
    shards = [CacheShard(cache, heads) for cache, heads in engine.kv_cache_shards()]
    connector = create_connector(config, shards, kv_layout(engine), node_id, fake_registry)
    labels = {"model_name": engine.config.model.name, "engine": node_id, "role": engine.config.role.value}
    return MeteredConnector(connector, TransferMeter(labels, sum(s.cache[0].nbytes for s in shards), len(shards)))
