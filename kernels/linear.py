"""Dense projections, y = x @ W^T + b, on weights prepared once when the model loads.

CPU float32, and CPU bfloat16 where oneDNN has a bfloat16 path (AVX512-BF16 or AMX): oneDNN on
W prepacked into its blocked layout, for every batch size. Measured on a 2-core EPYC (torch 2.13,
MKL 2024.2, oneDNN 3.12), two threads, the model's shapes, float32: 190-216 GFLOP/s at 512-2,048
rows against 124-156 for MKL on W^T (MKL does not take that AMD CPU's AVX-512 path), 157-174
against 97-113 at 64 rows, and the 49,152-row LM head 101-154 against 72. On a 2-core Xeon with
AMX, bfloat16: 980-1,520 GFLOP/s at 64 rows against 840-900 for a plain matmul on W^T, 1.9-2.3x
at 1-8 rows, the same at 2,048 (float32 there: 270-340 either way).
Decode batches in bfloat16 on CPUs with AMX: a compiled AMX kernel (csrc/amx_linear.c) on a
second copy of W packed for AMX's tiles, up to AMX_MAX_ROWS rows; oneDNN above (prefill), where
it measured 2x the kernel at 2,048 rows. See amx_linear.c for what it measured.
bfloat16 on CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and 5, Intel Xeons without AMX): a compiled
kernel (csrc/bf16_linear.c: vdpbf16ps, or float32 FMAs on widened pairs where vdpbf16ps is slow, see
bf16_widens) on W packed in panels of 48 outputs x input pairs, for every batch size (decode
batches of up to AMX_MAX_ROWS rows, prefill ones blocked for the caches), in place of oneDNN's
copy, on prefill and decode engines alike; see bf16_linear.c.
Decode batches in float32 on CPUs with AVX-512: a compiled kernel (csrc/f32_linear.c) on a second
copy of W packed in panels of 48 outputs, up to AMX_MAX_ROWS rows; see f32_linear.c.
A gated MLP's gate/up projection in float32 on CPUs with AVX-512: a compiled kernel
(csrc/f32_gate_up.c) on W packed in panels of 32 gate and 32 up outputs, in place of oneDNN's copy,
for the batches the decode kernel does not take; linear_silu_and_mul runs it with SiLU-and-mul in
the same pass (a 2,048-token prefill chunk of SmolLM-135M's shape ~5% faster on a Xeon).
Projections of more than _WIDE_OUTPUTS outputs (LM heads) take the float32 kernel only up to
_WIDE_MAX_ROWS rows.
Elsewhere (CUDA, other dtypes): BLAS on W^T [in, out], contiguous, which measured 1.1-1.4x
F.linear on MKL and is cuBLAS's fastest form on CUDA.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels._cpu import cpu_function
from kernels.activation import silu_and_mul

logger = logging.getLogger(__name__)

# NOTE: the batch-size hint oneDNN packs for. 64 measured as fast as 2,048 from 512 rows up and
# within 10% at 64 rows; a hint of 1 lost 10-30%.
_PACK_BATCH_HINT = 64
# NOTE: the most rows the AMX kernel takes; oneDNN measured faster from ~128 rows on.
AMX_MAX_ROWS = 64


@dataclass(frozen=True)
class Linear:
    weight_t: torch.Tensor | None  # [in, out]: contiguous, or a transposed view; None when packed
    # oneDNN-prepacked [out, in] (CPU float32 and bfloat16 only; None where bf16 below serves all)
    packed: torch.Tensor | None
    bias: torch.Tensor | None  # [out]
    in_features: int
    out_features: int
    amx: torch.Tensor | None = None  # W packed for the AMX kernel (CPU bfloat16 with AMX only)
    bias_f32: torch.Tensor | None = None  # float32 bias for the bfloat16 small-batch kernels (amx, bf16)
    f32: torch.Tensor | None = None  # W packed for the float32 kernel (CPU float32 with AVX-512 only)
    # W packed for the AVX512-BF16 kernel (CPU bfloat16 without AMX only), which takes every batch
    bf16: torch.Tensor | None = None
    # A gated MLP's stacked gate and up weights packed for the float32 gate/up kernel (CPU float32
    # with AVX-512, prepare_linear's gate_up), which takes the batches the small-batch copy does not
    gate_up: torch.Tensor | None = None


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether weights like this one are prepacked for oneDNN: on the CPU with oneDNN built in,
    float32, or bfloat16 where the CPU has oneDNN's bfloat16 instructions."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if weight.dtype == torch.bfloat16:
        return _has_bf16_kernels()
    return weight.dtype == torch.float32


@functools.cache
def _has_bf16_kernels() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepare_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, *, copy: bool = True,
                   small_batches: bool = True, gate_up: bool = False) -> Linear:
    """weight: [out, in]. Prepacked where can_prepack allows; else W^T, a contiguous copy, or with
    copy=False (an LM head tied to the embedding) a transposed view that costs no memory.
    small_batches (bfloat16 on a CPU with AMX, float32 on one with AVX-512): also a copy packed for
    the AMX or the float32 kernel, which batches of up to AMX_MAX_ROWS rows take; it doubles the
    weight's memory, so an engine that only prefills passes False. On a CPU with AVX512-BF16 and
    no AMX, bfloat16 weights get the bfloat16 kernel's copy instead of oneDNN's (it takes every
    batch size; see bf16_linear.c), whatever small_batches says. gate_up (weight: a gated MLP's
    gate rows then its up rows, no bias): on a CPU with AVX-512, float32 weights get the gate/up
    kernel's copy (csrc/f32_gate_up.c; linear_silu_and_mul runs it with the activation fused) in
    place of oneDNN's."""
    if weight.dim() != 2 or (bias is not None and bias.shape != weight.shape[:1]):
        bias_shape = None if bias is None else tuple(bias.shape)
        raise ValueError(f"prepare_linear: weight {tuple(weight.shape)}, bias {bias_shape}")
    if can_prepack(weight):
        bias = bias.contiguous() if bias is not None else None
        amx = pack_for_amx(weight) if small_batches and _amx_takes(weight) else None
        if _bf16_takes(weight) and _amx_kernel() is None:  # the bfloat16 kernel serves every batch size
            bf16, packed = pack_bf16_pairs(weight), None
        else:
            bf16 = pack_bf16_pairs(weight) if small_batches and amx is None and _bf16_takes(weight) else None
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_BATCH_HINT)
        has_bf16_copy = amx is not None or bf16 is not None
        bias_f32 = bias.float().contiguous() if has_bf16_copy and bias is not None else None
        f32 = pack_f32_panels(weight) if small_batches and _f32_takes(weight) else None
        gate_up_copy = None
        if gate_up and bias is None and weight.shape[0] % 2 == 0 and _gate_up_takes(weight):
            gate_up_copy, packed = pack_f32_gate_up(weight), None
        return Linear(None, packed, bias, weight.shape[1], weight.shape[0], amx, bias_f32, f32, bf16, gate_up_copy)
    weight_t = weight.t().contiguous() if copy else weight.t()
    return Linear(weight_t, None, bias, weight.shape[1], weight.shape[0])


def _amx_takes(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.shape[1] % 32 == 0 and _amx_kernel() is not None


def _library_ready(library: str) -> bool:
    """Whether the compiled csrc/<library>.c built and its <library>_ready() says its CPU
    instructions are there."""
    ready = cpu_function(library, f"{library}_ready", (), ctypes.c_int)
    return ready is not None and bool(ready())


def _small_batch_kernel(library: str, name: str):
    """A small-batch kernel's C function (x, x_stride, m, k, packed, n, bias, out, out_stride) ->
    status, or None where the library did not build or its <library>_ready() says no."""
    if not _library_ready(library):
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_function(library, name, (ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64), ctypes.c_int)


@functools.cache
def _amx_kernel():
    """The AMX kernel's C function, or None where the CPU (or the compiler) has no AMX or Linux
    refuses the process AMX's state."""
    return _small_batch_kernel("amx_linear", "amx_linear_bf16")


def pack_for_amx(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] (in a multiple of 32) in the AMX kernel's layout: per pair of 16-output
    tiles (out padded with zero rows to a multiple of 32) and per 32 inputs, the two tiles' 16
    rows of (16 outputs x 2 consecutive inputs)."""
    out_features, in_features = weight.shape
    padded = torch.zeros((out_features + 31) // 32 * 32, in_features, dtype=weight.dtype)
    padded[:out_features] = weight
    # [pair, tile, output, input tile, input pair, 2] -> [pair, input tile, tile, input pair, output, 2]
    tiles = padded.view(-1, 2, 16, in_features // 32, 16, 2)
    return tiles.permute(0, 3, 1, 4, 2, 5).contiguous()


# NOTE: projections wider than _WIDE_OUTPUTS (LM heads) take the float32 kernel up to _WIDE_MAX_ROWS
# rows only; the bfloat16 one up to AMX_MAX_ROWS, as the others. SmolLM-135M's LM head (49,152 x
# 576), 9 alternated repeats on the 2-core Zen 5, with the kernels' prefetch (panels.h), kernel
# against oneDNN:
#   float32, two threads:  1.25 / 2.21 / 3.37 / 8.06 ms against 2.13 / 2.93 / 3.93 / 8.03 at 8 / 16
#   / 25 / 64 rows; one thread: 2.59 against 2.94 at 1 row, 16.41 against 15.73 at 64;
#   bfloat16, two threads: 0.52 / 1.10 / 1.67 / 3.99 against 1.12 / 1.64 / 2.13 / 4.36; one
#   thread: 7.65 against 8.17 at 64 rows.
# Before that prefetch, at 64 rows: 14.6 ms on the float32 kernel against 12.6 for oneDNN on a
# Xeon, 5.3 on the bfloat16 kernel against 4.9 on the Zen 5. The layer projections (up to 3,072
# outputs) measured 0.96-1.34x oneDNN's speed in float32, 1.04-1.29x in bfloat16, up to 64 rows.
_WIDE_OUTPUTS = 4096
_WIDE_MAX_ROWS = 32


def _f32_takes(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and _f32_kernel() is not None


@functools.cache
def _f32_kernel():
    """The float32 small-batch kernel's C function, or None where the CPU (or the compiler) has
    no AVX-512."""
    return _small_batch_kernel("f32_linear", "f32_linear")


def pack_f32_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] in the float32 kernel's layout: per panel of 48 outputs (out padded with
    zero rows to a multiple of 48), its in rows of 48 (W^T cut to the panel)."""
    out_features, in_features = weight.shape
    padded = torch.zeros((out_features + 47) // 48 * 48, in_features, dtype=torch.float32)
    padded[:out_features] = weight
    return padded.view(-1, 48, in_features).transpose(1, 2).contiguous()


def _gate_up_takes(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and _gate_up_kernel() is not None


@functools.cache
def _gate_up_kernel():
    """The float32 gate/up kernel's C function (x, x_stride, m, k, packed, inter, gated, out,
    out_stride) -> status, or None where the CPU (or the compiler) has no AVX-512."""
    if not _library_ready("f32_gate_up"):
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_function("f32_gate_up", "f32_gate_up", (ptr, i64, i64, i64, ptr, i64, ctypes.c_int, ptr, i64),
                        ctypes.c_int)


def pack_f32_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """weight [2 * inter, in] (the gate rows, then the up rows) in the gate/up kernel's layout: per
    panel of 32 gate outputs and the same 32 up outputs (inter padded with zero rows to a multiple
    of 32), its in rows of 64: the panel's 32 gate values, then its 32 up values."""
    stacked, in_features = weight.shape
    inter, padded_inter = stacked // 2, (stacked // 2 + 31) // 32 * 32
    halves = torch.zeros(2, padded_inter, in_features, dtype=torch.float32)
    halves[:, :inter] = weight.view(2, inter, in_features)
    # [half, panel, output, in] -> [panel, in, half, output]
    return halves.view(2, -1, 32, in_features).permute(1, 3, 0, 2).contiguous()


def _gate_up_takes_x(x: torch.Tensor, w: Linear) -> bool:
    """Whether x can run on w's gate/up kernel copy (a float32 x on the CPU, w with the copy)."""
    return w.gate_up is not None and x.dtype == torch.float32 and x.is_cpu


def _gate_up_f32(x: torch.Tensor, w: Linear, gated: bool) -> torch.Tensor:
    x = x if x.stride(1) == 1 else x.contiguous()
    inter = w.out_features // 2
    out = torch.empty(x.shape[0], inter if gated else w.out_features, dtype=torch.float32)
    _gate_up_kernel()(x.data_ptr(), x.stride(0), x.shape[0], w.in_features, w.gate_up.data_ptr(), inter, int(gated),
                      out.data_ptr(), out.stride(0))
    return out


def linear_silu_and_mul(x: torch.Tensor, w: Linear) -> torch.Tensor:
    """silu_and_mul(linear(x, w)) for w a gated MLP's stacked gate and up weights: in one pass of
    the gate/up kernel where w has its copy (the batches the small-batch kernel does not take)."""
    if _gate_up_takes_x(x, w) and not _small_batch_f32(x, w):
        return _gate_up_f32(x, w, gated=True)
    return silu_and_mul(linear(x, w))


def _small_batch_f32(x: torch.Tensor, w: Linear) -> bool:
    """Whether linear runs x on the float32 small-batch kernel."""
    rows = x.shape[0] if x.is_cpu and x.stride(1) == 1 else 0
    f32_rows = AMX_MAX_ROWS if w.out_features <= _WIDE_OUTPUTS else _WIDE_MAX_ROWS
    return w.f32 is not None and 0 < rows <= f32_rows and x.dtype == torch.float32


def _bf16_takes(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.shape[1] % 2 == 0
            and _bf16_kernel() is not None)


def _bf16_kernel():
    """The AVX512-BF16 kernel's C function, or None where the CPU (or the compiler) has no
    AVX512-BF16: vdpbf16ps, or float32 FMAs on the weight pairs widened where bf16_widens()."""
    return _bf16_entry(bf16_kernel_name())


@functools.cache
def _bf16_entry(name: str):
    return _small_batch_kernel("bf16_linear", name)


def bf16_kernel_name() -> str:
    """The bfloat16 kernel's entry in csrc/bf16_linear.c this CPU takes."""
    return "bf16_linear_wide" if bf16_widens() else "bf16_linear"


# NOTE: where vdpbf16ps's rate in flops is below this share of float32 FMAs', the bfloat16 kernel
# widens its weights and runs FMAs (from 4 rows on: csrc/bf16.h). 2-core Xeon (Emerald Rapids, no
# AMX): 0.48-0.50 (vdpbf16ps at one in two cycles); SmolLM-135M's projections, one thread, 138-147
# against 84-87 GFLOP/s at 16-2,048 rows; two threads 265-269 against 174-176 at 64. On the Zen 4
# the vdpbf16ps kernel ran ~2x float32's oneDNN (426-431 against 190-216 GFLOP/s, two threads, 2,048
# rows; earlier sessions), so a ratio there would keep vdpbf16ps (not measured on AMD this time).
_WIDEN_BELOW = 0.8


@functools.cache
def bf16_widens() -> bool:
    """Whether the bfloat16 kernel runs float32 FMAs on widened pairs rather than vdpbf16ps: where
    this core's vdpbf16ps is measured (bf16_linear_dot_ratio, ~2 ms, once a process) at under
    _WIDEN_BELOW of its FMAs' rate in flops. Both give the same sums but in denormals."""
    if not _library_ready("bf16_linear"):  # no AVX512-BF16 (the library then has no ratio to measure)
        return False
    ratio = cpu_function("bf16_linear", "bf16_linear_dot_ratio", (), ctypes.c_double)
    measured = ratio()
    logger.info("bfloat16 kernel: vdpbf16ps at %.2fx float32 FMAs' flops: %s", measured,
                "float32 FMAs on widened pairs" if measured < _WIDEN_BELOW else "vdpbf16ps")
    return measured < _WIDEN_BELOW


def pack_bf16_pairs(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] (in even) in the bfloat16 kernel's layout: per panel of 48 outputs (out
    padded with zero rows to a multiple of 48) and per pair of inputs, the panel's 48 outputs x 2
    consecutive inputs."""
    out_features, in_features = weight.shape
    padded = torch.zeros((out_features + 47) // 48 * 48, in_features, dtype=weight.dtype)
    padded[:out_features] = weight
    # [panel, output, input pair, 2] -> [panel, input pair, output, 2]
    return padded.view(-1, 48, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


def _linear_bf16(x: torch.Tensor, w: Linear) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.out_features, dtype=torch.bfloat16)
    bias = w.bias_f32.data_ptr() if w.bias_f32 is not None else None
    status = _bf16_kernel()(x.data_ptr(), x.stride(0), x.shape[0], w.in_features, w.bf16.data_ptr(), w.out_features,
                            bias, out.data_ptr(), out.stride(0))
    if status != 0:
        raise MemoryError("linear: the bfloat16 kernel could not allocate its float32 copy of x")
    return out


def _linear_f32(x: torch.Tensor, w: Linear) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
    bias = w.bias.data_ptr() if w.bias is not None else None
    _f32_kernel()(x.data_ptr(), x.stride(0), x.shape[0], w.in_features, w.f32.data_ptr(), w.out_features, bias,
                  out.data_ptr(), out.stride(0))
    return out


def _linear_amx(x: torch.Tensor, w: Linear) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.out_features, dtype=x.dtype)
    bias = w.bias_f32.data_ptr() if w.bias_f32 is not None else None
    status = _amx_kernel()(x.data_ptr(), x.stride(0), x.shape[0], w.in_features, w.amx.data_ptr(), w.out_features,
                           bias, out.data_ptr(), out.stride(0))
    if status != 0:
        raise MemoryError("linear: the AMX kernel could not allocate its buffer")
    return out


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, w: Linear) -> torch.Tensor:
    """x: [rows, in] -> [rows, out] in x's dtype."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"linear: x {tuple(x.shape)} for a weight of {w.in_features} inputs")
    # NOTE: the compiled kernels read x through its address, so only a CPU x reaches them; one on
    # another device goes to torch, which refuses the mix of devices.
    rows = x.shape[0] if x.is_cpu and x.stride(1) == 1 else 0
    if w.amx is not None and 0 < rows <= AMX_MAX_ROWS and x.dtype == torch.bfloat16:
        return _linear_amx(x, w)
    if w.bf16 is not None and x.dtype == torch.bfloat16 and x.is_cpu:
        if w.packed is None:  # no oneDNN copy: the kernel takes every batch
            if x.shape[0] == 0:
                return x.new_empty(0, w.out_features)
            return _linear_bf16(x if x.stride(1) == 1 else x.contiguous(), w)
        if 0 < rows <= AMX_MAX_ROWS:
            return _linear_bf16(x, w)
    if _small_batch_f32(x, w):
        return _linear_f32(x, w)
    if _gate_up_takes_x(x, w):
        return _gate_up_f32(x, w, gated=False)
    if w.packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w.packed, w.bias, "none", [], "")
    if w.weight_t is None:  # a compiled kernel's copy alone: the bfloat16 kernel's, or the float32 gate/up's
        kind = "float32" if w.gate_up is not None else "bfloat16"
        raise RuntimeError(f"linear: a CPU {kind} weight takes a {kind} input on the CPU, got {x.dtype} "
                           f"on {x.device}")
    if w.bias is None:
        return x @ w.weight_t
    return torch.addmm(w.bias, x, w.weight_t)
