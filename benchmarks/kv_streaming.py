"""Streamed against whole-prompt KV pulls, side by side on the same two nodes: one prefill and one
decode node (one core each, NIXL; local prefill off) and two proxies in front of them, one
streaming (--kv-stream-min-tokens 0: a prompt the prefill node runs in several chunks is read by
the decode node chunk by chunk while it is prefilled) and one not (-1: read once prefilled).

Requests go one at a time, alternating between the proxies (ABBA), so the two see the same nodes,
the same machine state and no queueing. Each asks for --output-len tokens of a random token-id
prompt (streamed, ignore_eos). Per request: TTFT (the first token comes from the prefill node, so
the pull is not in it), the gap from the first token to the second (the decode node's first step,
which waits for the pull), and the median gap after that (TPOT). The pull's cost to a request is
the second gap minus TPOT; the table gives it per prompt length and mode, with the ratio
streamed / whole.

    .venv/bin/python benchmarks/kv_streaming.py [--lengths 512 4096] [--rounds 6] [--chunk 1024]
    python3 benchmarks/kv_streaming.py --device cuda --dtype bfloat16 --model-dir DIR   # on a GPU

--chunk is the prefill node's --max-num-batched-tokens: with 1024, a 512-token prompt is one
chunk (nothing to stream: the control) and a 4,096-token one is four. Prints progress, the
table, writes benchmarks/out/kv_streaming/ (plot, JSON, logs) and ends with `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.results_io import write_result  # noqa: E402
from benchmarks.results_served import plot_kv_streaming  # noqa: E402
from benchmarks.stopping import stop_on_sigterm  # noqa: E402
from pdserve.default_model import ensure_model  # noqa: E402
from pdserve.gpus import gpu_plan, visible_gpus  # noqa: E402
from pdserve.launcher import start_local, wait_healthy  # noqa: E402
from pdserve.ports import free_port  # noqa: E402
from pdserve.tune_space import NO_LOCAL_PREFILL  # noqa: E402

OUT = REPO / "benchmarks" / "out" / "kv_streaming"
MODES = ("streamed", "whole")


def one_request(client: httpx.Client, url: str, model: str, prompt: list[int], output_len: int) -> dict:
    """Stream one completion over client's kept-alive connection; the arrival time of each token
    (seconds from the send). NOTE: a new connection per request (module-level httpx.stream) added
    about 25 ms to every TTFT, most of it the new client's TLS context.
    NOTE: logprobs 0, so that every token sends its chunk: one without text sends none otherwise,
    and a random-weight model's greedy output (the GPU check's llama-1b) is often such tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": True}
    times = []
    started = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("logprobs"):
                now = time.perf_counter() - started
                times += [now] * len(chunk["choices"][0]["logprobs"]["tokens"])  # tokens that came together
            fingerprint = chunk.get("system_fingerprint")
            if fingerprint and fingerprint != "pdserve-kv:pulled":
                raise RuntimeError(f"the KV did not come by a pull: {fingerprint}")
    if len(times) < 4:
        raise RuntimeError(f"{len(times)} token chunks, expected {output_len}")
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft_s": times[0], "second_gap_s": gaps[0], "tpot_s": statistics.median(gaps[1:])}


def node_counter(health_url: str, name: str) -> float:
    text = httpx.get(health_url + "/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{") or
               line.startswith(name + " "))


def main() -> None:
    stop_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-preset", default="smollm2", help="the checkpoint, made into .cache/models/ if "
                        "missing (default: SmolLM2-135M, the default model; 8,192 tokens)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--rounds", type=int, default=6, help="requests per mode and length (after one warm-up)")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=1024, help="the nodes' --max-num-batched-tokens")
    parser.add_argument("--model-dir", default=None, help="a checkpoint to use instead of the preset")
    parser.add_argument("--device", default="cpu", help="the nodes' --device (cuda: both on the visible GPUs, "
                        "each its own where there are two, else sharing one)")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    model_dir = (Path(args.model_dir) if args.model_dir else
                 ensure_model(REPO / ".cache" / "models" / args.model_preset, args.model_preset))
    node_args = ["--max-num-batched-tokens", str(args.chunk), "--transfer-backend", "nixl", "--device", args.device,
                 "--dtype", args.dtype, "--max-model-len", str(max(args.lengths) + args.output_len + 64)]
    gpus = gpu_plan(1, 1, visible=visible_gpus()) if args.device != "cpu" else None
    deployment = start_local(model_dir, num_prefill=1, num_decode=1, node_args=node_args,
                             proxy_args=[*NO_LOCAL_PREFILL, "--kv-stream-min-tokens", "0"], log_dir=OUT / "logs",
                             pin_cpus=args.device == "cpu", gpus=gpus)
    try:
        wait_healthy(deployment, 300)
        proxy_argv = list(deployment.cluster.argvs["proxy"])
        port = free_port("127.0.0.1")
        proxy_argv[proxy_argv.index("--port") + 1] = str(port)
        proxy_argv[proxy_argv.index("--kv-stream-min-tokens") + 1] = "-1"
        deployment.cluster.start("proxy-whole", proxy_argv, OUT / "logs")
        urls = {"streamed": deployment.base_url, "whole": f"http://127.0.0.1:{port}"}
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(urls["whole"] + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the second proxy did not come up")
            time.sleep(0.2)
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        rows = run(urls, deployment.health_urls, args, vocab_size)
    finally:
        deployment.stop()
    print_table(rows)
    plot_kv_streaming(rows, OUT / "kv_streaming.png")
    payload = {"rows": rows, "chunk": args.chunk, "output_len": args.output_len, "rounds": args.rounds,
               "model": model_dir.name, "device": args.device, "dtype": args.dtype,
               "plot": str((OUT / "kv_streaming.png").relative_to(REPO))}
    (OUT / "result.json").write_text(json.dumps(payload, indent=1))
    write_result("kv_streaming", payload)


def run(urls: dict[str, str], health: dict[str, str], args, vocab_size: int) -> list[dict]:
    rng = random.Random(0)
    model = httpx.get(urls["whole"] + "/v1/models", timeout=5).json()["data"][0]["id"]
    streamed_before = node_counter(health["decode0"], "pdserve_node_kv_streamed_total")
    with httpx.Client() as client:
        rows = [one_length(client, urls, model, length, rng, args, vocab_size) for length in args.lengths]
    streamed = node_counter(health["decode0"], "pdserve_node_kv_streamed_total") - streamed_before
    for row in rows:
        row["streamed_pulls_in_run"] = streamed
    fallbacks = node_counter(health["decode0"], "pdserve_node_kv_pull_fallbacks_total")
    if fallbacks:
        raise RuntimeError(f"{fallbacks} pulls fell back to a local prefill")
    return rows


def one_length(client: httpx.Client, urls: dict[str, str], model: str, length: int, rng: random.Random, args,
               vocab_size: int) -> dict:
    """Both modes' requests of prompts of this length, alternated, and their medians."""
    samples: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for round_idx in range(args.rounds + 1):
        order = MODES if round_idx % 2 == 0 else MODES[::-1]
        for mode in order:
            prompt = [rng.randrange(8, min(40000, vocab_size)) for _ in range(length)]
            sample = one_request(client, urls[mode], model, prompt, args.output_len)
            if round_idx > 0:  # the first round warms both up
                samples[mode].append(sample)
        print(f"length {length}: round {round_idx}/{args.rounds} done", flush=True)
    row = {"length": length}
    for mode in MODES:
        for key in ("ttft_s", "second_gap_s", "tpot_s"):
            row[f"{mode}_{key}"] = statistics.median(s[key] for s in samples[mode])
        row[f"{mode}_pull_cost_s"] = statistics.median(s["second_gap_s"] - s["tpot_s"] for s in samples[mode])
    whole = row["whole_pull_cost_s"]
    row["pull_cost_ratio"] = row["streamed_pull_cost_s"] / whole if whole > 0 else None
    # Each round's streamed request against its whole one (sent next to it): what streaming
    # costs the prefill, if anything, without the drift between rounds.
    row["ttft_ratio_each_round"] = [a["ttft_s"] / b["ttft_s"] for a, b in zip(samples["streamed"],
                                                                               samples["whole"])]
    row["ttft_ratio"] = statistics.median(row["ttft_ratio_each_round"])
    row["samples"] = samples
    return row


def print_table(rows: list[dict]) -> None:
    print("\n| prompt tokens | mode | TTFT ms | 1st->2nd token ms | TPOT ms | pull cost ms (2nd gap - TPOT) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        for mode in MODES:
            print(f"| {row['length']} | {mode} | {row[f'{mode}_ttft_s'] * 1e3:.1f} | "
                  f"{row[f'{mode}_second_gap_s'] * 1e3:.1f} | {row[f'{mode}_tpot_s'] * 1e3:.1f} | "
                  f"{row[f'{mode}_pull_cost_s'] * 1e3:.1f} |")
    for row in rows:
        print(f"{row['length']} tokens: TTFT streamed / whole, each round's pair: median {row['ttft_ratio']:.3f} "
              f"({min(row['ttft_ratio_each_round']):.3f}-{max(row['ttft_ratio_each_round']):.3f})")
        ratio = row["pull_cost_ratio"]
        print(f"{row['length']} tokens: pull cost streamed / whole = {ratio:.2f}" if ratio is not None else
              f"{row['length']} tokens: no pull cost measured")


if __name__ == "__main__":
    main()
