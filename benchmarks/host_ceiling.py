"""The host's ceiling: what one engine's Python side costs a decode step when the device's work is
free, beside the GPU's step from the newest gpu_engine record.

On a GPU, async scheduling prepares step N+1 and reads step N while the device runs: the device
never waits as long as the host's work for a step (scheduling, staging the static buffers,
launching, reading the tokens, finishing requests) takes less than the device's step. This runs the
engine on the CPU on the same static decode path (decode_graphs static, async scheduling on) with
each decode step's forward replaced by fixed outputs, so a step's wall time is the host's alone:
per batch, the median step and its cost per sequence, and the output tokens/s it allows. What it
leaves out: the CUDA calls themselves (a graph launch and a few queued copies, tens of
microseconds a step). Prompts are prefilled by the real model (`tiny` by default: the model's size
does not enter the timed steps).

    .venv/bin/python benchmarks/host_ceiling.py [--batches 1,16,64,256] [--steps 64] [--kernel-backend reference]

Ends with `RESULT {json}`. Run it alone: other work on the cores moves the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import gpu_engine  # noqa: E402
from benchmarks.offline_throughput import model_dir_for  # noqa: E402
from benchmarks.results_io import RESULTS_DIR, write_result  # noqa: E402
from engine.config import CacheConfig  # noqa: E402
from engine.decode_graphs import DecodeOutputs  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.protocol import default_of, num_blocks_for  # noqa: E402

# A step's token budget (the prompts' prefill).
BUDGET = 8192
# Every decode step's token (the requests ignore eos: nothing stops on it).
FIXED_TOKEN = 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=512, help="as gpu_engine's decode phase")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per batch")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the prompts' prefill)")
    parser.add_argument("--kernel-backend", default="auto",
                        help="the prompts' prefill only (reference: where the CPU kernels are not built)")
    return parser.parse_args(argv)


def free_forward(graphs) -> list[int]:
    """Replace graphs' decode forward (engine.decode_graphs.DecodeGraphs._forward, what a replay
    runs) with fixed outputs of each bucket; returns a list that counts the calls."""
    calls: list[int] = []
    vocab, dtype = graphs.model.config.vocab_size, graphs.model.config.dtype
    outputs: dict[int, DecodeOutputs] = {}

    def forward(self, size: int) -> DecodeOutputs:
        calls.append(size)
        if size not in outputs:
            outputs[size] = DecodeOutputs(torch.zeros(size, vocab, dtype=dtype),
                                          torch.full((size,), FIXED_TOKEN, dtype=torch.int64))
        return outputs[size]

    graphs._forward = types.MethodType(forward, graphs)
    return calls


def max_tokens(batch: int, prompt_len: int, num_steps: int) -> int:
    """Enough for the first sequences, which decode while the last prompts are still prefilled
    (BUDGET tokens a step), to run the warm-up and the timed steps."""
    return num_steps + 3 + -(-batch * prompt_len // BUDGET) + 8


def host_steps(llm: LLM, batch: int, prompt_len: int, num_steps: int) -> list[float]:
    """Seconds of num_steps engine steps of `batch` decoding sequences, each on the static path."""
    return gpu_engine.decode_steps(llm, batch, llm.engine.config.model.vocab_size, num_steps, prompt_len=prompt_len,
                                   max_tokens=max_tokens(batch, prompt_len, num_steps))


def newest_gpu_steps(folder: Path = RESULTS_DIR) -> dict | None:
    """The newest gpu_engine record's decode steps (a smoke run's are none): {"gpu", "commit", "preset",
    "step_ms": {batch: ms}}."""
    runs = [(record["date"], i, record, preset)
            for record in (json.loads(path.read_text()) for path in folder.glob("gpu_engine-*.json"))
            if not record["result"].get("smoke")  # gpu_engine --smoke: the script checked at toy sizes, no GPU
            for i, preset in enumerate(record["result"].get("presets", [])) if preset.get("decode")]
    if not runs:
        return None
    *_, record, preset = max(runs, key=lambda run: run[:2])  # the newest record's last preset with decode steps
    return {"gpu": record["result"]["hardware"]["gpu"], "commit": record["commit"], "preset": preset["preset"],
            "step_ms": {str(row["batch"]): row["step_ms_median"] for row in preset["decode"]}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    gpu = newest_gpu_steps()
    rows = []
    for caching in (False, True):
        rows += measure(args, batches, caching, gpu)
    write_result("host_ceiling", {"preset": args.preset, "prompt_len": args.prompt_len, "steps": args.steps,
                                  "gpu_record": gpu and {k: gpu[k] for k in ("gpu", "commit", "preset")},
                                  "rows": rows})
    return 0


def measure(args: argparse.Namespace, batches: list[int], caching: bool, gpu: dict | None) -> list[dict]:
    """One engine's rows (prefix caching as caching: off as in gpu_engine, on as a node's default)."""
    longest = args.prompt_len + max_tokens(max(batches), args.prompt_len, args.steps)
    llm = LLM(str(model_dir_for(args.preset)), device="cpu", dtype="float32", decode_graphs="static",
              max_model_len=longest, max_num_seqs=max(batches), max_num_batched_tokens=max(BUDGET, args.prompt_len),
              num_blocks=max(batches) * (num_blocks_for(longest, default_of(CacheConfig, "block_size")) + 1),
              enable_prefix_caching=caching,
              kernel_backend=args.kernel_backend)
    calls = free_forward(llm.engine.runner.graphs)
    rows = []
    print(f"prefix caching {'on' if caching else 'off'}:", flush=True)
    for batch in batches:
        before = len(calls)
        times = host_steps(llm, batch, args.prompt_len, args.steps)
        assert len(calls) - before >= args.steps, "the timed steps did not run on the static decode path"
        step_ms = 1e3 * statistics.median(times)
        row = {"prefix_caching": caching, "batch": batch, "step_ms_median": step_ms, "step_ms_min": 1e3 * min(times),
               "step_ms_max": 1e3 * max(times), "us_per_sequence": 1e3 * step_ms / batch,
               "ceiling_tok_s": batch / (step_ms / 1e3)}
        gpu_ms = (gpu or {}).get("step_ms", {}).get(str(batch))
        if gpu_ms:
            row["gpu_step_ms"] = gpu_ms
            row["host_over_gpu"] = step_ms / gpu_ms
        rows.append(row)
        beside = f", {row['host_over_gpu']:.2f}x the GPU's {gpu_ms:.3f} ms" if gpu_ms else ""
        print(f"  batch {batch:>3}: host {step_ms:.3f} ms a step ({row['us_per_sequence']:.1f} us a sequence, "
              f"{row['ceiling_tok_s']:,.0f} tok/s at most){beside}", flush=True)
    llm.close()
    return rows


if __name__ == "__main__":
    sys.exit(main())
