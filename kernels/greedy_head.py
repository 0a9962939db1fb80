"""Greedy LM head for float32 models: the argmax of x W^T per row, the token the full head's
logits give, from a bfloat16 screen with error bounds and the exact logits of the few outputs it
cannot rule out (csrc/greedy_head.c says how, and why the answer is the same). For CPUs with
AVX512-BF16 (AMD Zen 4 and 5, Intel Cooper Lake and Sapphire Rapids on): the candidates' logits are
summed in the float32 panel kernel's order (f32_linear.c), so the token equals
argmax_rows(f32_linear(x, head)) bit for bit, ties included.

The screen costs half of float32's FMAs. SmolLM-135M's 49,152 x 576 head on a 2-core Zen 4, two
threads: 1.8-1.9 / 4.6-4.7 / 9.0 ms at 1 / 32 / 64 rows against 3.9-4.0 / 9.7-10.0 / 19.1-19.5 for
the logits and their argmax, ~2 exact logits a row (benchmarks/RESULTS.md; `kernels.py --cpu`).
bfloat16 heads get none: on these CPUs no cheaper product than their own vdpbf16ps exists (the
Zen 4's 512-bit int8 vpdpbusd measured 77 GMAC/s a core against vdpbf16ps's 116).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kernels._cpu import cpu_function
from kernels.argmax import argmax_rows
from kernels.linear import Linear, linear, pack_bf16_pairs


@dataclass(frozen=True)
class GreedyHead:
    packed: torch.Tensor  # bf16(W) in the bfloat16 kernel's panels (pack_bf16_pairs)
    e_norm: torch.Tensor  # float32 [outputs padded to panels]: |w_v - bf16(w_v)|, rounded up
    wb_norm: torch.Tensor  # |bf16(w_v)|, rounded up
    w_norm: torch.Tensor  # |w_v|, rounded up
    weight: torch.Tensor  # W [n, k] float32, contiguous: the candidates' exact logits
    linear: Linear  # the head itself, for the rows the screen leaves (inf or NaN in x, mass ties)
    out_features: int
    in_features: int


@functools.cache
def _kernel():
    ready = cpu_function("greedy_head", "greedy_head_ready", (), ctypes.c_int)
    if ready is None or not ready():
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_function("greedy_head", "greedy_head", (ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr),
                        ctypes.c_int)


def available() -> bool:
    return _kernel() is not None


def _rounded_up(values: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, each at least its float64 value."""
    as_f32 = values.float()
    return torch.where(as_f32.double() < values, torch.nextafter(as_f32, torch.tensor(float("inf"))), as_f32)


def prepare_greedy_head(weight: torch.Tensor, head: Linear) -> GreedyHead | None:
    """weight: a float32 LM head [vocab, hidden] on the CPU; head: it prepared with
    prepare_linear. None where the kernel is unavailable, the head is not float32, hidden is odd
    or W holds an inf or NaN."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % 2
            or weight.numel() >= 1 << 31 or not available()):
        return None
    if not bool(torch.isfinite(weight).all()):
        return None
    n, k = weight.shape
    rounded = weight.to(torch.bfloat16)
    w, wb = weight.double(), rounded.double()
    padded = -(-n // 48) * 48

    def norms(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(padded, dtype=torch.float32)
        out[:n] = _rounded_up(t.norm(dim=1) * (1 + 1e-12))
        return out

    return GreedyHead(
        packed=pack_bf16_pairs(rounded), e_norm=norms(w - wb), wb_norm=norms(wb), w_norm=norms(w),
        weight=weight.contiguous(), linear=head, out_features=n, in_features=k,
    )


def greedy_head_argmax(x: torch.Tensor, head: GreedyHead, candidates: torch.Tensor | None = None) -> torch.Tensor:
    """x: [rows, hidden] float32 on the CPU -> int64 [rows]: each row's argmax of x W^T (the first
    index of the maximum; of the first NaN where there is one). candidates (int64 [rows],
    optional) receives how many logits each row computed exactly (the vocabulary's size for a
    row computed in full)."""
    if x.dim() != 2 or x.shape[1] != head.in_features or x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(f"greedy_head_argmax: x {tuple(x.shape)} {x.dtype} on {x.device} for a float32 CPU head "
                         f"of {head.in_features} inputs")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0] == 0:
        return out
    status = _kernel()(
        x.data_ptr(), x.stride(0), x.shape[0], head.in_features, head.packed.data_ptr(), head.e_norm.data_ptr(),
        head.wb_norm.data_ptr(), head.w_norm.data_ptr(), head.weight.data_ptr(), head.out_features, out.data_ptr(),
        candidates.data_ptr() if candidates is not None else None,
    )
    if status != 0:
        raise MemoryError("greedy_head_argmax: could not allocate the kernel's buffers")
    left = (out < 0).nonzero().squeeze(1)
    if left.numel():  # an inf or NaN in x, or thousands of near-ties: the full head's logits
        out[left] = argmax_rows(linear(x[left], head.linear))
    return out
