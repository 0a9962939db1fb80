"""create_connector: the KVConnector a node's TransferConfig names, over the node's KV cache."""

from __future__ import annotations

import torch

from kv_transfer.base import KVConnector, new_engine_id
from kv_transfer.config import TransferConfig
from kv_transfer.fake import FakeConnector, FakeRegistry
from kv_transfer.layout import KVLayout
from kv_transfer.shards import CacheShard, as_shards


def create_connector(config: TransferConfig, kv_cache: torch.Tensor | list[CacheShard], layout: KVLayout,
                     node_id: str, fake_registry: FakeRegistry | None = None) -> KVConnector:
    """The connector for config.backend over this cache (or each tensor-parallel rank's:
    kv_transfer.shards); its engine id is unique per start.
    backend "nixl" first sets process-wide UCX defaults (set_ucx_defaults); "fake" needs the
    in-process fake_registry its peers share. Raises ValueError if that is missing."""
    engine_id = new_engine_id(node_id)
    if config.backend == "nixl":
        from kv_transfer.nixl_connector import NixlConnector, set_ucx_defaults

        ucx_log = set_ucx_defaults(config.public_host, on_gpu=as_shards(kv_cache)[0].cache.is_cuda)
        return NixlConnector(config, kv_cache, layout, engine_id, ucx_log)
    if config.backend == "fake":
        if fake_registry is None:
            raise ValueError("backend 'fake' needs a fake_registry shared with its peers")
        return FakeConnector(config, kv_cache, layout, engine_id, fake_registry)
    from kv_transfer.gloo_connector import GlooConnector

    return GlooConnector(config, kv_cache, layout, engine_id)
