"""A stand-alone KV reader for the dead-holder test:
python reader.py BACKEND LAYOUT_JSON ADDRESS ENGINE_ID WARM_GENERATION.

Reads one block (the holder's lease "warm" on block 0, of the given generation) to warm up and
prints {"warm": ok}; waits for a line on stdin; then starts four reads (the holder is dead by
then), polls them, prints one JSON line of results and of the blocks still allocated, and
leaves through kv_transfer.ucx.exit_now (UCX's teardown after a dead peer aborts).
"""

import json
import sys
import time

import msgspec
import torch

from kv_transfer.base import RemoteLease
from kv_transfer.config import TransferConfig
from kv_transfer.factory import create_connector
from kv_transfer.layout import KVLayout
from kv_transfer.ucx import exit_now
from tests.kv_transfer.helpers import poll_until


def main() -> None:
    backend, layout_json, address, engine_id, warm_generation = sys.argv[1:6]
    layout = msgspec.json.decode(layout_json, type=KVLayout)
    shape = (layout.num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    config = TransferConfig(backend=backend, transfer_timeout_s=3.0, handshake_timeout_s=2.0)
    connector = create_connector(config, torch.zeros(shape), layout, "reader")
    connector.start_read("warm", RemoteLease(engine_id, address, [0], int(warm_generation), 600.0), [0])
    warm = poll_until(connector, {"warm"}, 20)
    print(json.dumps({"warm": bool(warm) and warm["warm"].is_ok}), flush=True)
    sys.stdin.readline()
    allocated = {}
    started = time.monotonic()
    for i in range(4):
        allocated[f"dead-{i}"] = [10 + 2 * i, 11 + 2 * i]  # what a node would have allocated
        lease = RemoteLease(engine_id, address, [1, 2], 100 + i, 600.0)
        connector.start_read(f"dead-{i}", lease, allocated[f"dead-{i}"])
    results = poll_until(connector, set(allocated), 10)
    for request_id, result in results.items():
        if not result.is_ok:
            del allocated[request_id]  # the node frees a failed read's blocks
    print(json.dumps({"failed": sorted(r for r, x in results.items() if not x.is_ok),
                      "errors": [x.error for x in results.values()], "seconds": time.monotonic() - started,
                      "still_allocated": allocated, "in_flight": connector.num_reads_in_flight}), flush=True)
    exit_now(0)


if __name__ == "__main__":
    main()
