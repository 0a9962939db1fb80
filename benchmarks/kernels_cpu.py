"""CPU kernel benchmark: the compiled CPU kernels beside what they replace, in one run. Ends with one
line `RESULT {json}` (as kernels_cpu; benchmarks/kernels.py runs it where there is no GPU).

    .venv/bin/python benchmarks/kernels_cpu.py [--repeats 9]

It measures the compiled CPU paged decode attention on one thread: the small preset's shape (9 query
/ 3 KV heads, head dim 64, 30 layers of a block-major cache on huge pages, as the engine's), 64
sequences x 300 tokens in scattered blocks, in float32 beside the torch reference (gather + SDPA)
and a bare gather of the same bytes (index_select, which reads them in the same 24 KB runs per block
and layer and writes a copy), then in bfloat16; interleaved repeats, medians. It then measures the
other compiled CPU kernels this CPU runs (AMX or else AVX512-BF16 for bfloat16, AVX-512 for float32)
on all threads, interleaved with what they replace: the projections of one decode step of the small
preset in each dtype with a small-batch kernel (30 layers' four projections and the LM head,
distinct weights so each call reads them from memory, as the engine routes them: the LM head takes
the float32 kernel up to 32 rows) at 1, 8, 16 and 64 rows against oneDNN's prepacked linear; the
float32 gate/up kernel (30 layers' gate and up projections with SiLU-and-mul fused) at 128, 512 and
2,048 rows against oneDNN's linear and then silu_and_mul; and prefill attention (8 prompts x 256
tokens in one chunk, and one 2,048-token prompt; bfloat16 on AMX or AVX-512, float32 on AVX-512)
against the per-sequence SDPA reference, with each one's mean error against a float64 oracle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import CacheConfig  # noqa: E402
from engine.protocol import num_blocks_for  # noqa: E402
from kernels.cpu import ops as cpu_ops  # noqa: E402
from kernels.cpu.linear import Linear  # noqa: E402
from kernels.reference.ops import decode_attention_ref, prefill_attention_ref, silu_and_mul_ref  # noqa: E402
from kernels.select import select_backend  # noqa: E402

CPU = select_backend("cpu")  # the compiled kernels of this CPU's best level
DTYPE = torch.bfloat16
BLOCK_SIZE = CacheConfig.block_size  # the engine's KV block size


def decode_attention_cpu(query, layer, block_tables, seq_lens, scale):
    return cpu_ops.decode_attention(CPU.lib, query, layer, block_tables, seq_lens, scale)


def prefill_attention_cpu(query, layer, block_tables, cu_query_lens, seq_lens, scale):
    return cpu_ops.prefill_attention(CPU.lib, query, layer, block_tables, cu_query_lens, seq_lens, scale)


def bench_cpu_decode(repeats: int) -> dict:
    """One thread; see the module docstring. Times are per model step (all 30 layers)."""
    from engine.host_memory import advise_huge_pages, keep_freed_memory

    torch.set_num_threads(1)
    keep_freed_memory()  # as the engine does: the gather's copies then reuse heap pages, no faults
    num_layers, num_blocks, num_heads, num_kv_heads, head_dim = 30, 2000, 9, 3, 64
    num_seqs, seq_len = 64, 300
    gen = torch.Generator().manual_seed(0)

    def on_huge_pages(values: torch.Tensor) -> torch.Tensor:
        """A copy of values on huge pages, as the engine allocates its KV cache (engine/kv_cache.py)."""
        copy = torch.empty(values.shape, dtype=values.dtype)
        advise_huge_pages(copy)  # before the copy touches its pages
        return copy.copy_(values)

    cache = on_huge_pages(torch.randn(num_blocks, num_layers, 2, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen))
    blocks_per_seq = num_blocks_for(seq_len, BLOCK_SIZE)
    tables = torch.randperm(num_blocks, generator=gen)[:num_seqs * blocks_per_seq].view(num_seqs, -1).int()
    lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    flat_ids = tables.reshape(-1).long()

    def step(attend: Callable, query: torch.Tensor, cache: torch.Tensor) -> None:
        for layer in range(num_layers):
            attend(query, cache[:, layer], tables, lens, scale)

    if decode_attention_cpu(query, cache[:, 0], tables, lens, scale) is None:
        return {"device": "cpu", "status": "no C compiler: the CPU kernel is not built"}
    cache_bf16 = on_huge_pages(cache.bfloat16())
    query_bf16 = query.bfloat16()
    ways = {
        "c_kernel": lambda: step(decode_attention_cpu, query, cache),
        "torch_ref": lambda: step(decode_attention_ref, query, cache),
        "gather_only": lambda: [cache[:, layer].index_select(0, flat_ids).sum() for layer in range(num_layers)],
        "c_kernel_bf16": lambda: step(decode_attention_cpu, query_bf16, cache_bf16),
    }
    err = (decode_attention_cpu(query, cache[:, 3], tables, lens, scale)
           - decode_attention_ref(query, cache[:, 3], tables, lens, scale)).abs().max().item()
    ms = median_ms(ways, repeats)
    num_bytes = num_seqs * seq_len * num_layers * 2 * num_kv_heads * head_dim * 4
    return {
        "device": "cpu (1 thread)", "kernel": "paged_decode_attention",
        "shape": (f"{num_seqs} seqs x {seq_len} tokens, {num_heads}/{num_kv_heads} heads, "
                  f"d={head_dim}, {num_layers} layers"),
        "max_abs_err_vs_ref": err,
        "ms_per_step": {name: round(value, 1) for name, value in ms.items()},
        "kv_gbps": round(num_bytes / ms["c_kernel"] / 1e6, 2),
        "kv_gbps_bf16": round(num_bytes / 2 / ms["c_kernel_bf16"] / 1e6, 2),
        "speedup_vs_torch_ref": round(ms["torch_ref"] / ms["c_kernel"], 2),
        "ratio_to_gather_only": round(ms["gather_only"] / ms["c_kernel"], 2),
    }


def median_ms(ways: dict[str, Callable], repeats: int) -> dict[str, float]:
    """Each way's median wall time in ms over repeats interleaved rounds, after one warm-up call."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for way in ways.values():
        way()  # warm-up
    for _ in range(repeats):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            times[name].append(1000 * (time.perf_counter() - start))
    return {name: round(statistics.median(values), 3) for name, values in times.items()}


def bench_projections(dtype: torch.dtype, kernel: str, repeats: int, gen: torch.Generator) -> dict:
    """One decode step's projections of the small preset in dtype, as the engine runs them (on the
    small-batch kernel, named kernel, where linear() routes them) against all of them on oneDNN."""

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # 30 layers, LM head
    raw = [torch.randn(o, i, generator=gen).to(dtype) * 0.02 for o, i in shapes]
    weights = [CPU.prepare_linear(w) for w in raw]
    num_bytes = sum(w.in_features * w.out_features * dtype.itemsize for w in weights)
    # oneDNN's prepacked copy, which the bfloat16 kernel replaces on CPUs without AMX
    onednn = [Linear(None, torch.ops.mkldnn._reorder_linear_weight(w, 64), None, w.shape[1], w.shape[0])
              for w in raw]

    rows_measured = []
    for rows in (1, 8, 16, 64):
        xs = {n: torch.randn(rows, n, generator=gen).to(dtype) for n in (576, 1536)}
        ms = median_ms({
            kernel: lambda xs=xs: [CPU.linear(xs[w.in_features], w) for w in weights],
            "onednn": lambda xs=xs: [CPU.linear(xs[w.in_features], w) for w in onednn],
        }, repeats)
        rows_measured.append({"rows": rows, "ms_per_step": ms, f"{kernel}_gbps": round(num_bytes / ms[kernel] / 1e6, 1),
                              "onednn_gbps": round(num_bytes / ms["onednn"] / 1e6, 1),
                              "speedup": round(ms["onednn"] / ms[kernel], 2)})
    return {"dtype": str(dtype).removeprefix("torch."), "mb": round(num_bytes / 1e6), "rows": rows_measured}


def bench_gate_up(repeats: int, gen: torch.Generator) -> dict | str:
    """The float32 gate/up kernel (csrc/f32_gate_up.c: the MLP's gate and up projections with
    SiLU-and-mul in the same pass) against what it replaces, oneDNN's prepacked linear and then
    silu_and_mul, over the small preset's 30 layers' gate/up weights (1,536 x 2 outputs over 576
    inputs) at prefill-sized batches; each row's error against the float64 result."""

    if not CPU.projections.has_gate_up:
        return "no AVX-512 (or no compiler for it): no float32 gate/up kernel is built"
    raw = [torch.randn(3072, 576, generator=gen) * 0.05 for _ in range(30)]
    kernel = [CPU.prepare_linear(w, gate_up=True, small_batches=False) for w in raw]
    # oneDNN's prepacked copy alone, which the kernel's replaces (as bench_projections builds it)
    onednn = [Linear(None, torch.ops.mkldnn._reorder_linear_weight(w, 64), None, w.shape[1], w.shape[0])
              for w in raw]
    ways = {"kernel": CPU.gate_up_silu,
            "onednn_then_silu_and_mul": lambda x, w: CPU.silu_and_mul(CPU.linear(x, w))}
    weights = {"kernel": kernel, "onednn_then_silu_and_mul": onednn}
    measured = []
    for rows in (128, 512, 2048):
        x = torch.randn(rows, 576, generator=gen)
        ms = median_ms({name: lambda x=x, way=way, ws=weights[name]: [way(x, w) for w in ws]
                        for name, way in ways.items()}, repeats)
        exact = silu_and_mul_ref(x.double() @ raw[0].double().t())
        errors = {name: way(x, weights[name][0]) for name, way in ways.items()}
        flops = 2 * rows * 576 * 3072 * 30
        measured.append({"rows": rows, "ms_30_layers": ms, "kernel_gflops": round(flops / ms["kernel"] / 1e6, 1),
                         "speedup": round(ms["onednn_then_silu_and_mul"] / ms["kernel"], 2),
                         "max_abs_err_vs_float64": {k: f"{(v.double() - exact).abs().max().item():.2e}"
                                                    for k, v in errors.items()}})
    return {"weights": "30 x (3072 x 576) float32", "rows": measured}


def bench_greedy_head(repeats: int, gen: torch.Generator, dtype: torch.dtype) -> dict | str:
    """The greedy head (kernels/cpu/greedy_head.py, the int8 screen) on a head of this dtype against
    what it replaces, the LM head's logits and their argmax, on the small preset's 49,152 x 576
    head: time per step and the exact logits it computed per row."""

    weight = (torch.randn(49152, 576, generator=gen) * 0.05).to(dtype)
    full = CPU.prepare_linear(weight, copy=False)
    head = CPU.prepare_greedy_head(weight, full)
    if head is None:
        return (f"no greedy head for a {dtype} head here (it needs AVX512-BF16 and AVX512-VNNI, and for bfloat16 "
                "no AMX; or no compiler for them)")
    measured = []
    for rows in (1, 8, 32, 48, 64):
        x = torch.randn(rows, 576, generator=gen).to(dtype)
        candidates = torch.empty(rows, dtype=torch.int64)
        tokens = CPU.greedy_argmax(x, head, candidates)
        same = torch.equal(tokens, CPU.argmax(CPU.linear(x, full)))
        ms = median_ms({"greedy_head": lambda x=x: CPU.greedy_argmax(x, head),
                        "logits_argmax": lambda x=x: CPU.argmax(CPU.linear(x, full))}, repeats)
        measured.append({"rows": rows, "ms": ms, "speedup": round(ms["logits_argmax"] / ms["greedy_head"], 2),
                         "exact_logits_per_row": round(candidates.float().mean().item(), 1), "same_tokens": same})
    return {"head": f"49152 x 576 {str(dtype).removeprefix('torch.')}", "rows": measured}


def bench_cpu_compiled(repeats: int) -> dict:
    """The CPU's compiled bfloat16 (AMX or AVX512-BF16) and float32 (AVX-512) kernels vs what they replace, on all
    threads, each where this CPU runs it; see the module docstring."""

    gen = torch.Generator().manual_seed(0)
    kernel = ("amx" if CPU.projections.has_amx
              else "avx512_bf16" if CPU.projections.has_bf16 else None)
    projections = [bench_projections(DTYPE, kernel, repeats, gen) if kernel is not None
                   else "no AMX or AVX512-BF16 (or no compiler for them): no bfloat16 small-batch kernel is built"]
    projections.append(bench_projections(torch.float32, "avx512_f32", repeats, gen)
                       if CPU.projections.has_f32
                       else "no AVX-512 (or no compiler for it): no float32 small-batch kernel is built")
    attention = []
    for num_seqs, seq_len, dtype in ((8, 256, DTYPE), (1, 2048, DTYPE), (8, 256, torch.float32),
                                     (1, 2048, torch.float32)):
        blocks = num_seqs * num_blocks_for(seq_len, BLOCK_SIZE)
        cache = torch.randn(blocks, 2, BLOCK_SIZE, 3, 64, generator=gen).to(dtype)
        tables = torch.randperm(blocks, generator=gen).view(num_seqs, -1).int()
        cu = torch.arange(num_seqs + 1, dtype=torch.int32) * seq_len
        lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
        query = torch.randn(num_seqs * seq_len, 9, 64, generator=gen).to(dtype)
        args = (query, cache, tables, cu, lens, 0.125)
        if prefill_attention_cpu(*args) is None:  # no kernel for this dtype on this CPU
            attention.append({"dtype": str(dtype).removeprefix("torch."), "status": "no kernel here"})
            continue
        ms = median_ms({"kernel": lambda args=args: prefill_attention_cpu(*args),
                        "sdpa_ref": lambda args=args: prefill_attention_ref(*args)}, repeats)
        oracle = prefill_attention_ref(query.double(), cache.double(), tables, cu, lens, 0.125)
        errors = {name: (fn(*args).double() - oracle).abs().mean().item()
                  for name, fn in (("kernel", prefill_attention_cpu), ("sdpa_ref", prefill_attention_ref))}
        attention.append({"shape": f"{num_seqs} x {seq_len} tokens, 9/3 heads, d=64",
                          "dtype": str(dtype).removeprefix("torch."), "ms": ms,
                          "speedup": round(ms["sdpa_ref"] / ms["kernel"], 2),
                          "mean_abs_err_vs_float64": {k: f"{v:.2e}" for k, v in errors.items()}})
    return {"device": f"cpu ({torch.get_num_threads()} threads)",
            "projections_small_decode_step": projections, "gate_up_prefill": bench_gate_up(repeats, gen),
            "prefill_attention": attention,
            "greedy_head": [bench_greedy_head(repeats, gen, dtype) for dtype in (torch.float32, DTYPE)]}


def run_cpu(repeats: int) -> dict:
    """The decode attention on one thread, then the other compiled kernels on all of them."""
    threads = torch.get_num_threads()
    decode = bench_cpu_decode(repeats)
    print(json.dumps(decode), flush=True)
    torch.set_num_threads(threads)
    compiled = bench_cpu_compiled(repeats)
    print(json.dumps(compiled), flush=True)
    return {"decode_attention": decode, "compiled": compiled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    from results_io import write_result

    write_result("kernels_cpu", run_cpu(args.repeats))


if __name__ == "__main__":
    main()
