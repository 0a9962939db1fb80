"""KV reads between nodes of different tensor-parallel splits, over NIXL between two processes:
what reading a part of a rank's KV heads costs against reading whole ranks.

The small preset's KV (30 layers, 3 KV heads, float32), both caches stored layer-major as CPU
engines store theirs (--block-major: as CUDA engines do), 2,048 tokens into contiguous blocks, for
holder:reader splits 1:1 and 3:3 (each rank's heads whole on both sides: the runs merge as in a
one-rank read) and 1:3 and 3:1 (each reader rank's heads a part of a holder rank's, or the other
way: one run per block, layer, K/V and token; kv_transfer/shards.py). Per split: the median
latency of --repeats reads, GB/s, NIXL descriptors per read, and the ratio to 1:1 in the same run.
Ends with `RESULT {json}`.

    .venv/bin/python benchmarks/kv_transfer_tp.py [--block-major] [--tokens 2048] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import msgspec
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import kv_transfer  # noqa: E402
from benchmarks.results_io import write_result  # noqa: E402
from kv_transfer.config import TransferConfig  # noqa: E402
from kv_transfer.factory import create_connector  # noqa: E402
from kv_transfer.shards import CacheShard  # noqa: E402

SPLITS = {"1:1": ([(0, 3)], [(0, 3)]), "3:3": ([(0, 1), (1, 2), (2, 3)], [(0, 1), (1, 2), (2, 3)]),
          "1:3": ([(0, 3)], [(0, 1), (1, 2), (2, 3)]), "3:1": ([(0, 1), (1, 2), (2, 3)], [(0, 3)])}


def reader_cache(ranges: list[tuple[int, int]], block_major: bool) -> list[CacheShard]:
    layout = kv_transfer.LAYOUT
    shards = []
    for start, stop in ranges:
        cache = torch.full((layout.num_blocks, layout.num_layers, 2, layout.block_size, stop - start,
                            layout.head_dim), 0.5)
        shards.append(CacheShard(cache if block_major else kv_transfer.stored_layer_major(cache), range(start, stop)))
    return shards


def bench_split(name: str, tokens: int, repeats: int, block_major: bool) -> dict:
    holder_ranges, reader_ranges = SPLITS[name]
    os.environ["KV_BENCH_HEAD_RANGES"] = json.dumps(holder_ranges if len(holder_ranges) > 1 else [])
    holder = kv_transfer.start_holder("nixl")
    layout = msgspec.structs.replace(kv_transfer.LAYOUT, kv_head_ranges=reader_ranges if len(reader_ranges) > 1
                                     else [])
    shards = reader_cache(reader_ranges, block_major)
    connector = create_connector(TransferConfig(backend="nixl"), shards if len(shards) > 1 else shards[0].cache,
                                 layout, "reader")
    try:
        blocks = list(range(tokens // kv_transfer.BLOCK_SIZE))
        kv_transfer.read_once(connector, holder, "warm", [0], [0])
        times = [kv_transfer.read_once(connector, holder, f"{name}-{i}", blocks, blocks) for i in range(repeats)]
        seconds = statistics.median(times)
        row = {"latency_ms": 1000 * seconds, "gb_s": len(blocks) * kv_transfer.block_bytes() / seconds / 1e9,
               "descriptors": connector.num_descriptors_last_read, "times_ms": [1000 * t for t in times]}
    finally:
        connector.close()
        holder[0].kill()
        holder[0].wait()
    print(f"  {name}: {row['latency_ms']:8.2f} ms  {row['gb_s']:6.2f} GB/s  {row['descriptors']} descriptors",
          flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--block-major", action="store_true")
    args = parser.parse_args(argv)
    rows = {name: bench_split(name, args.tokens, args.repeats, args.block_major) for name in SPLITS}
    for row in rows.values():
        row["latency_over_1_1"] = row["latency_ms"] / rows["1:1"]["latency_ms"]
    write_result("kv_transfer_tp", {"tokens": args.tokens, "repeats": args.repeats,
                                    "storage": "block" if args.block_major else "layer",
                                    "layout": {"num_layers": kv_transfer.LAYOUT.num_layers,
                                               "num_kv_heads": kv_transfer.LAYOUT.num_kv_heads,
                                               "head_dim": kv_transfer.LAYOUT.head_dim, "dtype": "float32"},
                                    "splits": rows})
    return 0


if __name__ == "__main__":
    from kv_transfer.ucx import exit_now

    exit_now(main())  # NOTE: this process loaded NIXL, whose exit-time teardown is not safe (see there)
