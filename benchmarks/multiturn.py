"""Prefix caching and cache-aware routing on a multi-turn chat workload.

8 users at once (`pdserve bench --dataset multiturn`: every user shares one system prompt of
--system-words words, ~1,000 tokens by default, and sends --turns user messages, each turn
resending the whole conversation) against 2 prefill nodes + 1 decode node started with
start_local (free ports, always stopped), once per config, in one run:

- off: nodes with --no-enable-prefix-caching, cache-aware routing (it finds no digests);
- round-robin: caching on, the proxy's --routing round-robin;
- cache-aware: caching on, --routing cache-aware (the default).

Local prefill (conditional disaggregation) is off in all three, so every prompt goes through
the prefill pool and every decode request pulls (or skips) its KV. Figures per config: from the
bench client, TTFT p50/p99; from the proxy's /metrics (the nodes' own counters), prefix-cache
query and hit tokens per kind (hit rate = hit / query), prefill tokens computed on the prefill
nodes, KV blocks the decode node pulled and skipped. Ratios are against off. A PNG plot and the
JSON go to --out; the last line is RESULT {json}.

    .venv/bin/python benchmarks/multiturn.py --preset tiny
    .venv/bin/python benchmarks/multiturn.py --preset small --turns 6
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.config import CacheConfig  # noqa: E402
from engine.protocol import prefix_block_hashes  # noqa: E402
from pdserve.bench import prepare_datasets, run_benchmark  # noqa: E402
from pdserve.bench_client import _chat_messages  # noqa: E402
from pdserve.bench_config import BenchConfig, DatasetConfig, EndpointConfig, LoadConfig  # noqa: E402
from pdserve.default_model import ensure_model  # noqa: E402
from pdserve.launcher import start_local, wait_healthy  # noqa: E402

CONFIGS = {  # name -> (node flags, proxy flags)
    "off": (["--no-enable-prefix-caching"], ["--routing", "cache-aware"]),
    "round-robin": ([], ["--routing", "round-robin"]),
    "cache-aware": ([], ["--routing", "cache-aware"]),
}
START_TIMEOUT_S = 300.0
BLOCK_SIZE = CacheConfig.block_size  # the nodes' KV block size (the nodes here keep the default)
# (metric, kind or None for every kind) summed into one figure per config
_COUNTERS = {
    "prefill_query_tokens": ("pdserve_node_prefix_query_tokens", "prefill"),
    "prefill_hit_tokens": ("pdserve_node_prefix_hit_tokens", "prefill"),
    "prefill_computed_tokens": ("pdserve_node_computed_prefill_tokens", "prefill"),
    "decode_query_tokens": ("pdserve_node_prefix_query_tokens", "decode"),
    "decode_hit_tokens": ("pdserve_node_prefix_hit_tokens", "decode"),
    "kv_blocks_pulled": ("pdserve_node_kv_blocks_pulled", "decode"),
    "kv_blocks_skipped": ("pdserve_node_kv_blocks_skipped", "decode"),
    "kv_fallbacks": ("pdserve_node_kv_fallbacks", None),
    "local_prefills": ("pdserve_local_prefills", None),
}


def main() -> None:
    args = _parse_args()
    model_dir = ensure_model(REPO / ".cache" / "models" / f"{args.preset}-seed0", args.preset)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {name: run_config(name, model_dir, args, out) for name in args.configs.split(",")}
    summary = {"preset": args.preset, "users": args.users, "turns": args.turns, "system_words": args.system_words,
               "user_words": args.user_words, "output_len": args.output_len, "configs": results,
               "vs_off": _ratios(results)}
    (out / f"multiturn-{args.preset}.json").write_text(json.dumps(summary, indent=2))
    _plot(results, out / f"multiturn-{args.preset}.png", args.preset)
    from results_io import write_result

    write_result("multiturn", summary)


def run_config(name: str, model_dir: Path, args: argparse.Namespace, out: Path) -> dict:
    """One deployment, the workload against it, its figures; the deployment always stops."""
    node_flags, proxy_flags = CONFIGS[name]
    log_dir = out / f"logs-{args.preset}-{name}"
    log_dir.mkdir(parents=True, exist_ok=True)
    deployment = start_local(model_dir, num_prefill=2, num_decode=1, node_args=node_flags,
                             proxy_args=[*proxy_flags, "--local-prefill-min-wait-s", "-1"], log_dir=log_dir)
    try:
        wait_healthy(deployment, START_TIMEOUT_S)
        config = BenchConfig(
            endpoint=EndpointConfig(base_url=deployment.base_url, endpoint="chat"),
            dataset=DatasetConfig(name="multiturn", num_users=args.users, turns=args.turns,
                                  num_requests=args.users * args.turns, system_prompt_len=args.system_words,
                                  input_len=args.user_words, output_len=args.output_len, ignore_eos=True),
            load=LoadConfig(request_rate=math.inf, show_progress=False))
        bench = run_benchmark(config)
        counters = _scrape(deployment.base_url)
        ideal = _ideal_hit_rate(deployment.base_url, config, bench)
    finally:
        deployment.stop()
    ttft = bench.summary.get("ttft_ms") or {}
    failed = sum(1 for r in bench.records if r.error)
    result = {"ttft_p50_ms": ttft.get("p50"), "ttft_p99_ms": ttft.get("p99"), "requests": len(bench.records),
              "failed": failed, "errors": sorted({r.error[:200] for r in bench.records if r.error}),
              "duration_s": bench.duration_s, **counters}
    result["prefill_hit_rate"] = _rate(counters["prefill_hit_tokens"], counters["prefill_query_tokens"])
    result["ideal_hit_rate"] = ideal
    result["prefill_hit_of_ideal"] = _rate(result["prefill_hit_rate"] or 0.0, ideal or 0.0)
    result["decode_hit_rate"] = _rate(counters["decode_hit_tokens"], counters["decode_query_tokens"])
    print(f"{name}: {json.dumps(result)}", flush=True)
    return result


def _ideal_hit_rate(base_url: str, config: BenchConfig, bench) -> float | None:
    """The prompt-token hit rate of one prefill cache that never evicts and sees every prompt of
    this run in the order they were sent (full blocks only, never a prompt's last token, as the
    engine looks up): the most any routing can reach. Prompts rebuilt from the dataset and the
    answers the run got, tokenized by the proxy's own /tokenize."""
    dataset, _ = prepare_datasets(config, bench.model)
    answers = {(r.session_idx, r.turn_idx): r.text for r in bench.records}
    cached: set[int] = set()
    query = hit = 0
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for record in sorted(bench.records, key=lambda r: r.start_s):
            session = dataset.sessions[record.session_idx]
            earlier = [answers[(record.session_idx, t)] for t in range(record.turn_idx)]
            body = {"model": bench.model, "messages": _chat_messages(session, record.turn_idx, earlier),
                    "add_generation_prompt": True}
            tokens = client.post("/tokenize", json=body).raise_for_status().json()["tokens"]
            hashes = prefix_block_hashes(tokens, BLOCK_SIZE)
            usable = hashes[: (len(tokens) - 1) // BLOCK_SIZE]
            num_hit = next((i for i, h in enumerate(usable) if h not in cached), len(usable))
            query, hit = query + len(tokens), hit + num_hit * BLOCK_SIZE
            cached.update(hashes)
    return hit / query if query else None


def _scrape(base_url: str) -> dict[str, float]:
    """The nodes' counters as the proxy exports them, summed per figure."""
    text = httpx.get(base_url + "/metrics", timeout=30).text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    figures = {}
    for figure, (metric, kind) in _COUNTERS.items():
        figures[figure] = sum(s.value for s in samples if s.name == metric + "_total"
                              and (kind is None or s.labels.get("kind") == kind))
    return figures


def _rate(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _ratios(results: dict[str, dict]) -> dict[str, dict]:
    """Each config's TTFT, computed prefill tokens and pulled blocks over off's."""
    off = results.get("off")
    if off is None:
        return {}
    keys = ("ttft_p50_ms", "ttft_p99_ms", "prefill_computed_tokens", "kv_blocks_pulled")
    return {name: {key: (r[key] / off[key] if r.get(key) is not None and off.get(key) else None) for key in keys}
            for name, r in results.items() if name != "off"}


def _plot(results: dict[str, dict], path: Path, preset: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for offset, key in ((-0.2, "ttft_p50_ms"), (0.2, "ttft_p99_ms")):
        axes[0].bar([i + offset for i in range(len(names))], [results[n][key] or 0 for n in names], 0.4,
                    label=key.split("_")[1])
    axes[0].set_title("TTFT (ms)")
    axes[0].legend()
    axes[1].bar(names, [results[n]["prefill_hit_rate"] or 0 for n in names])
    axes[1].set_title("prefill-node prefix hit rate")
    axes[2].bar(names, [results[n]["kv_blocks_pulled"] for n in names])
    axes[2].set_title("KV blocks pulled by the decode node")
    for ax in axes:
        ax.set_xticks(range(len(names)), names)
    fig.suptitle(f"multi-turn chat, 2 prefill + 1 decode, preset {preset}")
    fig.tight_layout()
    fig.savefig(path)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-words", type=int, default=750, help="shared system prompt (~1,000 tokens)")
    parser.add_argument("--user-words", type=int, default=50, help="words per user message (6 turns fit 2,048 tokens)")
    parser.add_argument("--output-len", type=int, default=32, help="tokens per answer (ignore_eos)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    return parser.parse_args()


if __name__ == "__main__":
    main()
