"""Served on GPUs: 1 prefill + 1 decode node against one colocated node, same model, same load.

`pdserve up`'s own launcher (pdserve.launcher.start_local) starts each setup with the GPU plan
`pdserve up` makes (nodes spread over the visible GPUs; two nodes on one GPU split its memory):
  colocated  --prefill 0 --decode 1
  1P+1D      --prefill 1 --decode 1, NIXL, every prompt prefilled on the prefill node
             (--local-prefill-min-wait-s -1), so every request's KV is pulled
The load is `pdserve bench`'s: random-token prompts of each --prompt-lens length -> --output-len
tokens (ignore_eos), streamed; --num-requests of the first length, fewer of longer ones (the same
prompt tokens in all). Each length runs all at once (rate inf), then as Poisson arrivals at
--poisson-fraction of the rate colocated sustained at rate inf (its output tok/s / output len), the
same rate for both setups: where colocated's TPOT p99 grows past its p50 there, disaggregation
should keep decode steps free of prefills. Reported per run: output tokens/s, TTFT and TPOT
p50/p99, failures; for 1P+1D also the decode node's pulls (count, bytes, mean seconds, GB/s =
bytes / pull seconds), its KV fallbacks, and the transport UCX reported
(pdserve_kv_transport_info). The proxy's and the load generator's CPU over each run are reported as
shares of one core: either near 1 means the run measured that process, not the nodes (the proxy is
one asyncio process: benchmarks/proxy_capacity.py). Greedy outputs of 16 prompts through both
setups are compared. Ends with `RESULT {json}`; --budget-s bounds the whole run (a setup or a run
that would not fit is skipped).

    python3 benchmarks/gpu_served.py [--model DIR] [--num-requests 256] [--prompt-lens 512 4096] [--budget-s 200]

--device cpu with a small model checks the script without a GPU.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.cpu_time import own_cpu_s, process_cpu_s  # noqa: E402
from benchmarks.results_io import write_result  # noqa: E402
from benchmarks.stopping import Stopped, stop_on_sigterm  # noqa: E402
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
    parser.add_argument("--num-requests", type=int, default=256,
                        help="of the first prompt length; a longer one sends as many prompt tokens (at least 16)")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[512])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--poisson-fraction", type=float, default=0.9,
                        help="the Poisson runs' rate, as a fraction of colocated's at rate inf (0: none)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--log-dir", default=str(REPO / "benchmarks" / "out" / "gpu_served"))
    return parser.parse_args()


def node_args(args: argparse.Namespace) -> list[str]:
    return ["--dtype", args.dtype, "--device", args.device, "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--transfer-backend", "nixl",
            "--max-model-len", str(max(args.prompt_lens) + args.output_len + 64)]


def num_requests(args: argparse.Namespace, prompt_len: int) -> int:
    """As many prompt tokens at each length as --num-requests of the first, at least 16 requests."""
    return max(16, args.num_requests * args.prompt_lens[0] // prompt_len)


def load(base_url: str, model: str, num: int, prompt_len: int, output_len: int, seed: int,
         rate: float = math.inf) -> dict:
    """pdserve bench's summary of num prompts (drawn from seed) at rate, sampled at temperature 1
    (drawn tokens: served steps as users' sampled requests run them), each token's logprob asked for.
    NOTE: the logprob makes every token send a chunk: a random-weight model's output is mostly
    tokens without text (llama-1b's tokenizer covers 2,048 of its 49,152 ids, and its logits are
    peaked enough that temperature 1 draws nearly greedily), which send none without it, and TTFT
    and TPOT would time other tokens."""
    vocab = 2000  # random token ids every tokenizer of ours decodes
    config = BenchConfig(EndpointConfig(base_url=base_url, model=model, temperature=1.0, logprobs=0),
                         DatasetConfig(num_requests=num, input_len=prompt_len, output_len=output_len,
                                       vocab_high=vocab, seed=seed),
                         LoadConfig(request_rate=rate, seed=seed, show_progress=False))
    result = run_benchmark(config)
    errors = collections.Counter(r.error[:200] for r in result.records if not r.is_ok)
    return {**result.summary, "errors": dict(errors.most_common(3))}


def greedy_tokens(base_url: str, model: str, num: int = 16) -> list[list[str]]:
    """Each of num prompts' 16 greedy tokens, as "token_id:N" (logprobs' tokens named by their ids,
    return_tokens_as_token_ids: a random-weight model's output is mostly tokens without text, which
    neither the answer's text nor the tokens' texts tell apart)."""
    tokens = []
    for i in range(num):
        prompt = [(37 * i + 11 * j) % 1900 + 50 for j in range(8 + 3 * i)]
        response = httpx.post(base_url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True})
        if response.status_code != 200:
            raise RuntimeError(f"greedy request {i}: {response.status_code} {response.text[:300]}")
        tokens.append(response.json()["choices"][0]["logprobs"]["tokens"])
    return tokens


# The decode node's counters a run reads the change of: its pulls, its steps and their decode batches.
NODE_COUNTERS = ("pdserve_node_kv_pulled_bytes_total", "pdserve_node_kv_pull_seconds_sum",
                 "pdserve_node_kv_pull_seconds_count", "pdserve_node_kv_pull_fallbacks_total",
                 "pdserve_node_step_seconds_sum", "pdserve_node_step_seconds_count",
                 "pdserve_node_decode_batch_size_sum", "pdserve_node_decode_batch_size_count")


def node_metrics(url: str) -> dict:
    """The decode node's NODE_COUNTERS and KV transport from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {"transport": None}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in NODE_COUNTERS:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
            elif sample.name == "pdserve_kv_transport_info":
                out["transport"] = {k: v for k, v in sample.labels.items() if k in ("transport", "method", "memory")}
    return out


def run_setup(name: str, args: argparse.Namespace, started: float, rates: dict[int, float], out: dict) -> None:
    """One setup's runs into out (as they end: a run cut short keeps those before it): each prompt
    length at rate inf, then at rates[prompt_len] requests/s (Poisson; colocated, which runs first,
    fills rates in)."""
    num_prefill = SETUPS[name]
    model = Path(args.model)
    gpus = gpu_plan(num_prefill, 1, visible=visible_gpus() if args.device != "cpu" else [])
    proxy_args = ["--local-prefill-min-wait-s", "-1"] if num_prefill else []
    log_dir = Path(args.log_dir) / name.replace("+", "")
    out.update(gpus=gpus, tokens=None, runs=[])
    deployment = start_local(model, num_prefill=num_prefill, num_decode=1, node_args=node_args(args),
                             proxy_args=proxy_args, log_dir=log_dir, gpus=gpus)
    try:
        wait_healthy(deployment, max(30.0, args.budget_s - (time.monotonic() - started)))
        base, served = deployment.base_url, model.name
        load(base, served, 8, args.prompt_lens[0], 4, seed=1)  # warm-up: first-request costs out of the figures
        out["tokens"] = greedy_tokens(base, served)
        runs = out["runs"]
        for length_idx, prompt_len in enumerate(args.prompt_lens):
            for phase in ("inf", "poisson"):
                rate = math.inf if phase == "inf" else rates.get(prompt_len)
                if rate is None:
                    continue  # no Poisson runs asked for, or colocated did not measure this length
                if runs and args.budget_s - (time.monotonic() - started) < 15:
                    print(f"{name}: prompts of {prompt_len} at rate {rate:g}/s skipped: out of time", flush=True)
                    continue
                # NOTE: new prompts each run (a repeat is a prefix-cache hit, not a pull), the same in both setups
                seed = 10 + 2 * length_idx + (phase == "poisson")
                run = measure(deployment, served, args, prompt_len, rate, seed, has_pulls=bool(num_prefill))
                runs.append(run)
                print(_line(name, run), flush=True)
                if name == "colocated" and phase == "inf" and args.poisson_fraction and run["output_throughput"]:
                    rates[prompt_len] = args.poisson_fraction * run["output_throughput"] / args.output_len
    finally:
        deployment.stop()


def measure(deployment, served: str, args: argparse.Namespace, prompt_len: int, rate: float, seed: int,
            has_pulls: bool) -> dict:
    """One load on a running setup: the bench's figures, the cores the proxy, the load generator and
    the decode node kept busy, the decode node's steps (how many, their mean time and decode batch)
    and (has_pulls) its pulls meanwhile."""
    before = node_metrics(deployment.health_urls["decode0"])
    pids = {"proxy": deployment.cluster.process("proxy").pid, "decode": deployment.cluster.process("decode0").pid}
    num = num_requests(args, prompt_len)
    cpu_before, wall_before = ({k: process_cpu_s(pid) for k, pid in pids.items()}, own_cpu_s()), time.monotonic()
    summary = load(deployment.base_url, served, num, prompt_len, args.output_len, seed=seed, rate=rate)
    wall = time.monotonic() - wall_before
    busy = {k: (process_cpu_s(pid) - cpu_before[0][k]) / wall for k, pid in pids.items()}
    busy["client"] = (own_cpu_s() - cpu_before[1]) / wall
    after = node_metrics(deployment.health_urls["decode0"])
    change = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in NODE_COUNTERS}
    steps = change["pdserve_node_step_seconds_count"]
    batches = change["pdserve_node_decode_batch_size_count"]
    run = {"prompt_len": prompt_len, "rate_rps": None if rate == math.inf else rate,
           "num_requests": num, "output_throughput": summary["output_throughput"],
           "ttft_ms": summary["ttft_ms"], "tpot_ms": summary["tpot_ms"], "num_failed": summary["num_failed"],
           "errors": summary["errors"], "duration_s": summary["duration_s"], "cores_busy": busy,
           "decode_steps": {"count": steps,
                            "mean_ms": 1e3 * change["pdserve_node_step_seconds_sum"] / steps if steps else None,
                            "mean_batch": change["pdserve_node_decode_batch_size_sum"] / batches if batches else None}}
    if has_pulls:
        pulled = change
        seconds = pulled.get("pdserve_node_kv_pull_seconds_sum", 0.0)
        count = pulled.get("pdserve_node_kv_pull_seconds_count", 0.0)
        num_bytes = pulled.get("pdserve_node_kv_pulled_bytes_total", 0.0)
        run["pulls"] = {"count": count, "bytes": num_bytes, "mean_s": seconds / count if count else None,
                        "gb_s": num_bytes / seconds / 1e9 if seconds else None,
                        "fallbacks": pulled.get("pdserve_node_kv_pull_fallbacks_total", 0.0),
                        "transport": after["transport"]}
    return run


def run_setups(args: argparse.Namespace, started: float, results: dict, phase: dict) -> None:
    """Each setup in turn into results (made llama-1b first where the model is missing); phase
    ["now"]: what runs (a SIGTERM's error goes there)."""
    phase["now"] = "model"
    if not (Path(args.model) / "config.json").exists():
        print(f"making llama-1b at {args.model}", flush=True)
        make_model(Path(args.model), "llama-1b", seed=0, show_progress=True, dtype=args.dtype,
                   device=args.device)
    rates: dict[int, float] = {}  # Poisson rates by prompt length, from colocated's rate-inf runs
    for name in SETUPS:
        phase["now"] = name
        left = args.budget_s - (time.monotonic() - started)
        if left < 40:
            print(f"{name}: skipped, {left:.0f} s left", flush=True)
            continue
        results[name] = {}
        try:
            run_setup(name, args, started, rates, results[name])
        except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
            results[name]["error"] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"{name}: failed: {exc}", flush=True)


def _line(name: str, r: dict) -> str:
    ttft, tpot = r["ttft_ms"], r["tpot_ms"]
    line = (f"{name:>9}, {r['num_requests']} x {r['prompt_len']} at {rate_label(r['rate_rps'])}: "
            f"{r['output_throughput']:,.0f} "
            f"output tok/s, TTFT p50 {ttft['p50']:.0f} ms "
            f"p99 {ttft['p99']:.0f} ms, TPOT p50 {tpot['p50']:.1f} ms p99 {tpot['p99']:.1f} ms, "
            f"{r['num_failed']} failed; cores busy: proxy {r['cores_busy']['proxy']:.2f}, "
            f"client {r['cores_busy']['client']:.2f}, decode node {r['cores_busy']['decode']:.2f}")
    if r.get("errors"):
        line += f"; failures: {r['errors']}"
    steps = r["decode_steps"]
    if steps["count"]:
        line += (f"; decode node: {steps['count']:.0f} steps, mean {steps['mean_ms']:.2f} ms, "
                 f"mean decode batch {steps['mean_batch'] or 0:.0f}")
    if "pulls" in r:
        p = r["pulls"]
        mean_ms = 1e3 * (p["mean_s"] or 0)
        line += (f"; {p['count']:.0f} pulls at {p['gb_s'] or 0:.2f} GB/s (mean {mean_ms:.1f} ms), "
                 f"{p['fallbacks']:.0f} fallbacks, over {p['transport']}")
    return line


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    stop_on_sigterm()
    results: dict = {}
    phase = {"now": "model"}
    try:
        run_setups(args, started, results, phase)
    except Stopped as exc:
        results.setdefault(phase["now"], {})["error"] = str(exc)  # the runs it finished stay
        print(f"{phase['now']}: {exc}", flush=True)
    payload = {"device": args.device, "model": Path(args.model).name, "prompt_lens": args.prompt_lens,
               "output_len": args.output_len, "poisson_fraction": args.poisson_fraction, "setups": results,
               "comparisons": compare(results)}
    for c in payload["comparisons"]:
        print(_comparison_line(c), flush=True)
    ok = {k: v for k, v in results.items() if v.get("runs") and "error" not in v}
    if all(results.get(name, {}).get("tokens") for name in SETUPS):
        payload["greedy_equal"] = results["1P+1D"]["tokens"] == results["colocated"]["tokens"]
        print(f"greedy outputs equal: {payload['greedy_equal']}", flush=True)
    write_result("gpu_served", payload)
    return 0 if len(ok) == 2 else 1


def compare(results: dict) -> list[dict]:
    """1P+1D against colocated, run by run (same prompt length and rate): the throughput ratio, and
    both TPOT p50/p99 (at the Poisson rate: colocated's p99 over 1.5x its p50 is where
    disaggregation should help, and 1P+1D's p99 should be the lower)."""
    runs = {name: {(r["prompt_len"], r["rate_rps"] is None): r for r in results.get(name, {}).get("runs", [])}
            for name in SETUPS}
    out = []
    for key, colocated in runs["colocated"].items():
        pd = runs["1P+1D"].get(key)
        if pd is None:
            continue
        out.append({"prompt_len": key[0], "rate_rps": pd["rate_rps"],
                    "pd_over_colocated": pd["output_throughput"] / colocated["output_throughput"],
                    "tpot_ms": {"colocated": colocated["tpot_ms"], "1P+1D": pd["tpot_ms"]}})
    return out


def rate_label(rate_rps: float | None) -> str:
    """A run's arrival rate as the lines and tables name it (None: all at once)."""
    return "rate inf" if rate_rps is None else f"Poisson {rate_rps:.1f}/s"


def _comparison_line(c: dict) -> str:
    tpot = c["tpot_ms"]
    return (f"prompts of {c['prompt_len']} at {rate_label(c['rate_rps'])}: 1P+1D / colocated "
            f"{c['pd_over_colocated']:.2f}x; TPOT p99 "
            f"{tpot['1P+1D']['p99']:.1f} ms against {tpot['colocated']['p99']:.1f} ms (colocated p99/p50 "
            f"{tpot['colocated']['p99'] / max(tpot['colocated']['p50'], 1e-9):.2f})")


if __name__ == "__main__":
    raise SystemExit(main())
