"""Serving throughput: the disaggregated pipeline beside transformers one prompt at a time.

For each preset: start 1 prefill + 1 decode node (one core each) and the proxy, send N
requests of P prompt tokens / O output tokens all at once through the OpenAI endpoint
(streaming, greedy), record output tokens/s and TTFT/TPOT percentiles; then stop the servers
and time transformers `generate` one prompt at a time on the same prompts, on this machine.
Optionally also a colocated (--prefill 0) single server for comparison. Ends with `RESULT {json}`.

    .venv/bin/python benchmarks/serve_throughput.py --presets small,tiny
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import torch
import transformers

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdserve.bench import BenchConfig, DatasetConfig, EndpointConfig, LoadConfig, prepare_datasets, run_benchmark  # noqa: E402
from pdserve.default_model import ensure_model  # noqa: E402
from pdserve.launcher import start_local, wait_healthy  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="small,tiny")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--transfer-backend", default=None, help="nixl or gloo (default: the node's)")
    parser.add_argument("--colocated", action="store_true", help="also measure one colocated server")
    parser.add_argument("--reference-prompts", type=int, default=None,
                        help="time transformers on this many prompts (default: all); tok/s is per prompt anyway")
    parser.add_argument("--node-args", default="", help="extra node arguments, e.g. '--max-num-batched-tokens 4096'")
    parser.add_argument("--proxy-args", default="", help="extra proxy arguments, e.g. '--local-prefill-penalty 4'")
    parser.add_argument("--log-dir", default=str(REPO / "benchmarks" / "out" / "serve_logs"))
    return parser.parse_args()


def model_dir_for(preset: str) -> Path:
    return ensure_model(REPO / ".cache" / "models" / f"{preset}-seed0", preset)


def serve(model_dir: Path, args: argparse.Namespace, num_prefill: int, vocab: int, log_dir: Path) -> dict:
    log_dir.mkdir(parents=True, exist_ok=True)
    node_args = args.node_args.split()
    if args.transfer_backend:
        node_args += ["--transfer-backend", args.transfer_backend]
    deployment = start_local(model_dir, num_prefill=num_prefill, num_decode=1, node_args=node_args,
                             proxy_args=args.proxy_args.split(), log_dir=log_dir)
    try:
        wait_healthy(deployment, 300)
        config = bench_config(deployment.base_url, model_dir.name, args, vocab)
        # Warm-up: two short requests on other prompts (seed 1), before the counters are read.
        run_benchmark(replace(config, dataset=replace(config.dataset, num_requests=2, output_len=2, seed=1)))
        before = scrape_counters(deployment.base_url)
        summary = run_benchmark(config).summary
        after = scrape_counters(deployment.base_url)
        summary.update({name: after[name] - before[name] for name in after})
        return summary
    finally:
        deployment.stop()


def bench_config(base_url: str, model: str, args: argparse.Namespace, vocab: int) -> BenchConfig:
    """All requests at once (rate inf), random token-id prompts of exactly --prompt-len tokens
    and --output-len output tokens (ignore_eos), streamed: `pdserve bench` with those flags."""
    return BenchConfig(EndpointConfig(base_url=base_url, model=model),
                       DatasetConfig(num_requests=args.num_requests, input_len=args.prompt_len,
                                     output_len=args.output_len, vocab_high=vocab),
                       LoadConfig(show_progress=False))


def scrape_counters(base_url: str) -> dict[str, float]:
    """Routing counters from the proxy's /metrics: local prefills and KV-pull fallbacks."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    counters = {"local_prefills": "pdserve_local_prefills_total", "kv_fallbacks": "pdserve_node_kv_fallbacks_total"}
    totals = dict.fromkeys(counters, 0.0)
    for line in text.splitlines():
        for name, metric in counters.items():
            if line.startswith(metric):
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def transformers_single(model_dir: Path, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens/s of transformers generate, one prompt at a time."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():  # one untimed short generate: first-call costs are not steady speed
        warm = torch.tensor([prompts[0][:16]])
        model.generate(warm, attention_mask=torch.ones_like(warm), do_sample=False, max_new_tokens=2)
    start = time.perf_counter()
    with torch.inference_mode():
        for idx, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=output_len, min_new_tokens=output_len)
            if idx % 8 == 7:
                print(f"  transformers one-at-a-time: {idx + 1}/{len(prompts)}", flush=True)
    return len(prompts) * output_len / (time.perf_counter() - start)


def bench_preset(preset: str, args: argparse.Namespace) -> dict:
    print(f"== {preset}", flush=True)
    model_dir = model_dir_for(preset)
    vocab = min(json.loads((model_dir / "config.json").read_text())["vocab_size"], 2000)
    result = {"preset": preset}
    result["disaggregated"] = serve(model_dir, args, 1, vocab, Path(args.log_dir) / f"{preset}-pd")
    print(f"  disaggregated: {result['disaggregated']['output_throughput']:.1f} tok/s", flush=True)
    if args.colocated:
        result["colocated"] = serve(model_dir, args, 0, vocab, Path(args.log_dir) / f"{preset}-colocated")
        print(f"  colocated: {result['colocated']['output_throughput']:.1f} tok/s", flush=True)
    dataset, _ = prepare_datasets(bench_config("", "", args, vocab), "")  # the prompts the endpoint was sent
    prompts = [session.turns[0].prompt for session in dataset.sessions][: args.reference_prompts or args.num_requests]
    result["hf_single_tok_s"] = transformers_single(model_dir, prompts, args.output_len)
    for mode in ("disaggregated", "colocated"):
        if mode in result:
            result[f"{mode}_over_single"] = result[mode]["output_throughput"] / result["hf_single_tok_s"]
    print(json.dumps(result, indent=1), flush=True)
    return result


def main() -> None:
    args = parse_args()
    results = [bench_preset(p, args) for p in args.presets.split(",")]
    from results_io import write_result

    write_result("serve_throughput", {"device": "cpu", "results": results})


if __name__ == "__main__":
    main()
