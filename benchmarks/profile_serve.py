"""Where the time goes under load: py-spy samples every process of a local deployment (proxy,
prefill and decode nodes) while the serve_throughput load runs, and this script sums the
samples into a few named parts per process.

For each preset: start 1 prefill + 1 decode node (one core each) and the proxy, warm up, start
`py-spy record` on each process, send N requests of P prompt tokens / O output tokens all at
once, and report each process's busy share of the run and how its busy time splits. The raw
stacks stay in --out-dir (flamegraph-ready "collapsed" text). Ends with `RESULT {json}`.

    .venv/bin/python benchmarks/profile_serve.py --presets tiny,small
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdserve.bench import BenchConfig, DatasetConfig, EndpointConfig, LoadConfig, run_benchmark  # noqa: E402
from pdserve.default_model import ensure_model  # noqa: E402
from pdserve.launcher import start_local, wait_healthy  # noqa: E402

SAMPLE_RATE_HZ = 100
# Part name -> a substring of a stack frame; a sample counts for the first part it matches.
NODE_PARTS = {
    "matmuls (linear)": "linear (kernels/linear.py",
    "decode attention": "decode_attention",
    "prefill attention": "prefill_attention",
    "norms, rotary, activation, KV write": ("rms_norm", "apply_rotary", "silu_and_mul", "write_kv"),
    "sampler": "sample (engine/sampler.py",
    "batch preparation": "prepare (engine/runner.py",
    "scheduler": "schedule (engine/scheduler.py",
    "KV transfer (NIXL, leases)": ("nixl", "poll_transfers", "kv_transfer"),
    "sockets, reports": ("_receive_all", "send_step_outputs", "_send_heartbeats", "_record_load"),
}
# A sample whose innermost frame is one of these is a thread waiting, not working.
IDLE_LEAVES = ("wait (threading.py", "Poller.poll", "select (selectors.py", "poll (zmq", "sleep")
PROXY_PARTS = {
    "HTTP + SSE (uvicorn, h11, starlette)": ("h11", "starlette", "_SelectorSocketTransport"),
    "JSON encoding": ("json/", "_sse"),
    "detokenize, stop strings, logprobs": "proxy/choices.py",
    "request flow and routing": ("proxy/request_flow.py", "proxy/nodes.py"),
    "asyncio loop": "asyncio/",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out-dir", default=str(REPO / "benchmarks" / "out" / "profiles"))
    return parser.parse_args()


def model_dir_for(preset: str) -> Path:
    return ensure_model(REPO / ".cache" / "models" / f"{preset}-seed0", preset)


def profile_preset(preset: str, args: argparse.Namespace) -> dict:
    print(f"== {preset}", flush=True)
    model_dir = model_dir_for(preset)
    out_dir = Path(args.out_dir) / preset
    out_dir.mkdir(parents=True, exist_ok=True)
    deployment = start_local(model_dir, num_prefill=1, num_decode=1, log_dir=out_dir)
    try:
        wait_healthy(deployment, 300)
        config = BenchConfig(EndpointConfig(base_url=deployment.base_url, model=model_dir.name),
                             DatasetConfig(num_requests=args.num_requests, input_len=args.prompt_len,
                                           output_len=args.output_len),
                             LoadConfig(show_progress=False))
        run_benchmark(replace(config, dataset=replace(config.dataset, num_requests=2, output_len=2, seed=1)))
        spies = {name: _start_spy(proc.pid, out_dir / f"{name}.txt") for name, proc in deployment.cluster.procs}
        started = time.monotonic()
        bench = run_benchmark(config)
        for spy in spies.values():
            spy.send_signal(signal.SIGINT)  # py-spy writes its samples when interrupted
            spy.wait(timeout=60)
        elapsed_s = time.monotonic() - started
    finally:
        deployment.stop()
    result = {"preset": preset, "wall_s": bench.duration_s, "output_tok_s": bench.summary["output_throughput"],
              "processes": {}}
    for name in spies:
        parts = PROXY_PARTS if name == "proxy" else NODE_PARTS
        result["processes"][name] = split_samples(out_dir / f"{name}.txt", parts, elapsed_s)
    print_result(result)
    return result


def _start_spy(pid: int, out: Path) -> subprocess.Popen:
    argv = [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--rate", str(SAMPLE_RATE_HZ),
            "--format", "raw", "--output", str(out), "--nonblocking", "--duration", "600"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def split_samples(path: Path, parts: dict, elapsed_s: float) -> dict:
    """Busy share of the run (samples of non-idle threads over the run's length) and the
    share of busy samples in each part."""
    counts: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines() if path.exists() else []:
        stack, _, num = line.rpartition(" ")
        if any(wait in stack.rsplit(";", 1)[-1] for wait in IDLE_LEAVES):
            continue
        total += int(num)
        counts[_part_of(stack, parts)] += int(num)
    busy_s = total / SAMPLE_RATE_HZ
    return {"busy_s": busy_s, "busy_share": busy_s / elapsed_s if elapsed_s else 0.0,
            "parts": {part: counts[part] / total for part in (*parts, "other") if total}}


def _part_of(stack: str, parts: dict) -> str:
    for part, needles in parts.items():
        for needle in (needles,) if isinstance(needles, str) else needles:
            if needle in stack:
                return part
    return "other"


def print_result(result: dict) -> None:
    print(f"  {result['output_tok_s']:.1f} output tok/s, {result['wall_s']:.1f} s")
    for name, proc in result["processes"].items():
        print(f"  {name}: busy {proc['busy_s']:.1f} s ({100 * proc['busy_share']:.0f}% of a core)")
        for part, share in sorted(proc["parts"].items(), key=lambda item: -item[1]):
            if share >= 0.01:
                print(f"    {100 * share:5.1f}%  {part}")


def main() -> None:
    args = parse_args()
    results = [profile_preset(p, args) for p in args.presets.split(",")]
    print("RESULT " + json.dumps({"results": results}))


if __name__ == "__main__":
    main()
