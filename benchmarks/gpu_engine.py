"""The engine on one GPU against the hardware's bounds and transformers, in bfloat16.

For each preset (llama-1b by default; llama-8b where time allows), in one process:
  hardware  the GPU's copy bandwidth (device-to-device copy of 2 GiB) and bf16 matmul rate
            (8192^3), measured: the bounds below are taken from these, not from the datasheet.
  decode    the median step of a pure decode batch of 1/16/64/256 sequences (512-token prompts,
            then 24 timed steps), beside the bound (weights + the KV the step reads, over the
            copy bandwidth); with CUDA graphs and, for batches 1 and 64, eagerly (--enforce-eager).
  prefill   prompts of 512/2,048/8,192 tokens, 16,384 tokens in all, one step each: tokens/s and
            MFU (the step's matmul and attention FLOPs over the measured matmul rate); and one
            prompt of 128 or 512 tokens alone, with its step's graph pieces and eagerly.
  profile   for batches 1 and 256 (graphs on), 8 decode steps under torch.profiler: the GPU's busy
            time a step (its kernels' time summed) against the step's wall time, the kernels a
            step runs and the costliest ones: where the step's time goes.
  layouts   each projection at 1/16/64/256/2,048 rows as x @ W^T (the backend's form) and as
            F.linear(x, W), and at up to 16 rows on the Triton small-batch kernel (both forms; on W
            at 1 and 16 rows under other tunings too), in CUDA graphs: which form of a weight and
            which kernel read nearer the copy bandwidth.
  decode_w  the decode phase again with the Triton backend keeping its weights as stored
            (PDSERVE_TRITON_WEIGHTS=as-stored: W, used as F.linear uses it) instead of transposed:
            the two forms end to end.
  decode_fused  batches 1 and 16 again on the Triton backend's fused small-batch layers
            (PDSERVE_TRITON_FUSED_DECODE=1, weights as stored): against decode_w, whether they
            should be the default (PDSERVE_TRITON_FUSED_DECODE_MAX_ROWS keeps them to small batches).
  attention the decode attention kernel alone at batches 1/64/256 (the decode phase's context, a
            block table as wide as the graphs', on the engine's cache), with the backend's tuning and
            others (token tile, warps, stages, the fewest tokens a split gets): which to keep.
  offline   256 prompts x 512 random tokens -> 128 (ignore_eos): output tokens/s, greedy and drawn
            at temperature 1; the seconds of the steps with prompt tokens and of the decode steps.
  hf        transformers generate (sdpa, one batch of 256) on the same work and GPU.
Models are made on the device (pdserve make-model, random weights drawn on the GPU) into
--models-dir unless there. --budget-s bounds the whole run: a phase that would not fit is skipped
and said so. Ends with `RESULT {json}`; benchmarks/render_results.py renders the table and plot.

    python3 benchmarks/gpu_engine.py [--presets llama-1b,llama-8b] [--budget-s 330]

--smoke --device cpu --model DIR runs every phase at toy sizes on the CPU (the suite's check of
this script; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.results_io import write_result  # noqa: E402
from benchmarks.stopping import Stopped, stop_on_sigterm  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from kernels.triton.decode_attention import DEFAULT_TUNING, Tuning, decode_attention  # noqa: E402
from kernels.triton.small_linear import SMALL_ROWS, SmallTuning, small_linear  # noqa: E402
from pdserve.make_model import make_model  # noqa: E402


class Sizes:
    decode_batches = (1, 16, 64, 256)
    profile_batches = (1, 256)
    profile_steps = 8
    eager_batches = (1, 64)
    fused_batches = (1, 16)
    attention_batches = (1, 64, 256)
    prefill_lengths = (512, 2048, 8192)
    short_prefills = (128, 512)
    prefill_tokens = 16384
    decode_prompt = 512
    timed_steps = 24
    offline = (256, 512, 128)  # prompts, prompt tokens, output tokens
    layout_rows = (1, 16, 64, 256, 2048)
    hardware_elems = 1 << 30
    matmul_n = 8192


class SmokeSizes(Sizes):
    decode_batches = (1, 3)
    profile_batches = (3,)
    profile_steps = 2
    eager_batches = (2,)
    fused_batches = (1, 3)
    attention_batches = (1, 3)
    prefill_lengths = (32, 64)
    short_prefills = (16, 40)
    prefill_tokens = 128
    decode_prompt = 20
    timed_steps = 3
    offline = (6, 24, 5)
    layout_rows = (1, 3)
    hardware_elems = 1 << 20
    matmul_n = 256


S: type[Sizes] = Sizes
DEVICE = "cuda"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="llama-1b")
    parser.add_argument("--models-dir", default=str(REPO / ".cache" / "models"))
    parser.add_argument("--phases",
                        default="decode,eager,prefill,profile,layouts,offline,decode_w,decode_fused,attention,hf")
    parser.add_argument("--budget-s", type=float, default=330.0, help="the whole run, model creation included")
    parser.add_argument("--kv-cache-gb", type=float, default=24.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="this checkpoint instead of the presets")
    parser.add_argument("--smoke", action="store_true", help="toy sizes (a check of the script, on any device)")
    return parser.parse_args()


class Clock:
    def __init__(self, budget_s: float) -> None:
        self.start = time.monotonic()
        self.budget_s = budget_s

    @property
    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def allows(self, phase: str, need_s: float) -> bool:
        if self.left_s >= need_s:
            return True
        print(f"  skipped {phase}: needs ~{need_s:.0f} s, {self.left_s:.0f} s left", flush=True)
        return False


def sync() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def measure_hardware() -> dict:
    x = torch.empty(S.hardware_elems, dtype=torch.bfloat16, device=DEVICE)
    y = torch.empty_like(x)
    n = S.matmul_n
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    copy_s = _timed(lambda: y.copy_(x), 20)
    matmul_s = _timed(lambda: a @ a, 20)
    name = torch.cuda.get_device_name() if DEVICE != "cpu" else "cpu"
    return {"gpu": name, "copy_bandwidth_gbs": 2 * x.numel() * 2 / copy_s / 1e9,
            "bf16_matmul_tflops": 2 * n**3 / matmul_s / 1e12}


def _timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def prompts_of(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(length)] for _ in range(num)]


def load(model_dir: Path, args, enforce_eager: bool = False, weights_as_stored: bool = False,
         fused_decode: bool = False) -> tuple[LLM, float]:
    """weights_as_stored: the Triton backend keeps each projection's weight as the checkpoint has it
    (W, F.linear's form) instead of transposed (W^T, its default); fused_decode: its small decode
    batches run the fused layers. Both for this engine only, by the switches a server takes
    (PDSERVE_TRITON_WEIGHTS=as-stored, PDSERVE_TRITON_FUSED_DECODE=1, set while it loads)."""
    from kernels.triton.backend import FUSED_DECODE_ENV, WEIGHTS_ENV

    start = time.perf_counter()
    switches = {WEIGHTS_ENV: "as-stored" if weights_as_stored else "transposed",
                FUSED_DECODE_ENV: "1" if fused_decode else "0"}
    with mock.patch.dict(os.environ, switches):
        return _load(model_dir, args, enforce_eager), time.perf_counter() - start


def _load(model_dir: Path, args, enforce_eager: bool) -> LLM:
    graphs = "off" if enforce_eager else ("static" if DEVICE == "cpu" else "auto")
    return LLM(str(model_dir), dtype="bfloat16", device=DEVICE, max_model_len=S.prefill_lengths[-1] + 256,
               max_num_seqs=max(S.decode_batches), max_num_batched_tokens=S.prefill_tokens,
               kv_cache_memory_bytes=int(args.kv_cache_gb * (1 << 30)), enable_prefix_caching=False,
               decode_graphs=graphs)


def decode_steps(llm: LLM, batch: int, vocab: int, num_steps: int | None = None, around=None,
                 prompt_len: int | None = None, max_tokens: int | None = None) -> list[float]:
    """Per-step seconds of num_steps (default TIMED_STEPS) pure decode steps of `batch` sequences
    of prompt_len (default S.decode_prompt) random tokens; around: a context manager the timed
    steps run inside (a profiler); max_tokens: each sequence's (default num_steps + 16), enough for
    those that decode while the last prompts are prefilled to decode on through the timed steps."""
    engine = llm.engine
    num_steps = num_steps or S.timed_steps
    params = SamplingParams(max_tokens=max_tokens or num_steps + 16, temperature=0.0, ignore_eos=True)
    ids = [f"d{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, prompts_of(batch, prompt_len or S.decode_prompt, vocab, batch)):
        engine.add_request(rid, prompt, params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    with around if around is not None else contextlib.nullcontext():
        for _ in range(num_steps):
            start = time.perf_counter()
            outputs = engine.step()
            times.append(time.perf_counter() - start)
            assert len(outputs) == batch, f"{len(outputs)} outputs in a step of {batch} decodes"
        if engine.kv_cache.is_cuda:  # NOTE: the engine's device, not DEVICE: host_ceiling runs it on the CPU
            torch.cuda.synchronize(engine.kv_cache.device)
    for rid in ids:
        engine.abort(rid)
    return times


def run_profile(llm: LLM, vocab: int) -> list[dict]:
    """Where a decode step's time goes: its kernels' summed time (the GPU busy) against its wall
    time, and the kernels costing most a step (on the CPU: the aten ops' own time instead)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    rows = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE != "cpu" else [])
    for batch in S.profile_batches:
        prof = profile(activities=activities)
        times = decode_steps(llm, batch, vocab, S.profile_steps, around=prof)
        steps = len(times)
        per_kernel: dict[str, list[float]] = {}
        for event in prof.events():
            on_device = event.device_type == DeviceType.CUDA
            if on_device or (DEVICE == "cpu" and event.name.startswith("aten::")):
                us = event.time_range.elapsed_us() if on_device else event.self_cpu_time_total
                per_kernel.setdefault(event.name, []).append(us)
        busy_ms = sum(sum(v) for v in per_kernel.values()) / 1e3 / steps
        top = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:12]
        step_ms = 1e3 * statistics.median(times)
        categories: dict[str, list[float]] = {}
        for name, v in per_kernel.items():
            entry = categories.setdefault(kernel_category(name), [0.0, 0.0])
            entry[0] += sum(v) / steps
            entry[1] += len(v) / steps
        row = {"batch": batch, "step_ms_median": step_ms, "busy_ms_per_step": busy_ms,
               "kernels_per_step": sum(len(v) for v in per_kernel.values()) / steps,
               "categories": {c: {"us_per_step": us, "calls_per_step": n}
                              for c, (us, n) in sorted(categories.items(), key=lambda kv: -kv[1][0])},
               "top": [{"name": name[:120], "us_per_step": sum(v) / steps, "calls_per_step": len(v) / steps}
                       for name, v in top]}
        rows.append(row)
        print(f"  profile batch {batch:>3}: step {step_ms:.3f} ms (profiled), kernels busy {busy_ms:.3f} ms a step "
              f"({100 * busy_ms / step_ms:.0f}%), {row['kernels_per_step']:.0f} kernels a step; costliest:", flush=True)
        print("    by kind: " + ", ".join(f"{c} {v['us_per_step']:.0f} us x{v['calls_per_step']:.0f}"
                                         for c, v in row["categories"].items()), flush=True)
        for kernel in row["top"]:
            print(f"    {kernel['us_per_step']:8.1f} us x{kernel['calls_per_step']:5.1f}  {kernel['name'][:90]}",
                  flush=True)
    return rows


# A kernel's kind, from the first of these its name holds (cuBLAS's GEMM kernels, the Triton
# backend's kernels by their function names, torch's own; the fused QKV-with-rotary projection is a matmul).
_KERNEL_KINDS = (("matmul", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk", "aten::mm", "aten::addmm",
                             "linear", "_qkv_rotary")),
                 ("attention", ("attention", "_decode_reduce")), ("norm", ("rms_norm",)),
                 ("rotary+kv", ("rotary", "write_kv")), ("silu", ("silu",)),
                 ("copy", ("copy", "memcpy", "memset", "index", "gather", "scatter", "cat")),
                 ("sampling", ("argmax", "softmax", "exponential", "sort", "topk", "reduce")))


def kernel_category(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in _KERNEL_KINDS if any(mark in lowered for mark in marks)), "other")


def model_bytes(llm: LLM, model_dir: Path) -> dict:
    """What a decode step must read, from the checkpoint's shapes: every layer's weights and the LM
    head once (a tied LM head is the embedding), an untied embedding's row per sequence
    (embedding_row_bytes), and the KV bytes of one token."""
    cfg = llm.engine.config.model
    tied = json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings", False)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    layer_params = cfg.num_layers * per_layer
    params = layer_params + cfg.vocab_size * cfg.hidden_size
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * cfg.dtype.itemsize
    return {"weight_bytes": params * cfg.dtype.itemsize, "kv_bytes_per_token": kv_per_token,
            "embedding_row_bytes": 0 if tied else cfg.hidden_size * cfg.dtype.itemsize, "layer_params": layer_params}


def run_decode(llm: LLM, sizes: dict, hw: dict, vocab: int, batches) -> list[dict]:
    rows = []
    for batch in batches:
        times = decode_steps(llm, batch, vocab)
        context = S.decode_prompt + 8
        read_bytes = sizes["weight_bytes"] + batch * (context * sizes["kv_bytes_per_token"]
                                                       + sizes["embedding_row_bytes"])
        bound_s = read_bytes / (hw["copy_bandwidth_gbs"] * 1e9)
        median = statistics.median(times)
        rows.append({"batch": batch, "step_ms_median": 1e3 * median, "step_ms_min": 1e3 * min(times),
                     "step_ms_max": 1e3 * max(times), "bound_ms": 1e3 * bound_s, "of_bound": bound_s / median})
        print(f"  decode batch {batch:>3}: median {1e3 * median:.3f} ms (min {1e3 * min(times):.3f}), bound "
              f"{1e3 * bound_s:.3f} ms: {100 * bound_s / median:.0f}% of it", flush=True)
    return rows


def prefill_times(llm: LLM, num: int, length: int, vocab: int, runs: int, seed: int) -> list[float]:
    """Seconds of each of `runs` one-step prefills (max_tokens 1) of num fresh prompts of length
    tokens; the first warms up: callers read times[1:]."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for run in range(runs):
        prompts = prompts_of(num, length, vocab, seed + 1000 * run)
        sync()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return times


def run_short_prefills(llm: LLM, vocab: int) -> list[dict]:
    """One prompt of each short length alone, one step (max_tokens 1): its wall time, the host's
    launches against the GPU's work (mixed graphs where the engine has them, eager where not)."""
    rows = []
    for length in S.short_prefills:
        times = prefill_times(llm, 1, length, vocab, 6, 500 + length)
        best = min(times[1:])
        rows.append({"prompt_len": length, "ms": 1e3 * best, "ms_median": 1e3 * statistics.median(times[1:])})
        print(f"  one {length}-token prompt alone: {1e3 * best:.2f} ms (median {rows[-1]['ms_median']:.2f})",
              flush=True)
    return rows


def run_prefill(llm: LLM, sizes: dict, hw: dict, vocab: int) -> list[dict]:
    cfg = llm.engine.config.model
    rows = []
    for length in S.prefill_lengths:
        num = S.prefill_tokens // length
        best = min(prefill_times(llm, num, length, vocab, 3, length)[1:])
        flops = (2 * num * length * sizes["layer_params"]
                 + 2 * num * cfg.vocab_size * cfg.hidden_size  # the LM head, last token of each
                 + 2 * 2 * num * length * length / 2 * cfg.num_heads * cfg.head_dim * cfg.num_layers)
        mfu = flops / best / (hw["bf16_matmul_tflops"] * 1e12)
        rows.append({"prompt_len": length, "num_prompts": num, "seconds": best, "tokens_per_s": num * length / best,
                     "tflops": flops / best / 1e12, "of_matmul_rate": mfu})
        print(f"  prefill {num} x {length}: {1e3 * best:.1f} ms, {num * length / best:,.0f} tok/s, "
              f"{flops / best / 1e12:.0f} TFLOP/s = {100 * mfu:.0f}% of the matmul rate", flush=True)
    return rows


def run_offline(llm: LLM, vocab: int, temperature: float = 0.0) -> dict:
    """The offline run's output tokens/s, and where its time went: each engine step's wall time,
    summed over the steps that ran prompt tokens (prefill, mixed) and over pure decode steps.
    temperature > 0: every token drawn (the sampler on the device) instead of the greedy argmax."""
    num, length, out_len = S.offline
    params = SamplingParams(max_tokens=out_len, temperature=temperature, ignore_eos=True)
    llm.generate(prompts_of(max(1, num // 8), length, vocab, 7), params, use_tqdm=False)  # warm
    prompts = prompts_of(num, length, vocab, 8)
    engine = llm.engine
    steps: list[tuple[float, int]] = []  # (seconds, prompt tokens it scheduled)
    real_step, real_schedule = engine.step, engine.scheduler.schedule
    scheduled_tokens = [0]

    def schedule():
        out = real_schedule()
        scheduled_tokens[0] += out.num_prefill_tokens
        return out

    def step():
        scheduled_tokens[0] = 0
        started = time.perf_counter()
        outputs = real_step()
        steps.append((time.perf_counter() - started, scheduled_tokens[0]))
        return outputs

    engine.step, engine.scheduler.schedule = step, schedule
    try:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        del engine.step, engine.scheduler.schedule
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    prefill = [t for t, tokens in steps if tokens]
    decode = [t for t, tokens in steps if not tokens]
    row = {"seconds": seconds, "output_tokens_per_s": num_out / seconds, "temperature": temperature,
           "prefill_steps": len(prefill), "prefill_steps_s": sum(prefill),
           "decode_steps": len(decode), "decode_steps_s": sum(decode),
           "decode_step_ms_median": 1e3 * statistics.median(decode) if decode else None}
    print(f"  offline {num} x {length} -> {out_len} (temperature {temperature}): {seconds:.2f} s, "
          f"{num_out / seconds:,.0f} output tok/s; {len(prefill)} steps with prompt tokens {sum(prefill):.3f} s, "
          f"{len(decode)} decode steps {sum(decode):.3f} s, the rest {seconds - sum(prefill) - sum(decode):.3f} s",
          flush=True)
    return row


def run_layouts(llm: LLM, hw: dict) -> list[dict]:
    """Each projection of the model (QKV, O, gate/up, down, LM head) at a decode batch of 1, 16, 64
    and 256 rows and a 2,048-token prefill, in the two forms a weight can take for torch's matmul:
    x @ W^T with W^T stored contiguous (the backend's form) and F.linear(x, W) with W as the
    checkpoint has it. Timed as back-to-back calls captured in a CUDA graph (no launch gaps), each on
    the next of enough copies of the weight that none is still in the L2 cache when its turn comes
    again (as in a decode step, which reads each layer's weight once): microseconds and the weight's
    bytes over that time against the copy bandwidth."""
    cfg = llm.engine.config.model
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"qkv": (q + 2 * kv, cfg.hidden_size), "o": (cfg.hidden_size, q),
              "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size),
              "lm_head": (cfg.vocab_size, cfg.hidden_size)}
    rows = []
    small_rows = [m for m in S.layout_rows if m <= SMALL_ROWS]
    tuned_rows = {small_rows[0], small_rows[-1]} if small_rows else set()  # one row, and the most it takes
    for name, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features, dtype=torch.bfloat16, device=DEVICE) * 0.02
        nbytes = weight.numel() * weight.element_size()
        weights = [weight] + [weight.clone() for _ in range(_copies_past_l2(nbytes) - 1)]
        weights_t = [w.t().contiguous() for w in weights]
        for m in S.layout_rows:
            x = torch.randn(m, in_features, dtype=torch.bfloat16, device=DEVICE)
            times = {"wt": _timed_calls([partial(torch.matmul, x, w) for w in weights_t]),
                     "w": _timed_calls([partial(torch.nn.functional.linear, x, w) for w in weights])}
            if m <= SMALL_ROWS and _triton_runs():  # the Triton small-batch kernel, on W^T and on W
                times["small_wt"] = _timed_calls([partial(small_linear, x, w) for w in weights_t])
                times["small_w"] = _timed_calls([partial(small_linear, x, w.t()) for w in weights])
            row = {"proj": name, "rows": m}
            for form, seconds in times.items():
                row[f"us_{form}"] = 1e6 * seconds
                row[f"of_copy_bw_{form}"] = nbytes / seconds / (hw["copy_bandwidth_gbs"] * 1e9)
            if m in tuned_rows and _triton_runs():  # the kernel's other tunings, on W
                row["small_tunings"] = []
                for tuning in SMALL_TUNINGS:
                    seconds = _timed_calls([partial(small_linear, x, w.t(), tuning=tuning) for w in weights])
                    row["small_tunings"].append({"tuning": dataclasses.asdict(tuning), "us": 1e6 * seconds,
                                                 "of_copy_bw": nbytes / seconds / (hw["copy_bandwidth_gbs"] * 1e9)})
            rows.append(row)
            print(f"  layout {name:>7} x {m:>4} rows: " + ", ".join(
                f"{form} {row[f'us_{form}']:8.1f} us ({100 * row[f'of_copy_bw_{form}']:3.0f}% bw)" for form in times),
                flush=True)
        del weights, weights_t, weight
    return rows


# The small-batch projection kernel's tunings the layouts phase times at one row and at the most rows
# (besides its default): wider K tiles, deeper pipelines, more warps, programs of more columns (each reads
# every row over all of K: at 16 rows, 16 columns a program read the rows far more often than the weight).
SMALL_TUNINGS = (SmallTuning(tile_bytes=1024, num_stages=2), SmallTuning(num_stages=4),
                 SmallTuning(tile_bytes=256, num_stages=4), SmallTuning(num_warps=8), SmallTuning(block_n=32),
                 SmallTuning(tile_bytes=256, block_n=64))

# The decode attention kernel's tunings the attention phase times: the backend's first, then deeper
# pipelines, wider and narrower token tiles, and splits of fewer tokens (more programs for few sequences).
ATTENTION_TUNINGS = (DEFAULT_TUNING, Tuning(num_stages=3), Tuning(num_stages=4), Tuning(block_n=128, num_warps=8),
                     Tuning(block_n=128, num_warps=8, num_stages=3), Tuning(block_n=32, num_stages=3),
                     Tuning(min_tokens_per_split=128), Tuning(min_tokens_per_split=64))


def run_attention(llm: LLM, hw: dict) -> list[dict]:
    """The Triton decode attention kernel alone, at the decode phase's context and the model's heads,
    reading the engine's own cache (its layers' stride) through a block table as wide as the decode
    graphs' (max_model_len), each sequence on blocks of its own: microseconds a call (in a CUDA
    graph) and the KV it reads over the copy bandwidth, for each of ATTENTION_TUNINGS."""
    engine = llm.engine
    cfg, block_size, cache = engine.config.model, engine.block_size, engine.kv_cache
    context = S.decode_prompt + 8
    blocks = -(-context // block_size)
    width = -(-cfg.max_model_len // block_size)
    kv_bytes = context * 2 * cfg.num_kv_heads * cfg.head_dim * cfg.dtype.itemsize
    rows = []
    for batch in S.attention_batches:
        if batch * blocks > cache.shape[0]:
            print(f"  attention batch {batch}: skipped, the cache has {cache.shape[0]} blocks", flush=True)
            continue
        table = torch.zeros(batch, width, dtype=torch.int32, device=cache.device)
        table[:, :blocks] = torch.randperm(cache.shape[0], device=cache.device)[:batch * blocks].view(batch, blocks)
        lens = torch.full((batch,), context, dtype=torch.int32, device=cache.device)
        query = torch.randn(batch, cfg.num_heads, cfg.head_dim, dtype=cfg.dtype, device=cache.device)
        layers = [cache[:, layer] for layer in range(cache.shape[1])]  # one after another, as a step reads them
        for tuning in ATTENTION_TUNINGS:
            seconds = _timed_calls([partial(decode_attention, query, layer, table, lens, cfg.head_dim ** -0.5,
                                            tuning=tuning) for layer in layers])
            row = {"batch": batch, "tuning": dataclasses.asdict(tuning), "default": tuning == DEFAULT_TUNING,
                   "us": 1e6 * seconds, "of_copy_bw": batch * kv_bytes / seconds / (hw["copy_bandwidth_gbs"] * 1e9)}
            rows.append(row)
            print(f"  attention batch {batch:>3} {_tuning_text(tuning):<44} {row['us']:8.1f} us "
                  f"({100 * row['of_copy_bw']:3.0f}% bw){' (default)' if row['default'] else ''}", flush=True)
    return rows


def _tuning_text(tuning: Tuning) -> str:
    return (f"tile {tuning.block_n}, {tuning.num_warps} warps, {tuning.num_stages} stages, "
            f"splits >= {tuning.min_tokens_per_split}")


# Set by the tests that run the GPU-only columns with the Triton kernels interpreted on the CPU.
TRITON_ON_CPU = False


def _triton_runs() -> bool:
    """Whether the Triton kernels run here: on the GPU, or where a test interprets them on the CPU."""
    return DEVICE != "cpu" or TRITON_ON_CPU


def _copies_past_l2(nbytes: int) -> int:
    """How many copies of an nbytes weight, read in turn, leave none in the L2 cache when its turn
    comes again: the copies after it fill twice the cache (1 on the CPU, where the loop is plain)."""
    if DEVICE == "cpu":
        return 1
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return 1 if nbytes >= 2 * l2_bytes else 1 + -(-2 * l2_bytes // nbytes)


def _timed_calls(fns: list, calls: int = 20) -> float:
    """Seconds a call: at least `calls` back to back, fns in turn, in a CUDA graph, replayed (the
    CPU: a plain loop of the first)."""
    if DEVICE == "cpu":
        return _timed(fns[0], calls)
    calls = max(calls, len(fns))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns[:3]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    return _timed(graph.replay, 5) / calls


def run_hf(model_dir: Path, vocab: int) -> dict:
    import transformers

    num, length, out_len = S.offline
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa").to(DEVICE).eval()
    ids = torch.tensor(prompts_of(num, length, vocab, 8), device=DEVICE)
    with torch.inference_mode():
        model.generate(ids[:8, :16], attention_mask=torch.ones_like(ids[:8, :16]), max_new_tokens=4, do_sample=False)
        sync()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len, min_new_tokens=out_len,
                             do_sample=False)
        sync()
    seconds = time.perf_counter() - start
    num_out = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    print(f"  transformers generate, batch {num}: {seconds:.2f} s, {num_out / seconds:,.0f} output tok/s", flush=True)
    del model
    return {"seconds": seconds, "output_tokens_per_s": num_out / seconds}


def free() -> None:
    """Give back what dropped engines and models held (the caller drops its references first)."""
    gc.collect()
    if DEVICE != "cpu":
        torch.cuda.empty_cache()


def _phase(result: dict, key: str, run) -> None:
    """result[key] = run(); a phase that fails (out of memory included) costs that phase only:
    result[key + "_error"] says why, and what it held is given back."""
    try:
        result[key] = run()
        return
    except Exception as exc:  # noqa: BLE001 - the other phases and the record go on
        print(f"  {key} failed: {exc!r}", flush=True)
        result[f"{key}_error"] = repr(exc)[:300]
    free()  # NOTE: once the exception (its frames, their tensors) is gone


def bench_preset(preset: str, args, clock: Clock, hw: dict, result: dict) -> None:
    """preset's phases, each into result as it ends (what ended stays there if a later one fails
    or SIGTERM comes)."""
    phases = set(args.phases.split(","))
    big = preset == "llama-8b"
    model_dir = Path(args.model) if args.model else Path(args.models_dir) / f"{preset}-bf16"
    if not (model_dir / "config.json").exists():
        if not clock.allows(f"{preset} (making the model)", 120 if big else 30):
            return
        start = time.perf_counter()
        make_model(model_dir, preset, seed=0, show_progress=True, dtype="bfloat16", device=DEVICE)
        result["make_model_s"] = time.perf_counter() - start
    if not clock.allows(f"{preset} (loading)", 90 if big else 40):
        return
    llm, result["load_s"] = load(model_dir, args)
    graphs = result["graphs"] = _capture_record(llm.engine.runner.graphs.report)
    if llm.engine.runner.mixed is not None:
        mixed = result["mixed_graphs"] = _capture_record(llm.engine.runner.mixed.report)
        print(f"{preset}: mixed graphs for steps of up to {mixed['sizes'][-1]} tokens captured in "
              f"{mixed['capture_s']:.1f} s, {mixed['memory_mib']:.0f} MiB", flush=True)
    print(f"{preset}: loaded in {result['load_s']:.1f} s; {len(graphs['sizes'])} decode graphs captured in "
          f"{graphs['capture_s']:.1f} s, {graphs['memory_mib']:.0f} MiB", flush=True)
    vocab = llm.engine.config.model.vocab_size
    sizes = model_bytes(llm, model_dir)
    result.update(sizes)
    if "decode" in phases and clock.allows("decode", 40):
        _phase(result, "decode", partial(run_decode, llm, sizes, hw, vocab, S.decode_batches))
    if "prefill" in phases and clock.allows("prefill", 30):
        _phase(result, "prefill", partial(run_prefill, llm, sizes, hw, vocab))
        _phase(result, "short_prefill", partial(run_short_prefills, llm, vocab))
    if "layouts" in phases and clock.allows("layouts", 10):
        _phase(result, "layouts", partial(run_layouts, llm, hw))
    if "offline" in phases and clock.allows("offline", 40 if big else 25):
        _phase(result, "offline", partial(run_offline, llm, vocab))
    if "offline" in phases and clock.allows("offline, sampled", 40 if big else 25):
        _phase(result, "offline_sampled", partial(run_offline, llm, vocab, temperature=1.0))
    if "attention" in phases and DEVICE != "cpu" and clock.allows("attention tunings", 20):
        _phase(result, "attention", partial(run_attention, llm, hw))
    del llm
    free()
    if "decode_w" in phases and DEVICE != "cpu" and clock.allows("decode, weights as stored", 60 if big else 30):
        _phase(result, "decode_w", partial(_decode_of_another_load, model_dir, args, sizes, hw, vocab,
                                           f"{preset}, weights kept as stored (W, F.linear's form):",
                                           S.decode_batches, weights_as_stored=True))
    if "decode_fused" in phases and DEVICE != "cpu" and clock.allows("decode, fused layers", 45 if big else 30):
        _phase(result, "decode_fused", partial(_decode_of_another_load, model_dir, args, sizes, hw, vocab,
                                               f"{preset}, fused small-batch layers (weights as stored):",
                                               S.fused_batches, weights_as_stored=True, fused_decode=True))
    if "eager" in phases and clock.allows("eager decode", 60 if big else 30):
        _phase(result, "decode_eager", partial(_decode_of_another_load, model_dir, args, sizes, hw, vocab,
                                               f"{preset}, --enforce-eager:", S.eager_batches, enforce_eager=True,
                                               short_prefill_into=result if "prefill" in phases else None))
    if "hf" in phases and clock.allows("transformers", 60 if big else 30):
        _phase(result, "hf", partial(run_hf, model_dir, vocab))
        free()
    # Last, on a load of its own: once a profiler has traced CUDA, CUPTI stays attached to the
    # process and slows what runs after it (torch does not detach it unless TEARDOWN_CUPTI=1).
    if "profile" in phases and clock.allows("profile", 60 if big else 30):
        _phase(result, "profile", partial(_profile_of_another_load, model_dir, args, vocab))


def _capture_record(report) -> dict:
    """A CaptureReport (decode or mixed graphs) as the record holds it."""
    return {"sizes": list(report.sizes), "capture_s": report.seconds, "memory_mib": report.memory_bytes / 2**20}


def _profile_of_another_load(model_dir: Path, args, vocab: int) -> list[dict]:
    """The profile phase on the model loaded again (the engine given back after)."""
    llm, _ = load(model_dir, args)
    try:
        return run_profile(llm, vocab)
    finally:
        del llm
        free()


def _decode_of_another_load(model_dir: Path, args, sizes: dict, hw: dict, vocab: int, heading: str,
                            batches, short_prefill_into: dict | None = None, **load_options) -> dict:
    """The decode phase (at batches) on the model loaded again with load_options (and the short
    prompts, into short_prefill_into["short_prefill_eager"], where given); the engine is given back after."""
    llm, _ = load(model_dir, args, **load_options)
    try:
        fused = llm.engine.model.fused_decode
        if load_options.get("fused_decode") and (fused is None or not fused.rotary_in_qkv):
            raise RuntimeError("the fused small-batch layers (rotary inside the QKV projection) were not built")
        print(heading, flush=True)
        decode = run_decode(llm, sizes, hw, vocab, batches)
        if short_prefill_into is not None:  # its own phase: a failure there keeps the decode figures
            _phase(short_prefill_into, "short_prefill_eager", partial(run_short_prefills, llm, vocab))
        return decode
    finally:
        del llm
        free()


def main() -> int:
    global S, DEVICE
    args = parse_args()
    S, DEVICE = (SmokeSizes if args.smoke else Sizes), args.device
    if DEVICE != "cpu" and not torch.cuda.is_available():
        print("gpu_engine: no CUDA GPU here (--device cpu --smoke checks the script)", file=sys.stderr)
        return 2
    stop_on_sigterm()
    clock = Clock(args.budget_s)
    hw = measure_hardware()
    print(f"{hw['gpu']}: copy {hw['copy_bandwidth_gbs']:,.0f} GB/s, bf16 matmul {hw['bf16_matmul_tflops']:.0f} TFLOP/s",
          flush=True)
    import transformers
    import triton

    versions = {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__}
    payload = {"hardware": hw, "smoke": args.smoke, "versions": versions,
               "presets": []}
    try:
        for preset in args.presets.split(","):
            result = {"preset": preset}
            payload["presets"].append(result)
            try:
                bench_preset(preset, args, clock, hw, result)
            except Exception as exc:  # noqa: BLE001 - making or loading the model: the next preset goes on
                print(f"{preset}: failed ({exc!r}); going on", flush=True)
                result["error"] = repr(exc)[:300]
            free()
    except Stopped as exc:  # the step's timeout: the phases that ended are written
        print(f"{exc}: writing what ended", flush=True)
        payload["stopped"] = str(exc)
    payload["seconds"] = time.monotonic() - clock.start
    write_result("gpu_engine", payload)
    return 0 if all("decode" in p for p in payload["presets"][:1]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
