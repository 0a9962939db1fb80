"""Tensor parallelism against one rank: the same model, the same work, TP=1 and TP=N side by side.

Both engines are built once and timed in alternated rounds (the order flips each round; these
machines drift by 20%), each round measuring on each engine:
  decode   the median step of a pure decode batch (--batches sequences of --prompt-len random
           tokens, prefilled first, then --steps timed steps);
  prefill  one prompt of --prefill-len tokens in one step.
The ratio TP=N / TP=1 per round and its median are the result. On the CPU the ranks are gloo
processes sharing the host's cores (each rank takes its share of the threads); on CUDA each rank
its own GPU over NCCL, run only where enough GPUs are visible (else the record says so).

    python3 benchmarks/tensor_parallel.py [--preset small] [--device cpu] [--sizes 1,2] [--rounds 3]

--smoke runs it at toy sizes (the suite's check of this script; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.results_io import write_result  # noqa: E402
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.make_model import make_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="make-model preset, made into --models-dir unless there")
    parser.add_argument("--model", default=None, help="a checkpoint directory instead of --preset")
    parser.add_argument("--models-dir", default=str(REPO / ".cache" / "models"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sizes", default="1,2", help="tensor-parallel sizes; the first is the baseline")
    parser.add_argument("--batches", default="1,16", help="decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batches, args.prompt_len, args.prefill_len, args.steps, args.rounds = "1", 8, 16, 3, 1
    return args


def model_dir(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    path = Path(args.models_dir) / f"{args.preset}-seed0"
    if not (path / "config.json").exists():
        print(f"making {args.preset} into {path} ...", flush=True)
        make_model(path, args.preset, seed=0, show_progress=False)
    return path


def build(path: Path, size: int, args: argparse.Namespace, batches: list[int]) -> LLMEngine:
    tokens = max(batches) * (args.prompt_len + args.steps + 8) + args.prefill_len + 64
    return LLMEngine(EngineConfig(
        model=ModelConfig.from_pretrained(path, dtype=args.dtype),
        cache=CacheConfig(num_blocks=tokens // 16 + 8),
        scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(args.prefill_len, 512)),
        device=args.device, tensor_parallel_size=size, enable_prefix_caching=False,
    ))


def decode_step_ms(engine: LLMEngine, batch: int, args: argparse.Namespace, rng: random.Random) -> float:
    """The median of args.steps pure decode steps of batch sequences (prefilled first)."""
    vocab = engine.config.model.vocab_size
    params = SamplingParams(max_tokens=args.steps + 4, temperature=0.0, ignore_eos=True)
    ids = [f"d{i}-{rng.random()}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(8, vocab) for _ in range(args.prompt_len)], params)
    started = set()
    while len(started) < batch:  # prefill every prompt (its first token) before timing
        started.update(out.request_id for out in engine.step())
    times = []
    for _ in range(args.steps):
        begin = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - begin)
    for request_id in ids:
        engine.abort(request_id)
    engine.check_leaks()
    return 1000 * statistics.median(times)


def prefill_step_ms(engine: LLMEngine, args: argparse.Namespace, rng: random.Random) -> float:
    vocab = engine.config.model.vocab_size
    engine.add_request(f"p-{rng.random()}", [rng.randrange(8, vocab) for _ in range(args.prefill_len)],
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    begin = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - begin
    engine.check_leaks()
    return 1000 * elapsed


def measure(engines: dict[int, LLMEngine], args: argparse.Namespace, batches: list[int]) -> list[dict]:
    """Per round, per engine (alternated order): each decode batch's median step and the prefill step."""
    rng = random.Random(0)
    threads = torch.get_num_threads()
    rounds = []
    for round_idx in range(args.rounds):
        order = list(engines) if round_idx % 2 == 0 else list(reversed(engines))
        row: dict[int, dict] = {}
        for size in order:
            engine = engines[size]
            # NOTE: threads are the process's: rank 0 of TP=N runs on its 1/N share, TP=1 on them all.
            torch.set_num_threads(max(1, threads // size))
            decode_step_ms(engine, batches[0], args, rng)  # untimed: this round's first steps on this engine
            row[size] = {"decode_ms": {b: decode_step_ms(engine, b, args, rng) for b in batches},
                         "prefill_ms": prefill_step_ms(engine, args, rng)}
            print(f"round {round_idx + 1}/{args.rounds} TP={size}: " + ", ".join(
                f"decode b={b} {ms:.1f} ms" for b, ms in row[size]["decode_ms"].items())
                + f", prefill {row[size]['prefill_ms']:.1f} ms", flush=True)
        rounds.append(row)
    return rounds


def summarize(rounds: list[dict], sizes: list[int], batches: list[int]) -> dict:
    base = sizes[0]
    summary = {}
    for size in sizes:
        decode = {str(b): statistics.median(r[size]["decode_ms"][b] for r in rounds) for b in batches}
        prefill = statistics.median(r[size]["prefill_ms"] for r in rounds)
        ratios = {str(b): statistics.median(r[size]["decode_ms"][b] / r[base]["decode_ms"][b] for r in rounds)
                  for b in batches}
        summary[str(size)] = {
            "decode_step_ms": decode, "prefill_step_ms": prefill,
            "decode_over_base": ratios,
            "prefill_over_base": statistics.median(r[size]["prefill_ms"] / r[base]["prefill_ms"] for r in rounds),
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    path = model_dir(args)
    threads = torch.get_num_threads()
    result = {"preset": args.model and Path(args.model).name or args.preset, "device": args.device,
              "dtype": args.dtype, "sizes": sizes, "batches": batches, "prompt_len": args.prompt_len,
              "prefill_len": args.prefill_len, "steps": args.steps, "rounds": args.rounds,
              "threads": threads, "smoke": args.smoke}
    if args.device.startswith("cuda") and torch.cuda.device_count() < max(sizes):
        result["skipped"] = f"{torch.cuda.device_count()} GPU(s) visible, TP={max(sizes)} needs {max(sizes)}"
        write_result("tensor_parallel", result)
        return 0
    engines = {}
    try:
        for size in sizes:
            engines[size] = build(path, size, args, batches)
            torch.set_num_threads(threads)  # a TP engine set rank 0's share: measure() sets each's
        rounds = measure(engines, args, batches)
    finally:
        for engine in engines.values():
            engine.close()
        torch.set_num_threads(threads)
    result["rounds_ms"] = [{str(size): r[size] for size in sizes} for r in rounds]
    result["summary"] = summarize(rounds, sizes, batches)
    write_result("tensor_parallel", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
