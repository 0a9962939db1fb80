"""`pdserve generate --model DIR "prompt" ...`: offline completions printed to stdout."""

from __future__ import annotations

import argparse
import sys

from engine.protocol import DTYPE_CHOICES
from kernels.select import BACKENDS as KERNEL_BACKENDS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", help="prompt texts")
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (default: models/smollm2, SmolLM2-135M-Instruct, made if missing)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="weights and KV cache; auto: float32 on the CPU, on CUDA the checkpoint's bfloat16 or "
                             "float16 (bfloat16 for a float32 checkpoint)")
    parser.add_argument("--kernel-backend", default="auto", choices=KERNEL_BACKENDS,
                        help="compute backend: auto (Triton on CUDA, the compiled CPU kernels on the CPU), cpu, "
                             "triton, or reference (plain torch)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (CUDA when available)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the checkpoint's")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs (neither decode steps' nor the pieces of steps with prompt tokens)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="ranks the model is split over: one process each (one GPU each on CUDA)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")


def main(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.model_files import check_model_dir
    from engine.sampling_params import SamplingParams
    from pdserve.default_model import ensure_default_model

    model_dir = args.model or str(ensure_default_model())
    try:
        check_model_dir(model_dir)
        llm = LLM(model_dir, dtype=args.dtype, kernel_backend=args.kernel_backend, device=args.device,
                  max_model_len=args.max_model_len, decode_graphs="off" if args.enforce_eager else "auto",
                  tensor_parallel_size=args.tensor_parallel_size)
    except ValueError as exc:  # the user's mistake (a device, a length): one line, no traceback
        print(f"pdserve generate: {exc}", file=sys.stderr)
        return 2
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
    )
    with llm:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
        else:
            outputs = llm.generate(args.prompts, params)
    for prompt, output in zip(args.prompts, outputs):
        completion = output.outputs[0]
        print(f"--- {prompt!r} ({completion.finish_reason}, {len(completion.token_ids)} tokens)")
        print(completion.text)
    return 0
