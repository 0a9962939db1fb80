"""Rotary position embedding (neox style, llama3 scaling), applied in place to query and key."""

from __future__ import annotations

import ctypes
import math

import torch

from kernels._cpu import KERNEL_SUFFIXES, cpu_function
from kernels._triton import tl, triton, use_triton

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_CPU_SIGNATURE = (_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64)


def rotary_cos_sin_cache(
    head_dim: int, max_position: int, base: float, rope_scaling: dict | None, dtype: torch.dtype
) -> torch.Tensor:
    """[max_position, head_dim]: cos of the head_dim/2 frequencies, then their sin. Computed in
    float32 as transformers does, then cast. Raises ValueError for an unknown rope type."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    elif rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (default, llama3)")
    freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rotary_ref(query, key, positions, cos_sin_cache) -> None:
    """In place, batched over tokens and heads; the products round in the cache's dtype
    promoted with the input's, as transformers' do (pass the cache in the model dtype)."""
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache[positions].unsqueeze(1)
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    for x in (query, key):
        # Same products and sums as transformers' x * cos + rotate_half(x) * sin, without
        # building the rotated copy.
        x1, x2 = x[..., :half], x[..., half:]
        first = x1 * cos - x2 * sin
        x2.mul_(cos).add_(x1 * sin)
        x1.copy_(first)


def _rotary_cpu(query, key, positions, cos_sin_cache) -> bool:
    """The compiled CPU kernel (one pass per token, the reference's exact roundings) for CPU
    tensors all float32 or all bfloat16; False where it does not apply (then the reference
    runs). Raises ValueError for a position outside the cache (it reads memory directly)."""
    tensors = (query, key, cos_sin_cache)
    suffix = KERNEL_SUFFIXES.get(query.dtype)
    if suffix is None or any(t.device.type != "cpu" or t.dtype != query.dtype for t in tensors):
        return False
    if cos_sin_cache.stride(-1) != 1:
        return False
    kernel = cpu_function("rotary_kv", f"rotary_{suffix}", _CPU_SIGNATURE, ctypes.c_int)
    if kernel is None:
        return False
    positions = positions.to(torch.int64).contiguous()
    status = kernel(query.data_ptr(), query.stride(0), query.stride(1), query.shape[1],
                    key.data_ptr(), key.stride(0), key.stride(1), key.shape[1], positions.data_ptr(),
                    cos_sin_cache.data_ptr(), cos_sin_cache.stride(0), cos_sin_cache.shape[0], query.shape[0],
                    query.shape[-1] // 2)
    if status != 0:
        raise ValueError(f"apply_rotary: a position outside the cache's {cos_sin_cache.shape[0]}")
    return True


def apply_rotary(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor, force_triton: bool = False) -> None:
    """In place. query: [num_tokens, num_heads, head_dim], key: [num_tokens, num_kv_heads,
    head_dim] (views with a unit last stride are fine), positions: [num_tokens] int64;
    cos_sin_cache from rotary_cos_sin_cache. Neox style: x * cos + rotate_half(x) * sin.
    Raises ValueError on mismatched shapes."""
    if query.dim() != 3 or key.dim() != 3 or not query.shape[0] == key.shape[0] == positions.shape[0]:
        raise ValueError(
            f"apply_rotary: query {tuple(query.shape)}, key {tuple(key.shape)}, positions {tuple(positions.shape)}")
    if not query.shape[-1] == key.shape[-1] == cos_sin_cache.shape[-1]:
        raise ValueError(
            f"apply_rotary: head_dim {query.shape[-1]}, key {key.shape[-1]}, cache width {cos_sin_cache.shape[-1]}")
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("apply_rotary: query and key need a unit stride in head_dim")
    if not use_triton(query, force_triton):
        if not _rotary_cpu(query, key, positions, cos_sin_cache):
            apply_rotary_ref(query, key, positions, cos_sin_cache)
        return None
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return None
    for x, heads in ((query, num_heads), (key, key.shape[1])):
        _rotary_kernel[(num_tokens, heads)](
            x, positions, cos_sin_cache, x.stride(0), x.stride(1), cos_sin_cache.stride(0),
            HALF=head_dim // 2, BLOCK=triton.next_power_of_2(head_dim // 2),
        )
    return None


if triton is not None:

    @triton.jit
    def _rotary_kernel(x_ptr, positions_ptr, cache_ptr, stride_x_token, stride_x_head, stride_cache_pos,
                       HALF: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        pos = tl.load(positions_ptr + token)
        cos = tl.load(cache_ptr + pos * stride_cache_pos + offs, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(cache_ptr + pos * stride_cache_pos + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        base = x_ptr + token * stride_x_token + head * stride_x_head
        x1 = tl.load(base + offs, mask=mask, other=0.0)
        x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        tl.store(base + offs, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
        tl.store(base + HALF + offs, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)
