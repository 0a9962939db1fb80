"""Greedy LM head for float32 models: the argmax of x W^T per row, the token the full head's
logits give, from a bfloat16 screen with error bounds and the exact logits of the few outputs it
cannot rule out (csrc/greedy_head.c says how, and why the answer is the same). For CPUs with
AVX512-BF16 (AMD Zen 4 and 5, Intel Cooper Lake and Sapphire Rapids on): the candidates' logits are
summed in the float32 panel kernel's order (f32_linear.c), so the token equals
argmax_rows(f32_linear(x, head)) bit for bit, ties included.

The screen costs half of float32's FMAs. SmolLM-135M's 49,152 x 576 head on a 2-core Zen 4, two
threads: 1.8-1.9 / 4.6-4.7 / 9.0 ms at 1 / 32 / 64 rows against 3.9-4.0 / 9.7-10.0 / 19.1-19.5 for
the logits and their argmax, ~2 exact logits a row (benchmarks/RESULTS.md; `kernels.py --cpu`).

bfloat16 heads on CPUs with AVX512-VNNI too: an int8 screen (vpdpbusd: four products a lane at
vdpbf16ps's one instruction a cycle; the call's most outlying input pairs in bfloat16 beside it),
and the candidates' logits as the bfloat16 kernel (bf16_linear.c) sums and rounds them, so the token
equals argmax_rows(linear(x, head)) bit for bit there too (csrc/greedy_head.c, its second part).
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


@dataclass(frozen=True)
class GreedyHeadBF16:
    q8: torch.Tensor  # int8 W in panels of 48 outputs x 4 inputs (pack_int8_quads)
    scale: torch.Tensor  # float32 [outputs padded to panels]: s_v = max |w_v| / 127
    qsum: torch.Tensor  # int32: sum_i q_vi
    e_norm: torch.Tensor  # float32: |w_v - s_v q_v|, rounded up
    w_norm: torch.Tensor  # |w_v|, rounded up
    weight: torch.Tensor  # W [n, k] bfloat16, contiguous: the candidates' exact logits
    linear: Linear  # the head itself: its bfloat16 panels (the picked pairs) and the rows the screen leaves
    out_features: int
    in_features: int


@functools.cache
def _kernel_bf16():
    ready = cpu_function("greedy_head", "greedy_head_bf16_ready", (), ctypes.c_int)
    chunk = cpu_function("bf16_linear", "bf16_linear_chunk", (ctypes.c_int64, ctypes.c_int64), ctypes.c_int64)
    if ready is None or not ready() or chunk is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    kernel = cpu_function("greedy_head", "greedy_head_bf16",
                          (ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, ptr, ptr), ctypes.c_int)
    return kernel, chunk


def pack_int8_quads(q: torch.Tensor) -> torch.Tensor:
    """int8 q [out, in] (in a multiple of 4) in the int8 screen's layout: per panel of 48 outputs
    (out padded with zero rows to a multiple of 48) and per 4 inputs, the panel's 48 outputs x 4
    consecutive inputs."""
    out_features, in_features = q.shape
    padded = torch.zeros((out_features + 47) // 48 * 48, in_features, dtype=torch.int8)
    padded[:out_features] = q
    return padded.view(-1, 48, in_features // 4, 4).permute(0, 2, 1, 3).contiguous()


# NOTE: bfloat16 heads of fewer outputs keep the logits path: the screen's costs per row (its
# candidates' exact logits, ~17 a row of k gathered pairs each; the rows' int8 copies) do not
# shrink with the vocabulary, and the heads are cheap. One thread, random heads, 8 / 48 rows, the
# greedy head against the logits and their argmax, 2-core Zen 4: 2,048 x 256 82 / 339 us against
# 75 / 336, 2,048 x 1,024 217 / 1,000 against 198 / 979; 8,192 x 256 177 / 923 against 221 /
# 1,252, 8,192 x 576 312 / 1,843 against 424 / 2,784; 49,152 x 576 1.54 / 8.1 ms against 2.35 /
# 14.0.
BF16_MIN_VOCAB = 8192


def _prepare_bf16(weight: torch.Tensor, head: Linear) -> GreedyHeadBF16 | None:
    n, k = weight.shape
    if head.bf16 is None or k % 4 or k > 65536 or n < BF16_MIN_VOCAB or _kernel_bf16() is None:
        return None
    w = weight.double()
    scale = (weight.float().abs().amax(dim=1) / 127).float()
    s = scale.double()[:, None]
    q = torch.where(s > 0, torch.round(w / torch.where(s > 0, s, 1.0)), 0.0).clamp(-127, 127)
    padded = -(-n // 48) * 48

    def per_output(t: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        out = torch.zeros(padded, dtype=dtype)
        out[:n] = t
        return out

    return GreedyHeadBF16(
        q8=pack_int8_quads(q.to(torch.int8)), scale=per_output(scale), qsum=per_output(q.sum(dim=1), torch.int32),
        e_norm=per_output(_rounded_up((w - s * q).norm(dim=1) * (1 + 1e-12))),
        w_norm=per_output(_rounded_up(w.norm(dim=1) * (1 + 1e-12))), weight=weight.contiguous(), linear=head,
        out_features=n, in_features=k,
    )


def _rounded_up(values: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, each at least its float64 value."""
    as_f32 = values.float()
    return torch.where(as_f32.double() < values, torch.nextafter(as_f32, torch.tensor(float("inf"))), as_f32)


def prepare_greedy_head(weight: torch.Tensor, head: Linear) -> GreedyHead | GreedyHeadBF16 | None:
    """weight: an LM head [vocab, hidden] on the CPU, float32 or bfloat16; head: it prepared with
    prepare_linear. None where the kernel is unavailable, hidden is odd (bfloat16: not a multiple
    of 4, fewer than BF16_MIN_VOCAB outputs, or the head has no bfloat16 panels: a CPU with AMX),
    or W holds an inf or NaN."""
    if (weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2
            or weight.shape[1] % 2 or weight.numel() >= 1 << 31):
        return None
    if not bool(torch.isfinite(weight).all()):
        return None
    if weight.dtype == torch.bfloat16:
        return _prepare_bf16(weight, head)
    if not available():
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


def greedy_head_argmax(x: torch.Tensor, head: GreedyHead | GreedyHeadBF16,
                       candidates: torch.Tensor | None = None) -> torch.Tensor:
    """x: [rows, hidden] on the CPU in the head's dtype -> int64 [rows]: each row's argmax of
    linear(x, head.linear) (the first index of the maximum; of the first NaN where there is one).
    candidates (int64 [rows], optional) receives how many logits each row computed exactly (the
    vocabulary's size for a row computed in full)."""
    dtype = torch.bfloat16 if isinstance(head, GreedyHeadBF16) else torch.float32
    if x.dim() != 2 or x.shape[1] != head.in_features or x.dtype != dtype or not x.is_cpu:
        raise ValueError(f"greedy_head_argmax: x {tuple(x.shape)} {x.dtype} on {x.device} for a {dtype} CPU head "
                         f"of {head.in_features} inputs")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0] == 0:
        return out
    found = candidates.data_ptr() if candidates is not None else None
    if dtype == torch.bfloat16:
        kernel, chunk = _kernel_bf16()
        status = kernel(
            x.data_ptr(), x.stride(0), x.shape[0], head.in_features, head.q8.data_ptr(), head.scale.data_ptr(),
            head.qsum.data_ptr(), head.e_norm.data_ptr(), head.w_norm.data_ptr(), head.linear.bf16.data_ptr(),
            head.weight.data_ptr(), head.out_features, chunk(x.shape[0], head.in_features), out.data_ptr(), found,
        )
    else:
        status = _kernel()(
            x.data_ptr(), x.stride(0), x.shape[0], head.in_features, head.packed.data_ptr(), head.e_norm.data_ptr(),
            head.wb_norm.data_ptr(), head.w_norm.data_ptr(), head.weight.data_ptr(), head.out_features,
            out.data_ptr(), found,
        )
    if status != 0:
        raise MemoryError("greedy_head_argmax: could not allocate the kernel's buffers")
    left = (out < 0).nonzero().squeeze(1)
    if left.numel():  # an inf or NaN in x, or thousands of near-ties: the full head's logits
        out[left] = argmax_rows(linear(x[left], head.linear))
    return out
