"""Where the time goes under load: the CPU each process of a local 1 prefill + 1 decode
deployment (one core each) and the load generator use during one run, and, with py-spy, how each
process's busy time splits into a few named parts.

For each preset: start the deployment, warm up, send N requests of P prompt tokens / O output
tokens all at once (rate inf), and report
- each process's CPU seconds over the run (/proc: user + system, all threads) and the load
  generator's (this process), against the run's core-seconds (wall time x the cores it had): on a
  machine whose cores the nodes keep busy, the run's rate is the work's total over the cores;
- the tail: from the last request's first token to the last token, when the decode node steps
  alone (on the prefill node's cores too where it borrows them) through shrinking batches;
- the prompts the proxy sent to the decode node's own prefill;
- with py-spy (the default; --no-spy for the CPU accounting alone: py-spy's own sampling takes
  CPU on the same cores, reported as such): each process's busy share and its parts. The raw stacks stay in
  --out-dir (flamegraph-ready "collapsed" text). Ends with `RESULT {json}`.

    .venv/bin/python benchmarks/profile_serve.py --presets tiny,small [--dtype bfloat16] [--no-spy]
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.cpu_time import own_cpu_s, process_cpu_s  # noqa: E402
from benchmarks.serve_throughput import scrape_counters  # noqa: E402
from pdserve.bench import BenchConfig, DatasetConfig, EndpointConfig, LoadConfig, run_benchmark  # noqa: E402
from pdserve.default_model import ensure_model  # noqa: E402
from pdserve.launcher import start_local, wait_healthy  # noqa: E402

SAMPLE_RATE_HZ = 100
# Part name -> a substring of a stack frame; a sample counts for the first part it matches.
NODE_PARTS = {
    "decode-only steps' layers (one C call: matmuls, attention, the rest)": "kernels/cpu/decode_layers.py",
    "matmuls (linear)": ("linear (kernels/cpu/linear.py", "_linear (kernels/"),
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
    "request flow and routing": ("proxy/request_flow.py", "proxy/nodes.py", "proxy/node_client.py"),
    "asyncio loop": "asyncio/",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="the nodes' --dtype (default: theirs)")
    parser.add_argument("--no-spy", action="store_true", help="the CPU accounting alone, without py-spy")
    parser.add_argument("--out-dir", default=str(REPO / "benchmarks" / "out" / "profiles"))
    return parser.parse_args()


def model_dir_for(preset: str) -> Path:
    return ensure_model(REPO / ".cache" / "models" / f"{preset}-seed0", preset)


def profile_preset(preset: str, args: argparse.Namespace) -> dict:
    print(f"== {preset}", flush=True)
    model_dir = model_dir_for(preset)
    out_dir = Path(args.out_dir) / preset
    out_dir.mkdir(parents=True, exist_ok=True)
    node_args = ["--dtype", args.dtype] if args.dtype else []
    deployment = start_local(model_dir, num_prefill=1, num_decode=1, node_args=node_args, log_dir=out_dir)
    spies: dict[str, subprocess.Popen] = {}
    try:
        wait_healthy(deployment, 300)
        config = BenchConfig(EndpointConfig(base_url=deployment.base_url, model=model_dir.name),
                             DatasetConfig(num_requests=args.num_requests, input_len=args.prompt_len,
                                           output_len=args.output_len),
                             LoadConfig(show_progress=False))
        run_benchmark(replace(config, dataset=replace(config.dataset, num_requests=2, output_len=2, seed=1)))
        if not args.no_spy:
            spies = {name: _start_spy(proc.pid, out_dir / f"{name}.txt") for name, proc in deployment.cluster.procs}
        counters_before = scrape_counters(deployment.base_url)
        cpu_before = {name: process_cpu_s(proc.pid) for name, proc in deployment.cluster.procs}
        client_before = own_cpu_s()
        started = time.monotonic()
        bench = run_benchmark(config)
        elapsed_s = time.monotonic() - started
        cpu_s = {name: process_cpu_s(proc.pid) - cpu_before[name] for name, proc in deployment.cluster.procs}
        cpu_s["load generator"] = own_cpu_s() - client_before
        local_prefills = scrape_counters(deployment.base_url)["local_prefills"] - counters_before["local_prefills"]
        if spies:  # their sampling runs on the same cores
            cpu_s["py-spy"] = sum(process_cpu_s(spy.pid) for spy in spies.values())
        for spy in spies.values():
            spy.send_signal(signal.SIGINT)  # py-spy writes its samples when interrupted
            spy.wait(timeout=60)
    finally:
        deployment.stop()
    result = {"preset": preset, "dtype": args.dtype, "spied": not args.no_spy, "wall_s": bench.duration_s,
              "output_tok_s": bench.summary["output_throughput"], "num_failed": bench.summary["num_failed"],
              **accounting(cpu_s, bench.duration_s, len(os.sched_getaffinity(0))),
              "tail_s": tail_seconds(bench.records), "local_prefills": local_prefills, "processes": {}}
    for name in spies:
        parts = PROXY_PARTS if name == "proxy" else NODE_PARTS
        result["processes"][name] = split_samples(out_dir / f"{name}.txt", parts, elapsed_s)
    print_result(result)
    return result


def accounting(cpu_s: dict[str, float], wall_s: float, num_cores: int) -> dict:
    """Each process's CPU seconds and its share of the run's core-seconds (wall x cores), and
    the share no process used (idle)."""
    core_s = wall_s * num_cores
    return {"num_cores": num_cores, "core_s": core_s, "cpu_s": cpu_s,
            "cpu_share": {name: seconds / core_s for name, seconds in cpu_s.items()} if core_s else {},
            "idle_share": max(0.0, 1.0 - sum(cpu_s.values()) / core_s) if core_s else 0.0}


def tail_seconds(records) -> float | None:
    """From the last first token of the run to its last token (None without a finished request)."""
    done = [r for r in records if r.is_ok]
    if not done:
        return None
    return max(r.end_s for r in done) - max(r.start_s + r.ttft_s for r in done)


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
    print(f"  {result['output_tok_s']:.1f} output tok/s, {result['wall_s']:.1f} s, {result['num_cores']} cores: "
          f"{result['core_s']:.1f} core-seconds; tail {result['tail_s'] or 0:.2f} s; "
          f"{result['local_prefills']:.0f} prompts prefilled on the decode node")
    for name, seconds in result["cpu_s"].items():
        print(f"  {name}: {seconds:.2f} CPU s ({100 * result['cpu_share'][name]:.1f}% of the core-seconds)")
    print(f"  idle: {100 * result['idle_share']:.1f}%")
    for name, proc in result["processes"].items():
        print(f"  {name}: busy {proc['busy_s']:.1f} s ({100 * proc['busy_share']:.0f}% of a core)")
        for part, share in sorted(proc["parts"].items(), key=lambda item: -item[1]):
            if share >= 0.01:
                print(f"    {100 * share:5.1f}%  {part}")


def main() -> None:
    args = parse_args()
    results = [profile_preset(p, args) for p in args.presets.split(",")]
    from results_io import write_result

    write_result("profile_serve", {"results": results})


if __name__ == "__main__":
    main()
