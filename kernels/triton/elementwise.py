"""Triton's row-wise ops: SiLU-and-mul, RMSNorm (with the residual add fused in), rotary (neox style,
in place) with the KV-cache write fused in (one launch for Q, K and V), and each alone. Shapes are
checked by the backend interface (kernels/interface.py); these run on CUDA tensors, and on CPU
tensors under TRITON_INTERPRET=1 (tests)."""

from __future__ import annotations

import torch

from kernels.triton.common import tl, triton

# The most heads one rotary-and-write program takes (a token's query and KV heads, in groups of this).
_ROTARY_HEADS = 16


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    num_tokens, width = x.shape
    half = width // 2
    out = torch.empty(num_tokens, half, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(half))
    grid = (num_tokens, triton.cdiv(half, block))
    _silu_and_mul_kernel[grid](x, out, half, x.stride(0), out.stride(0), BLOCK=block)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); without a residual (rms_norm(x), the same tensor)."""
    x = x.contiguous()
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else out
    if num_tokens:
        residual_in = residual.contiguous() if residual is not None else x
        _rms_norm_kernel[(num_tokens,)](
            x, residual_in, weight, out, new_residual, hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
        )
    return out, new_residual


def apply_rotary(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    num_tokens, _, head_dim = query.shape
    if num_tokens == 0:
        return
    for x, heads in ((query, query.shape[1]), (key, key.shape[1])):
        _rotary_kernel[(num_tokens, heads)](
            x, positions, cos_sin_cache, x.stride(0), x.stride(1), cos_sin_cache.stride(0),
            HALF=head_dim // 2, BLOCK=triton.next_power_of_2(head_dim // 2),
        )


def rotary_and_write_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                        cos_sin_cache: torch.Tensor, kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Rotate query and key in place and write key and value at slot_mapping (-1: no write), in one
    launch: a program per token and group of up to 16 of its heads (query heads, then KV heads), so
    that a program moves a few KiB instead of one head's 128 bytes."""
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return
    num_kv_heads = key.shape[1]
    block_h = min(_ROTARY_HEADS, triton.next_power_of_2(num_heads + num_kv_heads))
    _rotary_write_kv_kernel[(num_tokens, triton.cdiv(num_heads + num_kv_heads, block_h))](
        query, key, value, positions, cos_sin_cache, kv_cache_layer, slot_mapping,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos_sin_cache.stride(0), *kv_cache_layer.stride()[:4],
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=kv_cache_layer.shape[2], HALF=head_dim // 2,
        BLOCK=triton.next_power_of_2(head_dim // 2), BLOCK_H=block_h,
    )


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_heads)](
        key, value, kv_cache_layer, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *kv_cache_layer.stride()[:4],
        BLOCK_SIZE=kv_cache_layer.shape[2], HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
    )


if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, half, stride_x_token, stride_out_token, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)  # NOTE: token * stride passes 2**31 in a long step
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < half
        gate = tl.load(x_ptr + token * stride_x_token + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + token * stride_x_token + half + offs, mask=mask, other=0.0).to(tl.float32)
        result = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + token * stride_out_token + offs, result.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, hidden, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < hidden
        x = tl.load(x_ptr + row * hidden + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            # Add in float32 and round once: what torch's half-precision add does.
            residual = tl.load(residual_ptr + row * hidden + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
            tl.store(new_residual_ptr + row * hidden + offs, x, mask=mask)
        xf = x.to(tl.float32)
        variance = tl.sum(xf * xf, axis=0) / hidden
        normed = (xf * tl.rsqrt(variance + eps)).to(x.dtype)
        weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # Multiply in float32 and round once (torch rounds its half-precision product the same way).
        result = (normed.to(tl.float32) * weight).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * hidden + offs, result, mask=mask)

    @triton.jit
    def _rotary_kernel(x_ptr, positions_ptr, cache_ptr, stride_x_token, stride_x_head, stride_cache_pos,
                       HALF: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        _rotate_head(x_ptr + token * stride_x_token + head * stride_x_head, cache_ptr, positions_ptr, token,
                     stride_cache_pos, offs, mask, HALF)

    @triton.jit
    def _rotate_head(base, cache_ptr, positions_ptr, token, stride_cache_pos, offs, mask, HALF: tl.constexpr):
        """Rotate the head at base in place by its token's position; returns its two rotated halves."""
        pos = tl.load(positions_ptr + token)
        cos, sin = _cos_sin(cache_ptr + pos * stride_cache_pos + offs, mask, HALF)
        x1 = tl.load(base + offs, mask=mask, other=0.0)
        x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)
        r1, r2 = _rotated(x1, x2, cos, sin)
        tl.store(base + offs, r1, mask=mask)
        tl.store(base + HALF + offs, r2, mask=mask)
        return r1, r2

    @triton.jit
    def _cos_sin(angles, mask, HALF: tl.constexpr):
        """The cos entries at angles (a row of the cos/sin cache: cos, then sin HALF further), and the
        sin entries, in float32."""
        cos = tl.load(angles, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(angles + HALF, mask=mask, other=0.0).to(tl.float32)
        return cos, sin

    @triton.jit
    def _rotated(x1, x2, cos, sin):
        """A head's halves rotated (neox style): in float32, each rounded once to x1's dtype."""
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        return (x1f * cos - x2f * sin).to(x1.dtype), (x2f * cos + x1f * sin).to(x1.dtype)

    @triton.jit
    def _slot_address(cache_ptr, slot, stride_cache_block, stride_cache_offset, BLOCK_SIZE: tl.constexpr):
        """Where a token's KV goes in a layer's paged cache: its slot's block, then its offset there."""
        return cache_ptr + (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_offset

    @triton.jit
    def _rotary_write_kv_kernel(q_ptr, k_ptr, v_ptr, positions_ptr, cache_sin_cos_ptr, cache_ptr, slot_ptr,
                                stride_q_token, stride_q_head, stride_k_token, stride_k_head,
                                stride_v_token, stride_v_head, stride_table_pos,
                                stride_cache_block, stride_cache_kv, stride_cache_offset, stride_cache_head,
                                NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                                HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
        """One token's heads [BLOCK_H * g, BLOCK_H * (g + 1)): those below NUM_HEADS are query heads,
        rotated in place; the next NUM_KV_HEADS are KV heads: the key head rotated in place (as
        _rotate_head does), then it and the value head written to the token's slot."""
        token = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs = tl.arange(0, BLOCK)
        mask_d = offs < HALF
        is_query = heads < NUM_HEADS
        is_key = (heads >= NUM_HEADS) & (heads < NUM_HEADS + NUM_KV_HEADS)
        kv_heads = tl.where(is_key, heads - NUM_HEADS, 0)
        rows = tl.where(is_query[:, None], q_ptr + token * stride_q_token + heads[:, None] * stride_q_head,
                        k_ptr + token * stride_k_token + kv_heads[:, None] * stride_k_head)
        mask = (is_query | is_key)[:, None] & mask_d[None, :]
        pos = tl.load(positions_ptr + token)
        cos, sin = _cos_sin(cache_sin_cos_ptr + pos * stride_table_pos + offs, mask_d, HALF)
        x1 = tl.load(rows + offs[None, :], mask=mask, other=0.0)
        x2 = tl.load(rows + HALF + offs[None, :], mask=mask, other=0.0)
        r1, r2 = _rotated(x1, x2, cos[None, :], sin[None, :])
        tl.store(rows + offs[None, :], r1, mask=mask)
        tl.store(rows + HALF + offs[None, :], r2, mask=mask)
        slot = tl.load(slot_ptr + token)
        if slot >= 0:
            key_mask = is_key[:, None] & mask_d[None, :]
            dst = (_slot_address(cache_ptr, slot, stride_cache_block, stride_cache_offset, BLOCK_SIZE)
                   + kv_heads[:, None] * stride_cache_head + offs[None, :])
            tl.store(dst, r1, mask=key_mask)
            tl.store(dst + HALF, r2, mask=key_mask)
            v_rows = v_ptr + token * stride_v_token + kv_heads[:, None] * stride_v_head + offs[None, :]
            tl.store(dst + stride_cache_kv, tl.load(v_rows, mask=key_mask, other=0.0), mask=key_mask)
            tl.store(dst + stride_cache_kv + HALF, tl.load(v_rows + HALF, mask=key_mask, other=0.0), mask=key_mask)

    @triton.jit
    def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr,
                         stride_key_token, stride_key_head, stride_value_token, stride_value_head,
                         stride_cache_block, stride_cache_kv, stride_cache_offset, stride_cache_head,
                         BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        slot = tl.load(slot_ptr + token)
        if slot >= 0:
            offs_d = tl.arange(0, BLOCK_D)
            mask_d = offs_d < HEAD_DIM
            dst = (_slot_address(cache_ptr, slot, stride_cache_block, stride_cache_offset, BLOCK_SIZE)
                   + head * stride_cache_head + offs_d)
            k = tl.load(key_ptr + token * stride_key_token + head * stride_key_head + offs_d, mask=mask_d)
            v = tl.load(value_ptr + token * stride_value_token + head * stride_value_head + offs_d, mask=mask_d)
            tl.store(dst, k, mask=mask_d)
            tl.store(dst + stride_cache_kv, v, mask=mask_d)
