"""KV reads of GPU memory between two processes on one GPU, as a decode node pulls from a prefill node
there: GB/s and the transport, as nodes read (device copies over CUDA IPC), through UCX under the
nodes' UCX settings, and under the UCX settings before them.

Each setting runs in fresh processes (UCX reads its settings when it loads): a holder process
with a block-major bfloat16 cache of llama-1b's KV shape on the GPU (16 layers, 8 KV heads of 64:
512 KiB a block of 16 tokens), and a reader process (this script with --reader) that pulls 256 MiB
(512 blocks, scattered on the reader's side: a descriptor each) --repeats times through the NixlConnector
and reports the median GB/s (the read confirmed, as a node uses it) and the transfer's own time (until
the confirmation is sent), the descriptors, connector.transport, and checks that the blocks read are
the holder's (it draws its cache from seed 0; the reader draws the same). Every setting but before also
reads the same blocks into contiguous ones (one descriptor, one copy): what scattering costs. A setting
fails on wrong data, and every one but before where UCX fell back to TCP for GPU memory. Settings:
  pdserve   the nodes' own choice: both caches on one GPU, so device copies over CUDA IPC
            (kv_transfer/cuda_ipc.py); on host memory, as ucx
  ucx       through UCX under the nodes' UCX settings (kv_transfer/ucx.py: lo, GET over cuda_ipc
            enabled), as nodes with --kv-device-copy off read
  ucx-poll  as ucx, with UCX's cuda_ipc transport reaping up to 256 finished copies a progress call
            (UCX_CUDA_IPC_MAX_POLL; 16 by default)
  ucx-streams  as ucx, with up to 64 CUDA streams per device for its copies (UCX_CUDA_IPC_MAX_STREAMS)
  before    UCX_NET_DEVICES=lo alone, GET over cuda_ipc left to UCX (what nodes set before)
Ends with `RESULT {json}`. --device cpu --blocks 16 checks the script on host memory.

    python3 benchmarks/kv_transfer_gpu.py [--blocks 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # before benchmarks/: its kv_transfer.py is not the package

# NOTE: ucx-poll and ucx-streams: whether UCX's own knobs lift its cuda_ipc READ of 512 KiB descriptors
# (8-12 GB/s on an H200 at c0e8b24) toward a copy's rate, as NIXL alone must between GPUs it cannot map.
SETTINGS = {"pdserve": {}, "ucx": {}, "ucx-poll": {"UCX_CUDA_IPC_MAX_POLL": "256"},
            "ucx-streams": {"UCX_CUDA_IPC_MAX_STREAMS": "64"},
            "before": {"UCX_NET_DEVICES": "lo", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto"}}
DEVICE_COPY = {"pdserve"}  # the settings whose reader copies from a holder on its host (--kv-device-copy auto)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--reader", action="store_true", help="(internal) run one setting's reader")
    parser.add_argument("--contiguous", action="store_true", help="(internal) also into contiguous blocks")
    parser.add_argument("--device-copy", action="store_true", help="(internal) copies from a holder on this host")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per setting")
    return parser.parse_args()


def layout_for(num_blocks: int):
    from kv_transfer.layout import KVLayout

    # NOTE: twice the blocks: the reader's land on every other block, as in a busy cache.
    return KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, block_size=16, dtype="bfloat16",
                    num_blocks=2 * num_blocks, model_fingerprint="kv-gpu-bench", code_version="1")


def _cpu_benchmark():
    """benchmarks/kv_transfer.py (its holder process and timed read), loaded by path: its module
    name is the kv_transfer package's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kv_transfer_bench", REPO / "benchmarks" / "kv_transfer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reader(args: argparse.Namespace) -> int:
    import torch

    from kv_transfer.config import TransferConfig
    from kv_transfer.factory import create_connector
    bench = _cpu_benchmark()
    read_once, start_holder = bench.read_once, bench.start_holder
    layout = layout_for(args.blocks)
    os.environ["KV_BENCH_STORAGE"], os.environ["KV_BENCH_DEVICE"] = "block", args.device
    # The holder's own errors go to a file shown in this reader's on failure (not to its stderr: the
    # holder, in a session of its own, would keep the caller's pipe open past this reader's end).
    with tempfile.TemporaryFile(mode="w+") as holder_log:
        holder = connector = None
        try:
            holder = start_holder("nixl", layout=layout, stderr=holder_log)
            shape = (layout.num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads,
                     layout.head_dim)
            cache = torch.zeros(shape, dtype=torch.bfloat16, device=args.device)
            connector = create_connector(TransferConfig(backend="nixl", host="127.0.0.1",
                                                        device_copy="auto" if args.device_copy else "off"),
                                         cache, layout, "reader")
            remote = list(range(args.blocks))
            variants = {"scattered": list(range(1, 2 * args.blocks, 2))}
            if args.contiguous:
                variants["contiguous"] = list(range(args.blocks, 2 * args.blocks))
            torch.manual_seed(0)  # the holder's cache (benchmarks/kv_transfer.py's HOLDER)
            expected = torch.randn(shape, dtype=torch.bfloat16, device=args.device)[remote]
            timed = {}
            for name, local in variants.items():
                transfer_s = []
                times = [read_once(connector, holder, f"{name}{i}", remote, local, transfer_s)
                         for i in range(args.repeats + 1)][1:]
                # NOTE: checked before the next variant's reads overwrite some of these blocks
                timed[name] = (times, transfer_s[1:], connector.num_descriptors_last_read,
                               torch.equal(cache[local], expected))
            for _ in range(50):  # the report is read at most once a second after a read
                if connector.transport is not None:
                    break
                connector._report_checked_at = 0.0
                connector._check_ucx_report()
                time.sleep(0.05)
            num_bytes = args.blocks * layout.block_numel * 2
            transport = connector.transport
            out = {}
            for name, (times, transfer_s, descriptors, is_equal) in timed.items():
                seconds = statistics.median(times)
                out[name] = {"gb_s": num_bytes / seconds / 1e9, "ms": 1e3 * seconds,
                             "transfer_ms": 1e3 * statistics.median(transfer_s) if transfer_s else None,
                             "descriptors": descriptors, "equal": is_equal}
            result = dict(out.pop("scattered"), bytes=num_bytes, transport=transport.transport if transport else None,
                          method=transport.method if transport else None,
                          tcp_fallback=transport.is_tcp_fallback if transport else None,
                          device_copy_reads=connector.num_device_copy_reads,
                          env={k: v for k, v in os.environ.items() if k.startswith("UCX_")})
            if "contiguous" in out:
                result["contiguous"] = out["contiguous"]
                result["equal"] = result["equal"] and out["contiguous"]["equal"]
            print(json.dumps(result), flush=True)
        except BaseException:
            holder_log.seek(0)
            print(f"holder's log:\n{holder_log.read()[-2000:]}", file=sys.stderr, flush=True)
            raise
        finally:
            if connector is not None:
                connector.close()
            if holder is not None:
                holder[0].kill()
                holder[0].wait()
    return 0


def _ms(value: float | None) -> str:
    return "unmeasured" if value is None else f"{value:.2f} ms"


def main() -> int:
    args = parse_args()
    if args.reader:
        from kv_transfer.ucx import exit_now

        try:
            code = reader(args)
        except Exception:  # noqa: BLE001 - any failure: its traceback, then the exit code
            traceback.print_exc()
            code = 1
        exit_now(code)  # NOTE: this process loaded NIXL, whose exit-time teardown is not safe (see there)
    results = {}
    for name in args.settings.split(","):
        env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
        env.update(SETTINGS[name])  # PYTHONPATH as given (the reader puts the repo first itself)
        argv = [sys.executable, __file__, "--reader", "--blocks", str(args.blocks), "--repeats", str(args.repeats),
                "--device", args.device, *(["--contiguous"] if name != "before" else []),
                *(["--device-copy"] if name in DEVICE_COPY else [])]
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout_s, cwd=REPO)
        except subprocess.TimeoutExpired:
            results[name] = {"error": f"timed out after {args.timeout_s:.0f} s"}
            print(f"{name}: timed out", flush=True)
            continue
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            results[name] = {"error": (proc.stderr or proc.stdout)[-800:]}
            print(f"{name}: failed\n{results[name]['error']}", flush=True)
            continue
        results[name] = json.loads(lines[-1])
        r = results[name]
        print(f"{name:>8}: {r['gb_s']:8.2f} GB/s ({r['ms']:.2f} ms for {r['bytes'] / 2**20:.0f} MiB, the transfer "
              f"{_ms(r['transfer_ms'])}, {r['descriptors']} descriptors) over {r['transport']} ({r['method']})"
              f"{'' if r['equal'] else '; WRONG DATA read'}", flush=True)
        if "contiguous" in r:
            c = r["contiguous"]
            print(f"{'':>8}  {c['gb_s']:8.2f} GB/s into contiguous blocks ({c['ms']:.2f} ms, the transfer "
                  f"{_ms(c['transfer_ms'])}, {c['descriptors']} descriptors)", flush=True)
        if name != "before" and r["tcp_fallback"] and args.device != "cpu":
            print(f"{name}: UCX fell back to TCP for GPU memory (failed)", flush=True)
        if name in DEVICE_COPY and args.device != "cpu" and not r["device_copy_reads"]:
            print(f"{name}: no read was a device copy (failed: see the reader's log)", flush=True)
    from benchmarks.results_io import write_result

    write_result("kv_transfer_gpu", {"device": args.device, "blocks": args.blocks, "settings": results})
    failed = [name for name, r in results.items() if "gb_s" not in r or not r["equal"]
              or (name != "before" and r["tcp_fallback"] and args.device != "cpu")
              or (name in DEVICE_COPY and args.device != "cpu" and not r["device_copy_reads"])]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
