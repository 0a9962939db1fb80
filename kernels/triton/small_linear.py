"""Projections of a few rows (a small decode batch) in Triton, with the ops around them fused in.

y = f(x) @ W^T for x of at most SMALL_ROWS rows, where f may be the residual add and RMSNorm that
come before a projection in a decoder layer (one launch instead of two), and the output may be a
gated MLP's silu(gate) * up (one launch instead of two). Each program computes BLOCK_N output
columns for every row over the whole of K, so the sums are in one fixed order (no split-K partials,
no atomics: the same bits on every run). W may be kept either way (W [out, in] contiguous as the
checkpoint has it, or W^T [in, out] contiguous): the kernel reads it through its strides.

Rounding follows the unfused ops (kernels/triton/elementwise.py): the residual sum and the normed
row are rounded to the model's dtype before the projection, the projection's output is rounded
before the gate's SiLU. Shapes are checked here; these run on CUDA tensors, and on CPU tensors
under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.triton.common import dot_in_fp32, tl, triton

# The most rows these kernels take: one compiled kernel per variant (the rows are masked in a tile of
# this height, the smallest a tensor-core dot takes).
SMALL_ROWS = 16
_BLOCK_N = 16


@dataclass(frozen=True)
class SmallTuning:
    """A K tile of tile_bytes a row (512: 256 half-precision or 128 float32 values), its warps and
    pipeline stages. The default keeps a gated float32 program under the 99 KiB of shared memory the
    smallest GPUs give one (tests/kernels/test_triton_compiles.py); gpu_engine's layouts phase times
    others."""

    tile_bytes: int = 512
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_SMALL_TUNING = SmallTuning()


def launch_config(dtype: torch.dtype, k: int, tuning: SmallTuning = DEFAULT_SMALL_TUNING) -> dict:
    """The tiles and launch options for inputs of dtype and k columns."""
    block_k = min(tuning.tile_bytes // dtype.itemsize, max(16, triton.next_power_of_2(k)))
    return {"BLOCK_M": SMALL_ROWS, "BLOCK_N": _BLOCK_N, "BLOCK_K": block_k, "num_warps": tuning.num_warps,
            "num_stages": tuning.num_stages}


def small_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None, *,
                 residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                 eps: float = 0.0, gated: bool = False,
                 tuning: SmallTuning = DEFAULT_SMALL_TUNING) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, the new residual stream) for x [rows, K] and weight_t [K, out] (W^T, contiguous or a
    transposed view of a contiguous W).

    norm_weight: x is first RMS-normalized with it (and with residual, x + residual first, that sum
    returned as the new residual; without, x itself is the residual returned). gated: weight_t's
    first half of columns are a gated MLP's gate, the second its up; y = silu(gate) * up [rows,
    out / 2]. bias [out] is added to the projection before the gate. Raises ValueError on shapes
    that do not fit."""
    rows, k = x.shape if x.dim() == 2 else (-1, -1)
    if x.dim() != 2 or not 0 < rows <= SMALL_ROWS or weight_t.dim() != 2 or weight_t.shape[0] != k:
        raise ValueError(f"small_linear: x {tuple(x.shape)} (1 to {SMALL_ROWS} rows) for W^T {tuple(weight_t.shape)}")
    out_features = weight_t.shape[1]
    if gated and out_features % 2:
        raise ValueError(f"small_linear: a gated projection needs an even width, got {out_features}")
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"small_linear: bias {tuple(bias.shape)} for {out_features} outputs")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"small_linear: norm weight {tuple(norm_weight.shape)} for {k} inputs")
    if residual is not None and (norm_weight is None or residual.shape != x.shape):
        raise ValueError(f"small_linear: residual {tuple(residual.shape)} needs a norm and x's shape {tuple(x.shape)}")
    if weight_t.stride(0) != 1 and weight_t.stride(1) != 1:
        raise ValueError("small_linear: W^T must be contiguous along one of its dimensions")
    x = x.contiguous()
    width = out_features // 2 if gated else out_features
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    new_residual = x
    if residual is not None:
        residual = residual.contiguous()
        new_residual = torch.empty_like(x)
    placeholder = x  # NOTE: a real pointer for the arguments a variant never reads
    _small_linear_kernel[(triton.cdiv(width, _BLOCK_N),)](
        x, residual if residual is not None else placeholder, norm_weight if norm_weight is not None else placeholder,
        weight_t, bias if bias is not None else placeholder, out, new_residual,
        rows, width, k, eps, weight_t.stride(0), weight_t.stride(1),
        NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, GATED=gated, HAS_BIAS=bias is not None,
        DOT_FP32=dot_in_fp32(x), **launch_config(x.dtype, k, tuning),
    )
    return out, (new_residual if norm_weight is not None else None)


if triton is not None:

    @triton.jit
    def _row_sum(x_ptr, res_ptr, offs_m, offs_k, mask, K, HAS_RESIDUAL: tl.constexpr):
        """x's tile [rows, k], plus the residual's (rounded once to x's dtype)."""
        ptrs = offs_m[:, None] * K + offs_k[None, :]
        x = tl.load(x_ptr + ptrs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            # Add in float32 and round once: what torch's half-precision add does.
            residual = tl.load(res_ptr + ptrs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        return x

    @triton.jit
    def _small_linear_kernel(x_ptr, res_ptr, norm_ptr, w_ptr, bias_ptr, out_ptr, new_res_ptr,
                             M, N, K, eps, stride_wk, stride_wn,
                             NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
                             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
        """BLOCK_N output columns (with GATED: of the gate and of the up half each) for every row."""
        pid = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        rstd = tl.zeros([BLOCK_M], tl.float32)
        if NORM:
            # The rows' RMS over all of K first (the first program writes the residual sum on the way).
            squares = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask = mask_m[:, None] & (offs_k < K)[None, :]
                x = _row_sum(x_ptr, res_ptr, offs_m, offs_k, mask, K, HAS_RESIDUAL)
                if HAS_RESIDUAL:  # noqa: SIM102 - a constexpr test, then a runtime one (no `and` of the two in Triton)
                    if pid == 0:
                        tl.store(new_res_ptr + offs_m[:, None] * K + offs_k[None, :], x, mask=mask)
                xf = x.to(tl.float32)
                squares += tl.sum(xf * xf, axis=1)
            rstd = tl.where(mask_m, tl.rsqrt(squares / K + eps), 0.0)  # NOTE: the padding rows' 0, not inf
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = _row_sum(x_ptr, res_ptr, offs_m, offs_k, mask_m[:, None] & mask_k[None, :], K, HAS_RESIDUAL)
            if NORM:
                # As the RMSNorm kernel: normed in x's dtype, times the weight in float32, rounded once.
                normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
                g = tl.load(norm_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
                x = (normed.to(tl.float32) * g[None, :]).to(x.dtype)
            w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
            w_mask = mask_k[:, None] & mask_n[None, :]
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            if DOT_FP32:
                xd = x.to(tl.float32)
                acc += tl.dot(xd, w.to(tl.float32), input_precision="ieee")
            else:
                xd = x
                acc += tl.dot(xd, w)
            if GATED:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
                if DOT_FP32:
                    acc_up += tl.dot(xd, w_up.to(tl.float32), input_precision="ieee")
                else:
                    acc_up += tl.dot(xd, w_up)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(bias_ptr + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out_dtype = out_ptr.dtype.element_ty
        if GATED:
            # As the unfused pair: the projection rounded to the dtype, then SiLU(gate) * up in float32.
            gate = acc.to(out_dtype).to(tl.float32)
            up = acc_up.to(out_dtype).to(tl.float32)
            result = gate / (1.0 + tl.exp(-gate)) * up
        else:
            result = acc
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], result.to(out_dtype),
                 mask=mask_m[:, None] & mask_n[None, :])
