"""A stand-alone KV holder process for tests: python peer.py BACKEND SEED LAYOUT_JSON [PORT [SECRET]]
(PEER_STORAGE=layer in the environment: the cache stored layer-major, as engine/kv_cache.py
stores a CPU engine's; PEER_DEVICE=cuda: on the GPU, as a GPU engine's; PEER_HEAD_RANGES=[[start,
stop], ...]: the same values held by tensor-parallel ranks, a cache each holding those KV heads,
kv_transfer.shards).

Fills an engine-shaped cache with seeded random floats, serves it, prints its address and
engine id as one JSON line. Then, for each line `lease REQUEST_ID [BLOCK_IDS]` on stdin, holds a
lease on those blocks and prints {"leased": id, "generation": g}; for `expire REQUEST_ID` it
ends the lease as an expiry would, overwrites its blocks (as reuse would) and prints
{"expired": id}; it prints {"released": id} for each lease a reader ended. Stops when stdin
closes.
"""

import json
import os
import queue
import sys
import threading
import time

import msgspec
import torch

from engine.kv_cache import stored_layer_major
from engine.protocol import curve_keys
from kv_transfer.config import TransferConfig
from kv_transfer.factory import create_connector
from kv_transfer.layout import KVLayout
from kv_transfer.lease import LeaseTable
from kv_transfer.shards import CacheShard


def read_commands(commands: queue.SimpleQueue) -> None:
    for line in sys.stdin:
        commands.put(line.split(maxsplit=2))
    commands.put(None)


def main() -> None:
    backend, seed = sys.argv[1], int(sys.argv[2])
    layout = msgspec.json.decode(sys.argv[3], type=KVLayout)
    shape = (layout.num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    cache = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(os.environ.get("PEER_DEVICE", "cpu"))
    if os.environ.get("PEER_STORAGE") == "layer":  # the same values stored layer-major, as a CPU engine's
        cache = stored_layer_major(cache)
    caches = [cache]
    ranges = [range(a, b) for a, b in json.loads(os.environ.get("PEER_HEAD_RANGES") or "[]")]
    if ranges:
        caches = [CacheShard(_rank_copy(cache, heads), heads) for heads in ranges]
        layout = msgspec.structs.replace(layout, kv_head_ranges=[(r.start, r.stop) for r in ranges])
    port = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    keys = curve_keys(sys.argv[5]) if len(sys.argv) > 5 else None
    config = TransferConfig(backend=backend, side_channel_port=port, curve_keys=keys)
    connector = create_connector(config, caches if len(caches) > 1 else cache, layout, "holder")
    leases = LeaseTable(600.0)
    connector.serve_leases(leases)
    print(json.dumps({"address": connector.agent_address, "engine_id": connector.engine_id}), flush=True)
    commands: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=read_commands, args=(commands,), daemon=True).start()
    try:
        while True:
            while not commands.empty():
                command = commands.get()
                if command is None:
                    return
                if command[0] == "lease":
                    generation = leases.add(command[1], json.loads(command[2]))
                    print(json.dumps({"leased": command[1], "generation": generation}), flush=True)
                elif command[0] == "expire":
                    ended = leases.release(command[1])
                    for shard in caches:
                        (shard.cache if isinstance(shard, CacheShard) else shard)[ended] = -1.0
                    print(json.dumps({"expired": command[1]}), flush=True)
            for request_id, _ in leases.pop_ended():
                print(json.dumps({"released": request_id}), flush=True)
            time.sleep(0.002)
    finally:
        connector.close()


def _rank_copy(cache: torch.Tensor, heads: range) -> torch.Tensor:
    """A rank's own cache of heads, stored as cache is (block- or layer-major)."""
    part = cache[..., heads.start : heads.stop, :].contiguous()
    return stored_layer_major(part) if not cache.is_contiguous() else part


if __name__ == "__main__":
    main()
