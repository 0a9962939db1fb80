"""Decode latency: the offline engine's time per output token (TPOT) at small batch sizes.

For each batch size B: B prompts of P random token ids, generated greedily once with 1 output
token and once with O + 1 (EOS ignored); TPOT = (second time - first time) / O, so the prefill
and start-up cancel out. Both are run --repeats times, alternated, and the medians taken. This is
the decode node's case when few requests are running (low load, or the tail of a burst), on the
threads given (--threads 1: a decode node on one core, as in the 1P+1D layouts).

    .venv/bin/python benchmarks/decode_latency.py [--preset small] [--dtype float32] \\
        [--threads 1] [--batch-sizes 1,3,8,16] [--repeats 3]

Ends with one line `RESULT {json}`. Run by itself: other work on the cores moves the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.offline_throughput import make_prompts, model_dir_for  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-sizes", default="1,3,8,16")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(str(model_dir_for(args.preset)), dtype=args.dtype)
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = make_prompts(batch, args.prompt_len, llm.tokenizer.vocab_size)
        short = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
        long = SamplingParams(max_tokens=args.output_len + 1, ignore_eos=True, temperature=0.0)
        llm.generate(prompts, long, use_tqdm=False)  # warm-up
        times: dict[str, list[float]] = {"short": [], "long": []}
        for _ in range(args.repeats):
            for name, params in (("short", short), ("long", long)):
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                times[name].append(time.perf_counter() - start)
        tpot_ms = 1000 * (statistics.median(times["long"]) - statistics.median(times["short"])) / args.output_len
        rows.append({"batch": batch, "tpot_ms": round(tpot_ms, 2), "tok_s": round(batch * 1000 / tpot_ms, 1)})
        print(f"batch {batch:3d}: TPOT {tpot_ms:6.2f} ms ({batch * 1000 / tpot_ms:7.1f} tok/s)", flush=True)
    result = {"preset": args.preset, "dtype": args.dtype, "threads": args.threads, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "rows": rows}
    from results_io import write_result

    write_result("decode_latency", result)


if __name__ == "__main__":
    main()
