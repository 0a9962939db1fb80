"""Kernel benchmark (GPU only): each Triton kernel's time, achieved bandwidth or FLOP rate, its
share of the device's measured ceilings, and the ratio to the torch way of doing the same.

Ceilings are measured here, not taken from a data sheet: a large device-to-device copy for
bandwidth and a large bf16 matmul for FLOP/s. Targets: paged decode at >= 70% of the measured
bandwidth (64 seqs x 4096 tokens, 32 query / 8 KV heads, head dim 128, bf16) and prefill within
1.3x of SDPA's flash backend (8 x 2048 tokens). Ends with one line `RESULT {json}`.

    .venv/bin/python benchmarks/kernels.py [--iters 50] [--only decode,prefill]

Without a GPU (or with --cpu) it runs benchmarks/kernels_cpu.py's CPU kernel benchmark instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import CacheConfig  # noqa: E402
from kernels.reference.ops import (  # noqa: E402
    add_rms_norm_ref,
    apply_rotary_ref,
    decode_attention_ref,
    gather_blocks_ref,
    prefill_attention_ref,
    rotary_cos_sin_cache,
    silu_and_mul_ref,
    write_kv_ref,
)
from kernels.select import select_backend  # noqa: E402
from kernels.triton import elementwise as triton_elementwise  # noqa: E402
from kernels.triton.block_copy import gather_blocks  # noqa: E402
from kernels.triton.common import triton  # noqa: E402
from kernels.triton.prefill_attention import prefill_attention as triton_prefill_attention  # noqa: E402


def _backend(tensor: torch.Tensor):
    """The backend the engine picks for this tensor's device."""
    return select_backend(str(tensor.device))


def add_rms_norm(x, residual, weight, eps):
    return _backend(x).add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x):
    return _backend(x).silu_and_mul(x)


def decode_attention(query, layer, block_tables, seq_lens, scale):
    return _backend(query).decode_attention(query, layer, block_tables, seq_lens, scale)


DTYPE = torch.bfloat16
BLOCK_SIZE = CacheConfig.block_size  # the engine's KV block size
GIB = 1024 ** 3


def time_ms(fn: Callable[[], object], iters: int, warmup: int = 10) -> float:
    """Median of iters CUDA-event timings, after warmup calls (compilation, caches)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_ceilings(iters: int) -> dict:
    """Bandwidth of a 1 GiB device-to-device copy (counted as read + write), bf16 matmul FLOP/s."""
    src = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), iters)
    n = 8192
    a, b = torch.randn(n, n, dtype=DTYPE, device="cuda"), torch.randn(n, n, dtype=DTYPE, device="cuda")
    matmul_ms = time_ms(lambda: a @ b, iters)
    return {"copy_gbps": 2 * GIB / copy_ms / 1e6, "matmul_tflops": 2 * n ** 3 / matmul_ms / 1e9}


def bandwidth_row(name: str, shape: str, num_bytes: int, kernel: Callable, torch_way: Callable,
                  ceilings: dict, iters: int) -> dict:
    ms, torch_ms = time_ms(kernel, iters), time_ms(torch_way, iters)
    gbps = num_bytes / ms / 1e6
    return {"kernel": name, "shape": shape, "ms": round(ms, 4), "gbps": round(gbps, 1),
            "frac_of_copy_bw": round(gbps / ceilings["copy_gbps"], 3), "torch_ms": round(torch_ms, 4),
            "speedup_vs_torch": round(torch_ms / ms, 2)}


def bench_elementwise(ceilings: dict, iters: int) -> list[dict]:
    tokens, hidden, intermediate = 8192, 4096, 14336
    size = DTYPE.itemsize
    x = torch.randn(tokens, hidden, dtype=DTYPE, device="cuda")
    residual = torch.randn(tokens, hidden, dtype=DTYPE, device="cuda")
    weight = torch.randn(hidden, dtype=DTYPE, device="cuda")
    rows = [bandwidth_row("add_rms_norm", f"{tokens}x{hidden}", 4 * tokens * hidden * size,
                          lambda: add_rms_norm(x, residual, weight, 1e-5),
                          lambda: add_rms_norm_ref(x, residual, weight, 1e-5), ceilings, iters)]
    gate_up = torch.randn(tokens, 2 * intermediate, dtype=DTYPE, device="cuda")
    rows.append(bandwidth_row("silu_and_mul", f"{tokens}x{2 * intermediate}", 3 * tokens * intermediate * size,
                              lambda: silu_and_mul(gate_up), lambda: silu_and_mul_ref(gate_up), ceilings, iters))
    cache = rotary_cos_sin_cache(128, 8192, 500000.0, None, DTYPE).cuda()
    query = torch.randn(tokens, 32, 128, dtype=DTYPE, device="cuda")
    key = torch.randn(tokens, 8, 128, dtype=DTYPE, device="cuda")
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    rows.append(bandwidth_row("apply_rotary", f"{tokens}x(32+8)x128", 2 * tokens * 40 * 128 * size,
                              lambda: triton_elementwise.apply_rotary(query, key, positions, cache),
                              lambda: apply_rotary_ref(query, key, positions, cache), ceilings, iters))
    return rows


def bench_cache_ops(ceilings: dict, iters: int) -> list[dict]:
    # Block-major cache of an 8B-class model: 32 layers x K,V x 16 tokens x 8 heads x 128 = 2 MiB a block.
    num_blocks, num_layers = 1024, 32
    kv_cache = torch.randn(num_blocks, num_layers, 2, BLOCK_SIZE, 8, 128, dtype=DTYPE, device="cuda")
    tokens = 8192
    key = torch.randn(tokens, 8, 128, dtype=DTYPE, device="cuda")
    value = torch.randn(tokens, 8, 128, dtype=DTYPE, device="cuda")
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:tokens]
    layer = kv_cache[:, 3]
    rows = [bandwidth_row("write_kv", f"{tokens} tokens x 8 x 128", 4 * key.numel() * DTYPE.itemsize,
                          lambda: triton_elementwise.write_kv(key, value, layer, slots),
                          lambda: write_kv_ref(key, value, layer, slots), ceilings, iters)]
    # The engine's op: rotary and the write in one launch, against the two kernels one after the
    # other ("vs torch" here: vs those two), at a decode batch (launch-bound) and a prefill chunk.
    table = rotary_cos_sin_cache(128, 8192, 500000.0, None, DTYPE).cuda()
    for num in (64, tokens):
        query = torch.randn(num, 32, 128, dtype=DTYPE, device="cuda")
        positions = torch.randint(0, 8192, (num,), device="cuda")
        k, v, s = key[:num], value[:num], slots[:num]

        def two_kernels(query=query, k=k, v=v, s=s, positions=positions):
            triton_elementwise.apply_rotary(query, k, positions, table)
            triton_elementwise.write_kv(k, v, layer, s)

        rows.append(bandwidth_row("rotary+write_kv fused (vs 2 kernels)", f"{num} tokens x (32+8+8) x 128",
                                  (2 * 40 + 2 * 8) * num * 128 * DTYPE.itemsize,
                                  lambda query=query, k=k, v=v, s=s, positions=positions:
                                  triton_elementwise.rotary_and_write_kv(query, k, v, positions, table, layer, s),
                                  two_kernels, ceilings, iters))
    block_ids = torch.randperm(num_blocks, device="cuda")[:256]
    staging = torch.empty(256, *kv_cache.shape[1:], dtype=DTYPE, device="cuda")
    rows.append(bandwidth_row("gather_blocks", "256 blocks x 2 MiB", 2 * staging.numel() * DTYPE.itemsize,
                              lambda: gather_blocks(kv_cache, block_ids, staging),
                              lambda: gather_blocks_ref(kv_cache, block_ids, staging), ceilings, iters))
    return rows


def paged_inputs(num_seqs: int, seq_len: int, num_kv_heads: int, head_dim: int):
    """A two-layer block-major cache (so the layer view is strided), shuffled block tables."""
    blocks_per_seq = seq_len // BLOCK_SIZE
    num_blocks = num_seqs * blocks_per_seq
    kv_cache = torch.randn(num_blocks, 2, 2, BLOCK_SIZE, num_kv_heads, head_dim, dtype=DTYPE, device="cuda")
    block_tables = torch.randperm(num_blocks, device="cuda").view(num_seqs, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    return kv_cache[:, 1], block_tables, seq_lens


def bench_decode(ceilings: dict, iters: int) -> dict:
    num_seqs, seq_len, heads, kv_heads, head_dim = 64, 4096, 32, 8, 128
    layer, block_tables, seq_lens = paged_inputs(num_seqs, seq_len, kv_heads, head_dim)
    query = torch.randn(num_seqs, heads, head_dim, dtype=DTYPE, device="cuda")
    scale = head_dim ** -0.5
    kv_bytes = 2 * num_seqs * seq_len * kv_heads * head_dim * DTYPE.itemsize
    row = bandwidth_row("decode_attention", f"{num_seqs}x{seq_len}, {heads}/{kv_heads} heads, d{head_dim}", kv_bytes,
                        lambda: decode_attention(query, layer, block_tables, seq_lens, scale),
                        lambda: decode_attention_ref(query, layer, block_tables, seq_lens, scale), ceilings, iters)
    row["torch_way"] = "gather blocks + scaled_dot_product_attention"
    row["target_frac_of_copy_bw"] = 0.70
    return row


def bench_prefill(ceilings: dict, iters: int) -> dict:
    num_seqs, seq_len, heads, kv_heads, head_dim = 8, 2048, 32, 8, 128
    layer, block_tables, seq_lens = paged_inputs(num_seqs, seq_len, kv_heads, head_dim)
    query = torch.randn(num_seqs * seq_len, heads, head_dim, dtype=DTYPE, device="cuda")
    cu_query_lens = torch.arange(0, num_seqs + 1, dtype=torch.int32, device="cuda") * seq_len
    scale = head_dim ** -0.5
    # SDPA flash on contiguous K/V (KV heads expanded beforehand, outside the timing).
    key = layer[:, 0][block_tables.long()].view(num_seqs, seq_len, kv_heads, head_dim).transpose(1, 2)
    value = layer[:, 1][block_tables.long()].view(num_seqs, seq_len, kv_heads, head_dim).transpose(1, 2)
    key = key.repeat_interleave(heads // kv_heads, dim=1).contiguous()
    value = value.repeat_interleave(heads // kv_heads, dim=1).contiguous()
    q4 = query.view(num_seqs, seq_len, heads, head_dim).transpose(1, 2).contiguous()

    def sdpa_flash():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q4, key, value, is_causal=True, scale=scale)

    ms = time_ms(lambda: triton_prefill_attention(query, layer, block_tables, cu_query_lens, seq_lens, scale,
                                                  max_query_len=seq_len), iters)
    flash_ms = time_ms(sdpa_flash, iters)
    ref_ms = time_ms(lambda: prefill_attention_ref(query, layer, block_tables, cu_query_lens, seq_lens, scale), iters)
    flops = 2 * num_seqs * heads * seq_len * seq_len * head_dim  # causal: half of 4 * S^2 * d
    tflops = flops / ms / 1e9
    return {"kernel": "prefill_attention", "shape": f"{num_seqs}x{seq_len}, {heads}/{kv_heads} heads, d{head_dim}",
            "ms": round(ms, 4), "tflops": round(tflops, 1),
            "frac_of_matmul": round(tflops / ceilings["matmul_tflops"], 3),
            "sdpa_flash_ms": round(flash_ms, 4), "ratio_to_sdpa_flash": round(ms / flash_ms, 2),
            "torch_ref_ms": round(ref_ms, 4), "target_ratio_to_sdpa_flash": 1.3}


def run(iters: int, only: set[str] | None) -> dict:
    """Each group's rows, printed as they come; a group that fails is reported as an error row and
    the others still run (the caller exits non-zero)."""
    ceilings = measure_ceilings(iters)
    print(json.dumps({"ceilings": ceilings}), flush=True)
    groups = {"elementwise": bench_elementwise, "cache": bench_cache_ops,
              "decode": lambda c, i: [bench_decode(c, i)], "prefill": lambda c, i: [bench_prefill(c, i)]}
    rows: list[dict] = []
    for name, bench in groups.items():
        if only and name not in only:
            continue
        try:
            group_rows = bench(ceilings, iters)
        except Exception as error:  # noqa: BLE001 - reported in the result, the run exits non-zero
            group_rows = [{"kernel": name, "error": f"{type(error).__name__}: {error}"}]
        for row in group_rows:
            print(json.dumps(row), flush=True)
        rows += group_rows
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "ceilings": {k: round(v, 1) for k, v in ceilings.items()}, "kernels": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--only", default="", help="comma list of elementwise,cache,decode,prefill")
    parser.add_argument("--cpu", action="store_true", help="measure the CPU decode kernel even where a GPU is present")
    parser.add_argument("--cpu-repeats", type=int, default=9)
    args = parser.parse_args()
    from results_io import write_result

    if args.cpu or not torch.cuda.is_available():
        from kernels_cpu import run_cpu

        write_result("kernels_cpu", run_cpu(args.cpu_repeats))
        return
    only = set(args.only.split(",")) if args.only else None
    result = run(args.iters, only)
    write_result("kernels_gpu", result)
    if any("error" in row for row in result["kernels"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
