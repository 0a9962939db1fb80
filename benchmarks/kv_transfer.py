"""KV transfer bandwidth: one prompt's KV (small preset's shape, float32) moved between two
processes by NIXL and by gloo, beside an in-process copy of the same bytes, in one run.

For 512, 2,048 and 8,192 tokens: GB/s, latency (median of repeats), the ratio to the in-process
copy (memcpy of the gathered blocks: this machine's limit), and NIXL descriptors per transfer.
The reader's blocks are scattered (every other block id) as in a busy cache; NIXL is also timed
into contiguous blocks. The holder's blocks are contiguous, as a fresh prefill allocates them.
Both caches are stored layer-major, as CPU engines store theirs (engine/kv_cache.py: a block's
layers are regions of their own, and the connector merges the regions adjacent on both sides,
so scattered blocks take one descriptor per block and layer, contiguous ones one per layer);
--block-major stores them block-major, as CUDA engines do (one descriptor per block, a
contiguous run one). Ends with `RESULT {json}`.

    .venv/bin/python benchmarks/kv_transfer.py [--veth] [--block-major]

--veth (root): also NIXL with the holder in a network namespace of its own, read across a veth
pair and a bridge (TCP, as between hosts), beside NIXL over loopback.
"""

from __future__ import annotations

import functools
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

from engine.config import CacheConfig  # noqa: E402
from engine.kv_cache import stored_layer_major  # noqa: E402
from engine.protocol import curve_keys  # noqa: E402
from kv_transfer.base import RemoteLease  # noqa: E402
from kv_transfer.config import TransferConfig  # noqa: E402
from kv_transfer.factory import create_connector  # noqa: E402
from kv_transfer.layout import KVLayout  # noqa: E402

BLOCK_SIZE = CacheConfig.block_size  # the engine's KV block size
TOKENS = (512, 2048, 8192)
REPEATS = 7
STORAGE = "block" if "--block-major" in sys.argv else "layer"
os.environ["KV_BENCH_STORAGE"] = STORAGE  # for the holder processes
LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=BLOCK_SIZE, dtype="float32",
                  num_blocks=2 * 8192 // BLOCK_SIZE + 8, model_fingerprint="bench", code_version="1")
HOLDER = """
import json, sys, os, time, msgspec, torch
from engine.kv_cache import stored_layer_major
from kv_transfer.config import TransferConfig
from kv_transfer.factory import create_connector
from kv_transfer.layout import KVLayout
from kv_transfer.lease import LeaseTable
from kv_transfer.ucx import exit_now
from engine.protocol import curve_keys
layout = msgspec.json.decode(sys.argv[1], type=KVLayout)
keys = curve_keys(sys.argv[4]) if len(sys.argv) > 4 else None
shape = (layout.num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
torch.manual_seed(0)  # a reader may draw the same cache to check what it read (kv_transfer_gpu.py)
cache = torch.randn(shape, dtype=getattr(torch, layout.dtype), device=os.environ.get("KV_BENCH_DEVICE", "cpu"))
if os.environ.get("KV_BENCH_STORAGE") == "layer":
    cache = stored_layer_major(cache)
ranges = json.loads(os.environ.get("KV_BENCH_HEAD_RANGES") or "[]")  # tensor-parallel ranks: a cache each
if ranges:
    from kv_transfer.shards import CacheShard
    def rank_cache(a, b):
        part = cache[..., a:b, :].contiguous()
        return part if cache.is_contiguous() else stored_layer_major(part)
    cache = [CacheShard(rank_cache(a, b), range(a, b)) for a, b in ranges]
    layout = msgspec.structs.replace(layout, kv_head_ranges=[tuple(r) for r in ranges])
c = create_connector(TransferConfig(backend=sys.argv[2], host=sys.argv[3], curve_keys=keys), cache, layout, "holder")
leases = LeaseTable(600.0)
c.serve_leases(leases)
print(json.dumps({"address": c.agent_address, "engine_id": c.engine_id}), flush=True)
for line in sys.stdin:  # `REQUEST_ID BLOCK_IDS_JSON`: hold a lease, answer its generation
    request_id, block_ids = line.split(maxsplit=1)
    print(json.dumps({"generation": leases.add(request_id, json.loads(block_ids))}), flush=True)
exit_now(0)
"""


def cache_shape() -> tuple[int, ...]:
    return (LAYOUT.num_blocks, LAYOUT.num_layers, 2, BLOCK_SIZE, LAYOUT.num_kv_heads, LAYOUT.head_dim)


# NOTE: beyond loopback the side channel needs a cluster secret (CURVE); this one is the bench's.
BENCH_SECRET = "kv-transfer-benchmark-secret"


def start_holder(backend: str, host: str = "127.0.0.1", wrap=list, layout: KVLayout = LAYOUT,
                 stderr=subprocess.DEVNULL):
    """The holder process (wrap(argv) may run it elsewhere, e.g. in a network namespace, with
    the bench's cluster secret); its cache on KV_BENCH_DEVICE (default cpu); stderr: where its
    own goes (None: this process's)."""
    secret = [] if host.startswith("127.") else [BENCH_SECRET]
    argv = wrap([sys.executable, "-c", HOLDER, msgspec.json.encode(layout).decode(), backend, host, *secret])
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # the given path kept
    proc = subprocess.Popen(argv,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": python_path}, start_new_session=True)
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{backend} holder ended")
        if line.startswith("{"):
            return proc, json.loads(line)


def read_once(connector, holder, request_id: str, remote: list[int], local: list[int],
              transfer_s: list[float] | None = None) -> float:
    """One pull, timed from posting the read to its confirmed result (the holder's lease is taken
    first, outside the timing, as the prefill node takes it when the prompt finishes). With
    transfer_s, also appends the time to the transfer's end (the confirmation sent: a
    SideChannelConnector's read then has one)."""
    proc, hello = holder
    proc.stdin.write(f"{request_id} {json.dumps(remote)}\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    while not line.startswith("{"):  # skip any log line the holder's libraries print
        line = proc.stdout.readline()
    generation = json.loads(line)["generation"]
    lease = RemoteLease(hello["engine_id"], hello["address"], remote, generation, 600.0)
    start = time.perf_counter()
    connector.start_read(request_id, lease, local)
    pending = getattr(connector, "_reads", {}).get(request_id)
    while True:
        results = connector.poll()
        if transfer_s is not None and pending is not None and pending.confirmation is not None:
            transfer_s.append(time.perf_counter() - start)
            pending = None
        if results:
            if not results[0].is_ok:
                raise RuntimeError(results[0].error)
            return time.perf_counter() - start


def bench_backend(backend: str, copies: dict, network=None) -> dict:
    """Per token count: the reader's blocks scattered and, for NIXL, contiguous (the connector
    merges adjacent regions: see the module docstring), to decide the descriptor scheme. Each
    repeat also times the in-process copy of the same bytes right before the reads, so machine
    noise hits both sides of the ratio alike. With network (a pdserve.netns.TestNetwork), the
    holder runs in its namespace and the reader reads across the veth link and bridge."""
    print(f"== {backend}{' across namespaces (veth)' if network else ''}", flush=True)
    if network is None:
        proc, hello = start_holder(backend)
        reader_host = "127.0.0.1"
    else:
        holder = network.hosts["holder"]
        proc, hello = start_holder(backend, holder.address, holder.command)
        reader_host = network.hosts["reader"].address
    keys = None if network is None else curve_keys(BENCH_SECRET)
    connector = create_connector(TransferConfig(backend=backend, host=reader_host, curve_keys=keys),
                                 stored(torch.full(cache_shape(), 0.5)), LAYOUT, "reader")
    try:
        read_once(connector, (proc, hello), "warm", [0], [0])
        out = {}
        for tokens in TOKENS:
            num_blocks = tokens // BLOCK_SIZE
            remote = list(range(num_blocks))
            layouts = {"scattered": list(range(1, 2 * num_blocks, 2))}
            if backend == "nixl":
                layouts["contiguous"] = list(range(num_blocks))
            times = {kind: [] for kind in ("copy", *layouts)}
            for i in range(REPEATS):
                times["copy"].append(copies[tokens]())
                for kind, local in layouts.items():
                    times[kind].append(read_once(connector, (proc, hello), f"{tokens}-{kind}-{i}", remote, local))
                    times[kind + "_descriptors"] = getattr(connector, "num_descriptors_last_read", None)
            out[tokens] = {kind: _row(times[kind], num_blocks, times[kind + "_descriptors"]) for kind in layouts}
            out[tokens]["copy"] = _row(times["copy"], num_blocks, None)
            for kind in layouts:
                row = out[tokens][kind]
                print(f"  {tokens:>5} tokens, {kind:>10}: {row['latency_ms']:8.2f} ms  {row['gb_s']:6.2f} GB/s  "
                      f"{row['descriptors']} descriptors (copy beside it: {out[tokens]['copy']['gb_s']:.2f} GB/s)",
                      flush=True)
        return out
    finally:
        connector.close()
        proc.kill()
        proc.wait()


def _row(times: list[float], num_blocks: int, descriptors) -> dict:
    seconds = statistics.median(times)
    return {"latency_ms": seconds * 1000, "gb_s": num_blocks * block_bytes() / seconds / 1e9,
            "descriptors": descriptors}


def stored(cache: torch.Tensor) -> torch.Tensor:
    """The cache stored as this run's engines store theirs (see the module docstring)."""
    return cache if STORAGE == "block" else stored_layer_major(cache)


def block_bytes() -> int:
    return LAYOUT.block_numel * 4


def bench_copy() -> tuple[dict, dict]:
    """The same bytes in-process: memcpy of the gathered blocks into a preallocated buffer (the
    machine's copy bandwidth, the baseline of the ratios), and block-to-block gather-scatter.
    Returns the figures and, per token count, a function timing one memcpy (for the backends
    to repeat beside their reads)."""
    print("== in-process copy", flush=True)
    src, dst = torch.randn(cache_shape()), torch.full(cache_shape(), 0.5)
    out, copies = {}, {}
    for tokens in TOKENS:
        num_blocks = tokens // BLOCK_SIZE
        remote, local = torch.arange(num_blocks), torch.arange(1, 2 * num_blocks, 2)
        gathered, staging = src[remote], torch.empty_like(src[remote])
        copies[tokens] = functools.partial(_time_once, functools.partial(staging.copy_, gathered))
        memcpy = median_seconds(functools.partial(staging.copy_, gathered))
        scatter = median_seconds(
            lambda local=local, remote=remote, staging=staging:
                dst.index_copy_(0, local, torch.index_select(src, 0, remote, out=staging)))
        out[tokens] = {"latency_ms": memcpy * 1000, "gb_s": gathered.nbytes / memcpy / 1e9,
                       "gather_scatter_gb_s": gathered.nbytes / scatter / 1e9}
        print(f"  {tokens:>5} tokens: memcpy {out[tokens]['latency_ms']:8.2f} ms  {out[tokens]['gb_s']:6.2f} GB/s; "
              f"gather+scatter {out[tokens]['gather_scatter_gb_s']:6.2f} GB/s", flush=True)
    return out, copies


def _time_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_seconds(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)  # one core per process, as for the two transfer processes
    copy, copies = bench_copy()
    # NOTE: across namespaces first: the first loopback connector pins this process's UCX to the
    # lo device (set_ucx_defaults), after which no other interface would be tried.
    veth = bench_veth(copies) if "--veth" in sys.argv else None
    results = {"nixl": bench_backend("nixl", copies), "gloo": bench_backend("gloo", copies)}
    print(f"\n{'tokens':>6} {'MB':>6} | {'copy':>5} {'g+s':>5} | {'NIXL':>5} {'ratio':>5} {'ms':>6} {'desc':>4} "
          f"| {'NIXL1':>5} {'ratio':>5} {'desc':>4} | {'gloo':>5} {'ratio':>5} {'ms':>6}   (GB/s; ratio to copy)")
    summary = []
    for tokens in TOKENS:
        summary.append(summary_row(tokens, copy[tokens], results["nixl"][tokens], results["gloo"][tokens]))
        r = summary[-1]
        print(f"{tokens:>6} {r['megabytes']:6.1f} | {r['copy_gb_s']:5.2f} {r['gather_scatter_gb_s']:5.2f} | "
              f"{r['nixl_gb_s']:5.2f} {r['nixl_ratio']:5.2f} {r['nixl_latency_ms']:6.1f} {r['nixl_descriptors']:>4} | "
              f"{r['nixl_contiguous_gb_s']:5.2f} {r['nixl_contiguous_ratio']:5.2f} "
              f"{r['nixl_contiguous_descriptors']:>4} | "
              f"{r['gloo_gb_s']:5.2f} {r['gloo_ratio']:5.2f} {r['gloo_latency_ms']:6.1f}")
    if veth is not None:
        print("\nNIXL across namespaces (veth + bridge, TCP) vs loopback, scattered blocks:")
        for tokens in TOKENS:
            row = veth[tokens]
            print(f"{tokens:>6} tokens: veth {row['veth_gb_s']:5.2f} GB/s ({row['veth_latency_ms']:6.1f} ms), "
                  f"loopback {row['loopback_gb_s']:5.2f} GB/s: ratio {row['veth_to_loopback']:.2f}")
    from results_io import write_result

    write_result("kv_transfer", {"block_bytes": block_bytes(), "storage": STORAGE, "rows": summary, "veth": veth})


def bench_veth(copies: dict) -> dict:
    """NIXL with holder and reader in network namespaces of their own (UCX in the root namespace
    does not use a bridge), beside NIXL over loopback run right after in this process."""
    from pdserve.netns import TestNetwork

    with TestNetwork(["holder", "reader"]) as network:
        argv = network.hosts["reader"].command(
            [sys.executable, __file__, "--veth-reader", network.hosts["holder"].name,
             network.hosts["holder"].address, network.hosts["reader"].address])
        out = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=REPO, check=True)
        print(out.stdout, end="", flush=True)
        across = {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1].removeprefix("VETH "))
                  .items()}
    loopback = bench_backend("nixl", copies)
    return {tokens: {"veth_gb_s": across[tokens]["scattered"]["gb_s"],
                     "veth_latency_ms": across[tokens]["scattered"]["latency_ms"],
                     "loopback_gb_s": loopback[tokens]["scattered"]["gb_s"],
                     "veth_to_loopback": across[tokens]["scattered"]["gb_s"] / loopback[tokens]["scattered"]["gb_s"]}
            for tokens in TOKENS}


def veth_reader(holder_namespace: str, holder_address: str, reader_address: str) -> None:
    """The reader side of bench_veth, run inside the reader's namespace: prints `VETH {json}`."""
    from pdserve.netns import TestHost

    class _Network:  # what bench_backend reads of a TestNetwork
        hosts = {"holder": TestHost(holder_namespace, holder_address), "reader": TestHost("", reader_address)}

    copies = {tokens: (lambda: 1.0) for tokens in TOKENS}  # no copy baseline needed across hosts
    print("VETH " + json.dumps(bench_backend("nixl", copies, _Network())), flush=True)


def summary_row(tokens: int, copy: dict, nixl: dict, gloo: dict) -> dict:
    """Ratios to the copy timed beside each backend's reads (copy_gb_s: the one beside NIXL)."""
    scattered, contiguous = nixl["scattered"], nixl["contiguous"]
    base = nixl["copy"]["gb_s"]
    return {"tokens": tokens, "megabytes": tokens // BLOCK_SIZE * block_bytes() / 1e6, "copy_gb_s": base,
            "copy_latency_ms": nixl["copy"]["latency_ms"], "gather_scatter_gb_s": copy["gather_scatter_gb_s"],
            "nixl_gb_s": scattered["gb_s"], "nixl_ratio": scattered["gb_s"] / base,
            "nixl_latency_ms": scattered["latency_ms"], "nixl_descriptors": scattered["descriptors"],
            "nixl_contiguous_gb_s": contiguous["gb_s"], "nixl_contiguous_ratio": contiguous["gb_s"] / base,
            "nixl_contiguous_latency_ms": contiguous["latency_ms"],
            "nixl_contiguous_descriptors": contiguous["descriptors"],
            "gloo_gb_s": gloo["scattered"]["gb_s"], "gloo_ratio": gloo["scattered"]["gb_s"] / gloo["copy"]["gb_s"],
            "gloo_latency_ms": gloo["scattered"]["latency_ms"]}


if __name__ == "__main__":
    from kv_transfer.ucx import exit_now

    if "--veth-reader" in sys.argv:
        veth_reader(*sys.argv[sys.argv.index("--veth-reader") + 1:][:3])
    else:
        import argparse

        parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--veth", action="store_true", help="also NIXL across a veth pair (root)")
        parser.add_argument("--block-major", action="store_true", help="caches stored block-major (as on CUDA)")
        parser.parse_args()  # NOTE: STORAGE and main() read the flags from sys.argv
        main()
    exit_now(0)  # NOTE: this process loaded NIXL, whose exit-time teardown is not safe (see there)
