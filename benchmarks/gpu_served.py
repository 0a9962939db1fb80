"""Served on GPUs: 1 prefill + 1 decode node against one colocated node, same model, same load.

`pdserve up`'s own launcher (pdserve.launcher.start_local) starts each setup with the GPU plan
`pdserve up` makes (nodes spread over the visible GPUs; two nodes on one GPU split its memory):
  colocated  --prefill 0 --decode 1
  1P+1D      --prefill 1 --decode 1, NIXL, every prompt prefilled on the prefill node
             (--local-prefill-min-wait-s -1), so every request's KV is pulled
The load is `pdserve bench`'s: --num-requests prompts of --prompt-len random tokens ->
--output-len tokens (ignore_eos), streamed, all at once (rate inf). Reported per setup: output
tokens/s, TTFT and TPOT p50/p99, failures; for 1P+1D also the decode node's pulls (count, bytes,
mean seconds, GB/s = bytes / pull seconds), its KV fallbacks, and the transport UCX reported
(pdserve_kv_transport_info). The proxy's and the load generator's CPU over the run are reported as
shares of one core: either near 1 means the run measured that process, not the nodes (the
proxy is one asyncio process: benchmarks/proxy_capacity.py). Greedy outputs of 16 prompts
through both setups are compared.
Ends with `RESULT {json}`; --budget-s bounds the whole run (a setup that would not fit is skipped).

    python3 benchmarks/gpu_served.py [--model DIR] [--num-requests 256] [--budget-s 200]

--device cpu with a small model checks the script without a GPU.
"""

from __future__ import annotations

import argparse
import resource
import signal
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.cpu_time import process_cpu_s  # noqa: E402
from benchmarks.results_io import write_result  # noqa: E402
from pdserve.bench import BenchConfig, DatasetConfig, EndpointConfig, LoadConfig, run_benchmark  # noqa: E402
from pdserve.gpus import gpu_plan, visible_gpus  # noqa: E402
from pdserve.launcher import start_local, wait_healthy  # noqa: E402
from pdserve.make_model import make_model  # noqa: E402

SETUPS = {"colocated": 0, "1P+1D": 1}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / ".cache" / "models" / "llama-1b-bf16"),
                        help="made here (llama-1b, --dtype) when missing; gpu_engine.py makes the same one")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--log-dir", default=str(REPO / "benchmarks" / "out" / "gpu_served"))
    return parser.parse_args()


def node_args(args: argparse.Namespace) -> list[str]:
    return ["--dtype", args.dtype, "--device", args.device, "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--transfer-backend", "nixl",
            "--max-model-len", str(args.prompt_len + args.output_len + 64)]


def load(base_url: str, model: str, args: argparse.Namespace, num: int, output_len: int, seed: int) -> dict:
    vocab = 2000  # random token ids every tokenizer of ours decodes
    config = BenchConfig(EndpointConfig(base_url=base_url, model=model),
                         DatasetConfig(num_requests=num, input_len=args.prompt_len, output_len=output_len,
                                       vocab_high=vocab, seed=seed),
                         LoadConfig(show_progress=False))
    return run_benchmark(config).summary


def greedy_texts(base_url: str, model: str, num: int = 16) -> list[str]:
    texts = []
    for i in range(num):
        prompt = [(37 * i + 11 * j) % 1900 + 50 for j in range(8 + 3 * i)]
        response = httpx.post(base_url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        if response.status_code != 200:
            raise RuntimeError(f"greedy request {i}: {response.status_code} {response.text[:300]}")
        texts.append(response.json()["choices"][0]["text"])
    return texts


def _own_cpu_s() -> float:
    """This process's CPU seconds (the load generator runs here)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def node_metrics(url: str) -> dict:
    """The decode node's pull counters and transport from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {"transport": None}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in ("pdserve_node_kv_pulled_bytes_total", "pdserve_node_kv_pull_seconds_sum",
                               "pdserve_node_kv_pull_seconds_count", "pdserve_node_kv_pull_fallbacks_total"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
            elif sample.name == "pdserve_kv_transport_info":
                out["transport"] = {k: v for k, v in sample.labels.items() if k in ("transport", "method", "memory")}
    return out


def run_setup(name: str, args: argparse.Namespace, started: float) -> dict:
    num_prefill = SETUPS[name]
    model = Path(args.model)
    gpus = gpu_plan(num_prefill, 1, visible=visible_gpus() if args.device != "cpu" else [])
    proxy_args = ["--local-prefill-min-wait-s", "-1"] if num_prefill else []
    log_dir = Path(args.log_dir) / name.replace("+", "")
    deployment = start_local(model, num_prefill=num_prefill, num_decode=1, node_args=node_args(args),
                             proxy_args=proxy_args, log_dir=log_dir, gpus=gpus)
    try:
        wait_healthy(deployment, max(30.0, args.budget_s - (time.monotonic() - started)))
        base, served = deployment.base_url, model.name
        load(base, served, args, 8, 4, seed=1)  # warm-up: first-request costs out of the figures
        texts = greedy_texts(base, served)
        before = node_metrics(deployment.health_urls["decode0"]) if num_prefill else {}
        proxy = deployment.cluster.process("proxy").pid
        cpu_before, wall_before = (process_cpu_s(proxy), _own_cpu_s()), time.monotonic()
        summary = load(base, served, args, args.num_requests, args.output_len, seed=0)
        wall = time.monotonic() - wall_before
        busy = {"proxy": (process_cpu_s(proxy) - cpu_before[0]) / wall, "client": (_own_cpu_s() - cpu_before[1]) / wall}
        result = {"gpus": gpus, "output_throughput": summary["output_throughput"],
                  "ttft_ms": summary["ttft_ms"], "tpot_ms": summary["tpot_ms"], "num_failed": summary["num_failed"],
                  "duration_s": summary["duration_s"], "cores_busy": busy, "texts": texts}
        if num_prefill:
            after = node_metrics(deployment.health_urls["decode0"])
            pulled = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if k != "transport"}
            seconds = pulled.get("pdserve_node_kv_pull_seconds_sum", 0.0)
            count = pulled.get("pdserve_node_kv_pull_seconds_count", 0.0)
            num_bytes = pulled.get("pdserve_node_kv_pulled_bytes_total", 0.0)
            result["pulls"] = {"count": count, "bytes": num_bytes, "mean_s": seconds / count if count else None,
                               "gb_s": num_bytes / seconds / 1e9 if seconds else None,
                               "fallbacks": pulled.get("pdserve_node_kv_pull_fallbacks_total", 0.0),
                               "transport": after["transport"]}
        return result
    finally:
        deployment.stop()


def run_setups(args: argparse.Namespace, started: float, results: dict, phase: dict) -> None:
    """Each setup in turn into results (made llama-1b first where the model is missing); phase
    ["now"]: what runs (a SIGTERM's error goes there)."""
    phase["now"] = "model"
    if not (Path(args.model) / "config.json").exists():
        print(f"making llama-1b at {args.model}", flush=True)
        make_model(Path(args.model), "llama-1b", seed=0, show_progress=True, dtype=args.dtype,
                   device=args.device)
    for name in SETUPS:
        phase["now"] = name
        left = args.budget_s - (time.monotonic() - started)
        if left < 40:
            print(f"{name}: skipped, {left:.0f} s left", flush=True)
            continue
        try:
            results[name] = run_setup(name, args, started)
        except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(f"{name}: failed: {exc}", flush=True)
            continue
        print(_line(name, results[name]), flush=True)


def _line(name: str, r: dict) -> str:
    ttft, tpot = r["ttft_ms"], r["tpot_ms"]
    line = (f"{name:>9}: {r['output_throughput']:,.0f} output tok/s, TTFT p50 {ttft['p50']:.0f} ms "
            f"p99 {ttft['p99']:.0f} ms, TPOT p50 {tpot['p50']:.1f} ms p99 {tpot['p99']:.1f} ms, "
            f"{r['num_failed']} failed; cores busy: proxy {r['cores_busy']['proxy']:.2f}, "
            f"client {r['cores_busy']['client']:.2f}")
    if "pulls" in r:
        p = r["pulls"]
        mean_ms = 1e3 * (p["mean_s"] or 0)
        line += (f"; {p['count']:.0f} pulls at {p['gb_s'] or 0:.2f} GB/s (mean {mean_ms:.1f} ms), "
                 f"{p['fallbacks']:.0f} fallbacks, over {p['transport']}")
    return line


class Stopped(BaseException):  # noqa: N818 - not an error: no `except Exception` on the way may take it
    """SIGTERM (the step's timeout): the running setup's servers are stopped, the results so far written."""


def _stop(signum, _frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the cleanup that follows is not cut short
    raise Stopped(f"stopped by signal {signum}")


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _stop)
    results: dict = {}
    phase = {"now": "model"}
    try:
        run_setups(args, started, results, phase)
    except Stopped as exc:
        results[phase["now"]] = {"error": str(exc)}
        print(f"{phase['now']}: {exc}", flush=True)
    ok = {k: v for k, v in results.items() if "output_throughput" in v}
    payload = {"device": args.device, "model": Path(args.model).name, "num_requests": args.num_requests,
               "prompt_len": args.prompt_len, "output_len": args.output_len, "setups": results}
    if len(ok) == 2:
        payload["pd_over_colocated"] = ok["1P+1D"]["output_throughput"] / ok["colocated"]["output_throughput"]
        payload["greedy_equal"] = ok["1P+1D"]["texts"] == ok["colocated"]["texts"]
        print(f"1P+1D / colocated: {payload['pd_over_colocated']:.2f}x; greedy outputs equal: "
              f"{payload['greedy_equal']}", flush=True)
    write_result("gpu_served", payload)
    return 0 if len(ok) == 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
