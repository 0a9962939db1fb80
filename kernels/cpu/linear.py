"""The CPU backend's projections, y = x @ W^T + b, on weights prepared once when the model loads.

oneDNN on W prepacked into its blocked layout (float32; bfloat16 where oneDNN has a bfloat16 path),
and the compiled kernels where this CPU's build has them, each on its own copy of W:
- decode-sized batches (up to the small_batch_rows limit) in bfloat16 on AMX (csrc/amx_linear.c);
- bfloat16 without AMX but with AVX512-BF16: csrc/bf16_linear.c for every batch size, in place of
  oneDNN's copy (vdpbf16ps, or float32 FMAs on widened pairs where this core's vdpbf16ps is slow);
- decode-sized batches in float32 on AVX-512 (csrc/f32_linear.c);
- a gated MLP's gate/up projection in float32 on AVX-512 (csrc/f32_gate_up.c, SiLU-and-mul fused),
  in place of oneDNN's copy, for the batches the decode kernel does not take.
Which kernel is faster where: benchmarks/kernels.py --cpu (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from kernels.cpu.native import NativeLibrary

logger = logging.getLogger(__name__)

# NOTE: the batch-size hint oneDNN packs for: 64 served every batch size within 10% of its best,
# a hint of 1 lost 10-30% (benchmarks/kernels.py --cpu).
_PACK_BATCH_HINT = 64
# NOTE: projections wider than _WIDE_OUTPUTS (LM heads) take the float32 small-batch kernel up to
# _WIDE_MAX_ROWS rows only: oneDNN measured as fast above (benchmarks/kernels.py --cpu).
_WIDE_OUTPUTS = 4096
_WIDE_MAX_ROWS = 32
# NOTE: where vdpbf16ps's rate in flops is below this share of float32 FMAs', the bfloat16 kernel
# widens its weights and runs FMAs (Intel cores without AMX run vdpbf16ps at half rate; AMD's at full).
_WIDEN_BELOW = 0.8


@dataclass(frozen=True)
class Linear:
    """A projection in the CPU backend's forms: oneDNN's prepacked copy and/or the compiled kernels'."""

    weight_t: torch.Tensor | None  # [in, out]: contiguous, or a transposed view; None when packed
    # oneDNN-prepacked [out, in] (float32, and bfloat16 where no compiled kernel serves every batch)
    packed: torch.Tensor | None
    bias: torch.Tensor | None  # [out]
    in_features: int
    out_features: int
    amx: torch.Tensor | None = None  # W packed for the AMX kernel
    bias_f32: torch.Tensor | None = None  # float32 bias for the bfloat16 kernels (amx, bf16)
    f32: torch.Tensor | None = None  # W packed for the float32 small-batch kernel
    bf16: torch.Tensor | None = None  # W packed for the AVX512-BF16 kernel, which takes every batch
    # a gated MLP's stacked gate and up weights packed for the float32 gate/up kernel
    gate_up: torch.Tensor | None = None


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether weights like this one are prepacked for oneDNN: on the CPU with oneDNN built in,
    float32, or bfloat16 where the CPU has oneDNN's bfloat16 instructions."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if weight.dtype == torch.bfloat16:
        return _has_onednn_bf16()
    return weight.dtype == torch.float32


@functools.cache
def _has_onednn_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class ProjectionKernels:
    """The projection kernels of one compiled library (or of none: oneDNN and torch alone), with
    what each takes decided once, from the library's own probes."""

    def __init__(self, lib: NativeLibrary | None) -> None:
        self.lib = lib
        # the packed layouts' sizes, from the library (no library: no packed copy is ever made)
        limits = lib.limits if lib else {}
        self.panel = limits.get("panel")
        self.gate_up_half = limits.get("gate_up_half")
        self.small_batch_rows = limits.get("small_batch_rows", 0)
        self.has_amx = self._ready("amx_linear") and lib.has("amx_linear_bf16")
        self.has_f32 = self._ready("f32_linear") and lib.has("f32_linear")
        self.has_gate_up = self._ready("f32_gate_up") and lib.has("f32_gate_up")
        self.has_bf16 = self._ready("bf16_linear") and lib.has("bf16_linear")
        self.bf16_widens = self.has_bf16 and self._measure_widening()
        self.bf16_entry = "bf16_linear_wide" if self.bf16_widens else "bf16_linear"

    def _ready(self, library: str) -> bool:
        lib = self.lib
        return lib is not None and lib.has(f"{library}_ready") and bool(getattr(lib, f"{library}_ready")())

    def _measure_widening(self) -> bool:
        """Whether this core's vdpbf16ps runs under _WIDEN_BELOW of its FMAs' flops (~2 ms, once)."""
        measured = self.lib.bf16_linear_dot_ratio()
        logger.info("bfloat16 kernel: vdpbf16ps at %.2fx float32 FMAs' flops: %s", measured,
                    "float32 FMAs on widened pairs" if measured < _WIDEN_BELOW else "vdpbf16ps")
        return measured < _WIDEN_BELOW

    def capabilities(self) -> list[str]:
        names = {"amx": self.has_amx, "f32_small_batch": self.has_f32, "f32_gate_up": self.has_gate_up,
                 "bf16": self.has_bf16}
        return [name for name, has in names.items() if has]

    # ---- preparing W ----

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, copy: bool = True,
                small_batches: bool = True, gate_up: bool = False) -> Linear:
        """weight [out, in]: prepacked where can_prepack allows; else W^T (a contiguous copy, or
        with copy=False a transposed view). small_batches: also the small-batch kernels' copy (AMX
        for bfloat16, the float32 kernel), which doubles the weight's memory (a prefill-only engine
        passes False). bfloat16 on AVX512-BF16 without AMX: the bfloat16 kernel's copy in place of
        oneDNN's, whatever small_batches says. gate_up (a gated MLP's gate rows then its up rows, no
        bias): the float32 gate/up kernel's copy in place of oneDNN's."""
        if weight.dim() != 2 or (bias is not None and bias.shape != weight.shape[:1]):
            bias_shape = None if bias is None else tuple(bias.shape)
            raise ValueError(f"prepare_linear: weight {tuple(weight.shape)}, bias {bias_shape}")
        if not can_prepack(weight):
            weight_t = weight.t().contiguous() if copy else weight.t()
            return Linear(weight_t, None, bias, weight.shape[1], weight.shape[0])
        bias = bias.contiguous() if bias is not None else None
        is_bf16 = weight.dtype == torch.bfloat16
        amx = self.pack_for_amx(weight) if small_batches and is_bf16 and self.has_amx and weight.shape[1] % 32 == 0 \
            else None
        bf16_takes = is_bf16 and self.has_bf16 and weight.shape[1] % 2 == 0
        if bf16_takes and not self.has_amx:  # the bfloat16 kernel serves every batch size
            bf16, packed = self.pack_bf16_pairs(weight), None
        else:
            bf16 = self.pack_bf16_pairs(weight) if small_batches and amx is None and bf16_takes else None
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_BATCH_HINT)
        bias_f32 = bias.float().contiguous() if (amx is not None or bf16 is not None) and bias is not None else None
        is_f32 = weight.dtype == torch.float32
        f32 = self.pack_f32_panels(weight) if small_batches and is_f32 and self.has_f32 else None
        gate_up_copy = None
        if gate_up and is_f32 and self.has_gate_up and bias is None and weight.shape[0] % 2 == 0:
            gate_up_copy, packed = self.pack_f32_gate_up(weight), None
        return Linear(None, packed, bias, weight.shape[1], weight.shape[0], amx, bias_f32, f32, bf16, gate_up_copy)

    def pack_for_amx(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] (in a multiple of 32) in the AMX kernel's layout: per pair of 16-output
        tiles (out padded with zero rows to a multiple of 32) and per 32 inputs, the two tiles' 16
        rows of (16 outputs x 2 consecutive inputs)."""
        out_features, in_features = weight.shape
        padded = torch.zeros(-(-out_features // 32) * 32, in_features, dtype=weight.dtype)
        padded[:out_features] = weight
        # [pair, tile, output, input tile, input pair, 2] -> [pair, input tile, tile, input pair, output, 2]
        tiles = padded.view(-1, 2, 16, in_features // 32, 16, 2)
        return tiles.permute(0, 3, 1, 4, 2, 5).contiguous()

    def _padded_panels(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """weight [out, in] with out padded with zero rows to whole panels."""
        out_features, in_features = weight.shape
        padded = torch.zeros(-(-out_features // self.panel) * self.panel, in_features, dtype=dtype)
        padded[:out_features] = weight
        return padded

    def pack_f32_panels(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] in the float32 kernel's layout: per panel of outputs, its in rows."""
        padded = self._padded_panels(weight, torch.float32)
        return padded.view(-1, self.panel, weight.shape[1]).transpose(1, 2).contiguous()

    def pack_bf16_pairs(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] (in even) in the bfloat16 kernel's layout: per panel of outputs and per
        pair of inputs, the panel's outputs x 2 consecutive inputs."""
        padded = self._padded_panels(weight, weight.dtype)
        # [panel, output, input pair, 2] -> [panel, input pair, output, 2]
        return padded.view(-1, self.panel, weight.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()

    def pack_f32_gate_up(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [2 * inter, in] (gate rows, then up rows) in the gate/up kernel's layout: per panel
        of gate_up_half gate outputs and the same up outputs (inter padded with zero rows), its in
        rows: the panel's gate values, then its up values."""
        stacked, in_features = weight.shape
        half = self.gate_up_half
        inter = stacked // 2
        halves = torch.zeros(2, -(-inter // half) * half, in_features, dtype=torch.float32)
        halves[:, :inter] = weight.view(2, inter, in_features)
        # [half, panel, output, in] -> [panel, in, half, output]
        return halves.view(2, -1, half, in_features).permute(1, 3, 0, 2).contiguous()

    # ---- running ----

    def linear(self, x: torch.Tensor, w: Linear) -> torch.Tensor:
        """x: [rows, in] -> [rows, out] in x's dtype, on the copy that serves this batch."""
        # NOTE: the compiled kernels take CPU rows only; anything else goes to torch, which refuses
        # a mix of devices.
        rows = x.shape[0] if x.is_cpu and x.stride(1) == 1 else 0
        if w.amx is not None and 0 < rows <= self.small_batch_rows and x.dtype == torch.bfloat16:
            return self._run_kernel("amx_linear_bf16", x, w.amx, w.bias_f32, w.out_features)
        if w.bf16 is not None and x.dtype == torch.bfloat16 and x.is_cpu:
            if w.packed is None:  # no oneDNN copy: the kernel takes every batch
                if x.shape[0] == 0:
                    return x.new_empty(0, w.out_features)
                x = x if x.stride(1) == 1 else x.contiguous()
                return self._run_kernel(self.bf16_entry, x, w.bf16, w.bias_f32, w.out_features)
            if 0 < rows <= self.small_batch_rows:
                return self._run_kernel(self.bf16_entry, x, w.bf16, w.bias_f32, w.out_features)
        if self.takes_small_batch_f32(x, w):
            return self._run_kernel("f32_linear", x, w.f32, w.bias, w.out_features)
        if w.gate_up is not None and x.dtype == torch.float32 and x.is_cpu:
            return self.gate_up(x, w, gated=False)
        if w.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w.packed, w.bias, "none", [], "")
        if w.weight_t is None:  # a compiled kernel's copy alone: the bfloat16 kernel's, or the gate/up one's
            kind = "float32" if w.gate_up is not None else "bfloat16"
            raise RuntimeError(f"linear: a CPU {kind} weight takes a {kind} input on the CPU, got {x.dtype} "
                               f"on {x.device}")
        if w.bias is None:
            return x @ w.weight_t
        return torch.addmm(w.bias, x, w.weight_t)

    def gate_up_silu(self, x: torch.Tensor, w: Linear, silu_and_mul) -> torch.Tensor:
        """silu_and_mul(linear(x, w)), in one pass of the gate/up kernel where w has its copy and
        the batch is not the small-batch kernel's."""
        if w.gate_up is not None and x.dtype == torch.float32 and x.is_cpu and not self.takes_small_batch_f32(x, w):
            return self.gate_up(x, w, gated=True)
        return silu_and_mul(self.linear(x, w))

    def takes_small_batch_f32(self, x: torch.Tensor, w: Linear) -> bool:
        """Whether linear runs x on the float32 small-batch kernel."""
        if w.f32 is None or x.dtype != torch.float32:
            return False
        rows = x.shape[0] if x.is_cpu and x.stride(1) == 1 else 0
        max_rows = self.small_batch_rows if w.out_features <= _WIDE_OUTPUTS else _WIDE_MAX_ROWS
        return 0 < rows <= max_rows

    def gate_up(self, x: torch.Tensor, w: Linear, gated: bool) -> torch.Tensor:
        x = x if x.stride(1) == 1 else x.contiguous()
        inter = w.out_features // 2
        out = torch.empty(x.shape[0], inter if gated else w.out_features, dtype=torch.float32)
        self.lib.f32_gate_up(x, x.stride(0), x.shape[0], w.in_features, w.gate_up, inter, int(gated), out,
                             out.stride(0))
        return out

    def _run_kernel(self, entry: str, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                    out_features: int) -> torch.Tensor:
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
        getattr(self.lib, entry)(x, x.stride(0), x.shape[0], x.shape[1], packed, out_features, bias, out,
                                 out.stride(0))
        return out
