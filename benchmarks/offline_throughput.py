"""Offline throughput: pdserve's engine beside transformers `generate`, side by side in one run.

For each preset: N prompts of P random tokens, O greedy output tokens each (float32):
  1. transformers generate, one prompt at a time;
  2. transformers generate, all prompts as one batch;
  3. pdserve's engine (LLM.generate) on all prompts at once.
Reports output tokens/s of each and the ratios to (1), checks the engine's tokens equal (1)'s,
saves a bar chart, and ends with one line `RESULT {json}`. `--device auto` (the default) runs both
the engine and transformers on CUDA when there is one, else on the CPU.

    .venv/bin/python benchmarks/offline_throughput.py --presets small,tiny [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.config import resolve_device  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.default_model import ensure_model  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="small,tiny")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda: the engine's and transformers' both")
    parser.add_argument("--out-dir", default=str(REPO / "benchmarks" / "out"))
    args = parser.parse_args()
    args.device = resolve_device(args.device)
    args.on_cuda = torch.device(args.device).type == "cuda"  # cuda or cuda:N
    return args


def model_dir_for(preset: str) -> Path:
    return ensure_model(REPO / ".cache" / "models" / f"{preset}-seed0", preset)


def make_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(length)] for _ in range(num)]


def run_transformers(model, prompts: list[list[int]], output_len: int, batch: bool) -> tuple[float, list[list[int]]]:
    groups = [prompts] if batch else [[p] for p in prompts]
    outputs: list[list[int]] = []
    warm_up_transformers(model, prompts[0])
    start = time.perf_counter()
    with torch.inference_mode():
        for idx, group in enumerate(groups):
            input_ids = torch.tensor(group, device=model.device)
            sequences = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                max_new_tokens=output_len, min_new_tokens=output_len,
            )
            outputs += sequences[:, input_ids.shape[1]:].tolist()
            if not batch and idx % 8 == 7:
                print(f"  transformers one-at-a-time: {idx + 1}/{len(groups)}", flush=True)
    return time.perf_counter() - start, outputs


def warm_up_transformers(model, prompt: list[int]) -> None:
    """One untimed short generate: first-call costs are not the baseline's steady speed."""
    with torch.inference_mode():
        ids = torch.tensor([prompt[:16]], device=model.device)
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=2)


def run_engine(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0.0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def bench_preset(preset: str, args: argparse.Namespace) -> dict:
    print(f"== {preset}", flush=True)
    model_dir = model_dir_for(preset)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(args.device)
    prompts = make_prompts(args.num_prompts, args.prompt_len, model.config.vocab_size)
    num_out = args.num_prompts * args.output_len

    llm = LLM(str(model_dir), max_num_seqs=args.num_prompts, max_num_batched_tokens=args.max_num_batched_tokens,
              device=args.device)
    # Warm-up, on other prompts of the same shapes: the timed prompts must not find their blocks
    # in the prefix cache. On CUDA the Triton kernels compile for each new batch shape, so a whole
    # workload runs once untimed there; on the CPU the compiled kernels are built by a short run.
    warm_up = make_prompts(args.num_prompts, args.prompt_len, model.config.vocab_size, seed=1)
    if args.on_cuda:
        run_engine(llm, warm_up, args.output_len)
    else:
        run_engine(llm, warm_up[:2], 2)
    engine_s, engine_out = run_engine(llm, prompts, args.output_len)
    print(f"  engine: {engine_s:.1f} s", flush=True)
    batch_s, _ = run_transformers(model, prompts, args.output_len, batch=True)
    print(f"  transformers batch: {batch_s:.1f} s", flush=True)
    single_s, single_out = run_transformers(model, prompts, args.output_len, batch=False)
    print(f"  transformers one-at-a-time: {single_s:.1f} s", flush=True)

    num_equal = sum(a == b for a, b in zip(engine_out, single_out))
    result = {
        "preset": preset,
        "device": args.device,
        "engine_tok_s": num_out / engine_s,
        "hf_batch_tok_s": num_out / batch_s,
        "hf_single_tok_s": num_out / single_s,
        "engine_over_single": single_s / engine_s,
        "hf_batch_over_single": single_s / batch_s,
        "outputs_identical": num_equal == len(prompts),
        "num_identical": num_equal,
        "preemptions": llm.engine.scheduler.num_preemptions,
    }
    print(json.dumps(result, indent=1), flush=True)
    return result


def plot(results: list[dict], out_dir: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        labels = ["transformers\none at a time", "transformers\nbatch", "pdserve\nengine"]
        values = [r["hf_single_tok_s"], r["hf_batch_tok_s"], r["engine_tok_s"]]
        ax.bar(labels, values, color=["#999", "#69c", "#e73"])
        ax.set_title(f"{r['preset']} ({r['device']}): engine {r['engine_over_single']:.1f}x one-at-a-time")
        ax.set_ylabel("output tokens/s")
    fig.tight_layout()
    device_type = torch.device(results[0]["device"]).type
    path = out_dir / f"offline_throughput{'' if device_type == 'cpu' else '_' + device_type}.png"
    fig.savefig(path, dpi=100)
    return path


def main() -> None:
    args = parse_args()
    results = [bench_preset(p, args) for p in args.presets.split(",")]
    path = plot(results, Path(args.out_dir))
    if path:
        print(f"plot: {path}")
    name = torch.cuda.get_device_name(args.device) if args.on_cuda else "cpu"
    summary = {"device": args.device, "device_name": name, "threads": torch.get_num_threads(), "results": results}
    from results_io import write_result

    write_result("offline_throughput", summary)


if __name__ == "__main__":
    main()
