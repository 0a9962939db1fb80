"""Projections of a few rows (a small decode batch) in Triton, with the ops around them fused in.

y = f(x) @ W^T for x of at most SMALL_ROWS rows, where f may be the residual add and RMSNorm that
come before a projection in a decoder layer (one launch instead of two), and the output may be a
gated MLP's silu(gate) * up (one launch instead of two). Each program computes BLOCK_N output
columns (16 by default) for every row over the whole of K, so the sums are in one fixed order (no
split-K partials, no atomics: the same bits on every run). W may be kept either way (W [out, in]
contiguous as the checkpoint has it, or W^T [in, out] contiguous): the kernel reads it through its
strides.

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


@dataclass(frozen=True)
class SmallTuning:
    """A K tile of tile_bytes a row (512: 256 half-precision or 128 float32 values), the output columns
    a program computes (block_n: small_linear's; small_qkv_rotary's are always 16, eight rotary
    pairs), its warps and pipeline stages. The default keeps a gated float32 program under the 99 KiB
    of shared memory the smallest GPUs give one (tests/kernels/test_triton_compiles.py); gpu_engine's
    layouts phase times others: wider programs read the rows (from L2) fewer times over."""

    tile_bytes: int = 512
    num_warps: int = 4
    num_stages: int = 3
    block_n: int = 16


DEFAULT_SMALL_TUNING = SmallTuning()


def launch_config(dtype: torch.dtype, k: int, tuning: SmallTuning = DEFAULT_SMALL_TUNING) -> dict:
    """The tiles and launch options for inputs of dtype and k columns."""
    block_k = min(tuning.tile_bytes // dtype.itemsize, max(16, triton.next_power_of_2(k)))
    return {"BLOCK_M": SMALL_ROWS, "BLOCK_N": tuning.block_n, "BLOCK_K": block_k, "num_warps": tuning.num_warps,
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
    if bias is not None and (bias.shape != (out_features,) or bias.stride(0) != 1):
        raise ValueError(f"small_linear: bias {tuple(bias.shape)} (stride {bias.stride()}) for {out_features} "
                         "outputs, contiguous")
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.stride(0) != 1):
        raise ValueError(f"small_linear: norm weight {tuple(norm_weight.shape)} (stride {norm_weight.stride()}) "
                         f"for {k} inputs, contiguous")
    if residual is not None and (norm_weight is None or residual.shape != x.shape):
        raise ValueError(f"small_linear: residual {tuple(residual.shape)} needs a norm and x's shape {tuple(x.shape)}")
    if weight_t.stride(0) != 1 and weight_t.stride(1) != 1:
        raise ValueError("small_linear: W^T must be contiguous along one of its dimensions")
    has_residual = residual is not None
    x, residual, new_residual = _rows_and_residual(x, residual)
    width = out_features // 2 if gated else out_features
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    config = launch_config(x.dtype, k, tuning)
    _small_linear_kernel[(triton.cdiv(width, config["BLOCK_N"]),)](
        x, residual, norm_weight if norm_weight is not None else x, weight_t, bias if bias is not None else x, out,
        new_residual,
        rows, width, k, eps, weight_t.stride(0), weight_t.stride(1),
        NORM=norm_weight is not None, HAS_RESIDUAL=has_residual, GATED=gated, HAS_BIAS=bias is not None,
        DOT_FP32=dot_in_fp32(x), **config,
    )
    return out, (new_residual if norm_weight is not None else None)


def qkv_rotary_fits(weight_t: torch.Tensor, head_dim: int) -> bool:
    """Whether small_qkv_rotary takes this QKV projection: W kept as stored (W^T a transposed view of a
    contiguous W, so each output column the kernel gathers is one contiguous row of W) and heads of a
    multiple of 16 values (eight rotary pairs a program)."""
    return weight_t.stride(0) == 1 and head_dim % 16 == 0


def small_qkv_rotary(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, *,
                     residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor, kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor,
                     num_heads: int, num_kv_heads: int,
                     tuning: SmallTuning = DEFAULT_SMALL_TUNING) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's QKV step for a few rows in one launch: the residual add and RMSNorm, the QKV
    projection (weight_t [K, (num_heads + 2 num_kv_heads) head_dim], qkv_rotary_fits), rotary (neox
    style) on the query and key heads, and the key and value heads written into kv_cache_layer
    [num_blocks, 2, block_size, num_kv_heads, head_dim] at slot_mapping (-1: not written). Returns
    (the rotated query [rows, num_heads, head_dim], the new residual stream), as small_linear then
    rotary_and_write_kv leave them. Raises ValueError on shapes that do not fit."""
    rows, k = x.shape
    head_dim = cos_sin_cache.shape[-1]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if not 0 < rows <= SMALL_ROWS or weight_t.shape != (k, width) or not qkv_rotary_fits(weight_t, head_dim):
        raise ValueError(f"small_qkv_rotary: x {tuple(x.shape)}, W^T {tuple(weight_t.shape)} (strides "
                         f"{weight_t.stride()}) for {num_heads} + 2 x {num_kv_heads} heads of {head_dim}")
    # NOTE: the kernel reads positions, slots, the norm weight and the bias at unit stride, and a slot
    # (int64) times the cache's block stride must not wrap.
    if (kv_cache_layer.shape[3:] != (num_kv_heads, head_dim) or positions.shape != (rows,)
            or slot_mapping.shape != (rows,) or norm_weight.shape != (k,)
            or (bias is not None and (bias.shape != (width,) or bias.stride(0) != 1))
            or (residual is not None and residual.shape != x.shape) or cos_sin_cache.stride(-1) != 1
            or positions.stride(0) != 1 or slot_mapping.stride(0) != 1 or slot_mapping.dtype != torch.int64
            or norm_weight.stride(0) != 1):
        raise ValueError(f"small_qkv_rotary: cache {tuple(kv_cache_layer.shape)}, positions {tuple(positions.shape)}, "
                         f"slots {tuple(slot_mapping.shape)} ({slot_mapping.dtype}) for {rows} rows of {k}: "
                         "positions and int64 slots, the norm weight and the bias contiguous")
    has_residual = residual is not None
    x, residual, new_residual = _rows_and_residual(x, residual)
    query = torch.empty(rows, num_heads, head_dim, dtype=x.dtype, device=x.device)
    config = launch_config(x.dtype, k, tuning)
    del config["BLOCK_N"]
    _qkv_rotary_kernel[((num_heads + 2 * num_kv_heads) * head_dim // 16,)](
        x, residual, norm_weight, weight_t, bias if bias is not None else x, query,
        new_residual, positions, cos_sin_cache, kv_cache_layer, slot_mapping,
        rows, k, eps, weight_t.stride(0), weight_t.stride(1), cos_sin_cache.stride(0), *kv_cache_layer.stride()[:4],
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache_layer.shape[2],
        HAS_RESIDUAL=has_residual, HAS_BIAS=bias is not None, DOT_FP32=dot_in_fp32(x), **config,
    )
    return query, new_residual


def _rows_and_residual(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(x contiguous, the residual to read, the new residual stream): with a residual, it contiguous and
    a fresh buffer its sum with x goes to; without, x stands for both (the kernel reads no residual,
    NOTE: a real pointer, there is no null in a kernel's arguments; x is the layer loop's residual)."""
    x = x.contiguous()
    if residual is None:
        return x, x, x
    return x, residual.contiguous(), torch.empty_like(x)


if triton is not None:
    from kernels.triton.elementwise import _cos_sin, _rotated, _slot_address

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
    def _rms_scale(x_ptr, res_ptr, new_res_ptr, offs_m, mask_m, K, eps, write_residual,
                   HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr):
        """The rows' 1 / RMS over all of K (0 for the padding rows); with a residual, the sum is
        written as the new residual where write_residual (one program of the grid)."""
        squares = tl.zeros([offs_m.shape[0]], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = mask_m[:, None] & (offs_k < K)[None, :]
            x = _row_sum(x_ptr, res_ptr, offs_m, offs_k, mask, K, HAS_RESIDUAL)
            if HAS_RESIDUAL:  # noqa: SIM102 - a constexpr test, then a runtime one (no `and` of the two in Triton)
                if write_residual:
                    tl.store(new_res_ptr + offs_m[:, None] * K + offs_k[None, :], x, mask=mask)
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
        return tl.where(mask_m, tl.rsqrt(squares / K + eps), 0.0)  # NOTE: the padding rows' 0, not inf

    @triton.jit
    def _project(x_ptr, res_ptr, norm_ptr, w_ptr, offs_m, mask_m, offs_n, mask_n, rstd, K, stride_wk, stride_wn,
                 up_offset, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
        """(x's rows, normed where NORM, times W^T's columns offs_n; with GATED also times the columns
        up_offset further), float32 [BLOCK_M, BLOCK_N] each."""
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
                w_up = tl.load(w_ptrs + up_offset * stride_wn, mask=w_mask, other=0.0)
                if DOT_FP32:
                    acc_up += tl.dot(xd, w_up.to(tl.float32), input_precision="ieee")
                else:
                    acc_up += tl.dot(xd, w_up)
        return acc, acc_up

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
            rstd = _rms_scale(x_ptr, res_ptr, new_res_ptr, offs_m, mask_m, K, eps, pid == 0, HAS_RESIDUAL, BLOCK_K)
        acc, acc_up = _project(x_ptr, res_ptr, norm_ptr, w_ptr, offs_m, mask_m, offs_n, mask_n, rstd, K, stride_wk,
                               stride_wn, N, NORM, HAS_RESIDUAL, GATED, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32)
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

    @triton.jit
    def _qkv_rotary_kernel(x_ptr, res_ptr, norm_ptr, w_ptr, bias_ptr, q_ptr, new_res_ptr, positions_ptr, cos_sin_ptr,
                           cache_ptr, slot_ptr, M, K, eps, stride_wk, stride_wn, stride_cos_sin,
                           stride_cache_block, stride_cache_kv, stride_cache_offset, stride_cache_head,
                           NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
        """Eight rotary pairs of one head (query, key or value): its columns j and j + HEAD_DIM / 2 for
        eight j, projected from the normed rows, then as rotary_and_write_kv leaves them: a query
        head rotated into q, a key head rotated and a value head as it is written to the cache at
        each row's slot (-1: not written)."""
        HALF: tl.constexpr = HEAD_DIM // 2
        pid = tl.program_id(0)
        head = pid // (HALF // 8)
        first = (pid % (HALF // 8)) * 8
        lane = tl.arange(0, 16)
        offs_n = head * HEAD_DIM + tl.where(lane < 8, first + lane, HALF + first + lane - 8)
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        mask_n = offs_n < (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
        rstd = _rms_scale(x_ptr, res_ptr, new_res_ptr, offs_m, mask_m, K, eps, pid == 0, HAS_RESIDUAL, BLOCK_K)
        acc, _ = _project(x_ptr, res_ptr, norm_ptr, w_ptr, offs_m, mask_m, offs_n, mask_n, rstd, K, stride_wk,
                          stride_wn, 0, True, HAS_RESIDUAL, False, BLOCK_M, 16, BLOCK_K, DOT_FP32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
        dtype = q_ptr.dtype.element_ty
        # the projection rounded as the unfused QKV output is, then split into the pairs' two halves
        x1, x2 = tl.split(tl.permute(tl.reshape(acc.to(dtype), [BLOCK_M, 2, 8]), (0, 2, 1)))
        offs_j = first + tl.arange(0, 8)
        if head < NUM_HEADS + NUM_KV_HEADS:  # a query or key head: rotated as the rotary kernels do
            pos = tl.load(positions_ptr + offs_m, mask=mask_m, other=0)
            cos, sin = _cos_sin(cos_sin_ptr + pos[:, None] * stride_cos_sin + offs_j[None, :], mask_m[:, None], HALF)
            x1, x2 = _rotated(x1, x2, cos, sin)
        if head < NUM_HEADS:
            q = q_ptr + offs_m[:, None] * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + offs_j[None, :]
            tl.store(q, x1, mask=mask_m[:, None])
            tl.store(q + HALF, x2, mask=mask_m[:, None])
        else:
            is_value = head >= NUM_HEADS + NUM_KV_HEADS
            kv_head = head - NUM_HEADS - tl.where(is_value, NUM_KV_HEADS, 0)
            slot = tl.load(slot_ptr + offs_m, mask=mask_m, other=-1)
            written = mask_m & (slot >= 0)
            slot = tl.where(written, slot, 0)
            dst = (_slot_address(cache_ptr, slot, stride_cache_block, stride_cache_offset, BLOCK_SIZE)
                   + kv_head * stride_cache_head + tl.where(is_value, stride_cache_kv, 0))
            tl.store(dst[:, None] + offs_j[None, :], x1, mask=written[:, None])
            tl.store(dst[:, None] + HALF + offs_j[None, :], x2, mask=written[:, None])
