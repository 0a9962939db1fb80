"""A stand-alone KV holder process for tests: python peer.py BACKEND SEED LAYOUT_JSON [PORT].

Fills an engine-shaped cache with seeded random floats, serves it, prints its address and
engine id as one JSON line, then prints each released request id until stdin closes.
"""

import json
import sys
import time

import msgspec
import torch

from kv_transfer.config import TransferConfig
from kv_transfer.factory import create_connector
from kv_transfer.layout import KVLayout


def main() -> None:
    backend, seed = sys.argv[1], int(sys.argv[2])
    layout = msgspec.json.decode(sys.argv[3], type=KVLayout)
    shape = (layout.num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    cache = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    port = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    connector = create_connector(TransferConfig(backend=backend, side_channel_port=port), cache, layout, "holder")
    print(json.dumps({"address": connector.agent_address, "engine_id": connector.engine_id}), flush=True)
    try:
        while True:
            for request_id in connector.poll_released():
                print(json.dumps({"released": request_id}), flush=True)
            time.sleep(0.002)
    finally:
        connector.close()


if __name__ == "__main__":
    main()
