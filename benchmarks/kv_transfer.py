"""KV transfer bandwidth: one prompt's KV (small preset's shape, float32) moved between two
processes by NIXL and by gloo, beside an in-process copy of the same bytes, in one run.

For 512, 2,048 and 8,192 tokens: GB/s, latency (median of repeats), the ratio to the in-process
copy (this machine's limit), and NIXL descriptors per transfer (after merging adjacent blocks).
The reader's blocks are scattered (every other block id) as in a busy cache; the holder's are
contiguous, as a fresh prefill allocates them. Ends with `RESULT {json}`.

    .venv/bin/python benchmarks/kv_transfer.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kv_transfer.cli import create_connector  # noqa: E402
from kv_transfer.config import TransferConfig  # noqa: E402
from kv_transfer.layout import KVLayout  # noqa: E402

BLOCK_SIZE = 16
TOKENS = (512, 2048, 8192)
REPEATS = 5
LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=BLOCK_SIZE, dtype="float32",
                  num_blocks=2 * 8192 // BLOCK_SIZE + 8, model_fingerprint="bench", code_version="1")
HOLDER = """
import json, sys, os, time, msgspec, torch
from kv_transfer.cli import create_connector
from kv_transfer.config import TransferConfig
from kv_transfer.layout import KVLayout
layout = msgspec.json.decode(sys.argv[1], type=KVLayout)
shape = (layout.num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
c = create_connector(TransferConfig(backend=sys.argv[2]), torch.randn(shape), layout, "holder")
print(json.dumps({"address": c.agent_address, "engine_id": c.engine_id}), flush=True)
sys.stdin.readline()
os._exit(0)
"""


def cache_shape() -> tuple[int, ...]:
    return (LAYOUT.num_blocks, LAYOUT.num_layers, 2, BLOCK_SIZE, LAYOUT.num_kv_heads, LAYOUT.head_dim)


def start_holder(backend: str):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, msgspec.json.encode(LAYOUT).decode(), backend],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{backend} holder ended")
        if line.startswith("{"):
            return proc, json.loads(line)


def read_once(connector, hello, request_id: str, remote: list[int], local: list[int]) -> float:
    start = time.perf_counter()
    connector.start_read(request_id, hello["engine_id"], hello["address"], remote, local)
    while True:
        results = connector.poll()
        if results:
            if not results[0].is_ok:
                raise RuntimeError(results[0].error)
            return time.perf_counter() - start


def bench_backend(backend: str) -> dict:
    print(f"== {backend}", flush=True)
    proc, hello = start_holder(backend)
    connector = create_connector(TransferConfig(backend=backend), torch.zeros(cache_shape()), LAYOUT, "reader")
    try:
        read_once(connector, hello, "warm", [0], [0])
        out = {}
        for tokens in TOKENS:
            num_blocks = tokens // BLOCK_SIZE
            remote = list(range(num_blocks))
            local = list(range(1, 2 * num_blocks, 2))
            times = [read_once(connector, hello, f"{tokens}-{i}", remote, local) for i in range(REPEATS)]
            seconds = statistics.median(times)
            out[tokens] = {"latency_ms": seconds * 1000, "gb_s": num_blocks * block_bytes() / seconds / 1e9,
                           "descriptors": getattr(connector, "num_descriptors_last_read", None)}
            print(f"  {tokens:>5} tokens: {out[tokens]['latency_ms']:8.2f} ms  {out[tokens]['gb_s']:6.2f} GB/s", flush=True)
        return out
    finally:
        connector.close()
        proc.kill()
        proc.wait()


def block_bytes() -> int:
    return LAYOUT.block_numel * 4


def bench_copy() -> dict:
    """The same bytes copied in-process, gathered from and scattered into scattered blocks."""
    print("== in-process copy", flush=True)
    src, dst = torch.randn(cache_shape()), torch.zeros(cache_shape())
    out = {}
    for tokens in TOKENS:
        num_blocks = tokens // BLOCK_SIZE
        remote = torch.arange(num_blocks)
        local = torch.arange(1, 2 * num_blocks, 2)
        dst[local] = src[remote]
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            dst[local] = src[remote]
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        out[tokens] = {"latency_ms": seconds * 1000, "gb_s": num_blocks * block_bytes() / seconds / 1e9}
        print(f"  {tokens:>5} tokens: {out[tokens]['latency_ms']:8.2f} ms  {out[tokens]['gb_s']:6.2f} GB/s", flush=True)
    return out


def main() -> None:
    copy = bench_copy()
    results = {"copy": copy, "nixl": bench_backend("nixl"), "gloo": bench_backend("gloo")}
    print(f"\n{'tokens':>6} {'MB':>7} | {'copy GB/s':>9} | {'NIXL GB/s':>9} {'ratio':>6} {'desc':>5} | {'gloo GB/s':>9} {'ratio':>6}")
    summary = []
    for tokens in TOKENS:
        mb = tokens // BLOCK_SIZE * block_bytes() / 1e6
        nixl, gloo, base = results["nixl"][tokens], results["gloo"][tokens], copy[tokens]["gb_s"]
        row = {"tokens": tokens, "megabytes": mb, "copy_gb_s": base, "nixl_gb_s": nixl["gb_s"],
               "nixl_ratio": nixl["gb_s"] / base, "nixl_latency_ms": nixl["latency_ms"],
               "nixl_descriptors": nixl["descriptors"], "gloo_gb_s": gloo["gb_s"], "gloo_ratio": gloo["gb_s"] / base,
               "gloo_latency_ms": gloo["latency_ms"]}
        summary.append(row)
        print(f"{tokens:>6} {mb:7.1f} | {base:9.2f} | {nixl['gb_s']:9.2f} {row['nixl_ratio']:6.2f} "
              f"{nixl['descriptors']:>5} | {gloo['gb_s']:9.2f} {row['gloo_ratio']:6.2f}")
    print("RESULT " + json.dumps({"block_bytes": block_bytes(), "rows": summary}))


if __name__ == "__main__":
    main()
