"""KV-cache write: each new token's K and V rows into its slot of one layer's paged cache."""

from __future__ import annotations

import ctypes

import torch

from kernels._cpu import KERNEL_SUFFIXES, cpu_function
from kernels._triton import tl, triton, use_triton

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_CPU_SIGNATURE = (_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _I64,
                  _I64)


def write_kv_ref(key, value, kv_cache_layer, slot_mapping) -> None:
    block_size = kv_cache_layer.shape[2]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_cache_layer[block_ids, 0, offsets] = key
    kv_cache_layer[block_ids, 1, offsets] = value


def _write_kv_cpu(key, value, kv_cache_layer, slot_mapping) -> bool:
    """The compiled CPU kernel (row copies straight into the slots) for CPU tensors all float32
    or all bfloat16; False where it does not apply (then the reference runs). Raises ValueError
    for a slot outside the cache (it writes memory directly)."""
    tensors = (key, value, kv_cache_layer)
    suffix = KERNEL_SUFFIXES.get(key.dtype)
    if suffix is None or any(t.device.type != "cpu" or t.dtype != key.dtype or t.stride(-1) != 1 for t in tensors):
        return False
    kernel = cpu_function("rotary_kv", f"write_kv_{suffix}", _CPU_SIGNATURE, ctypes.c_int)
    if kernel is None:
        return False
    slots = slot_mapping.to(torch.int64).contiguous()
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
    status = kernel(key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0), value.stride(1),
                    kv_cache_layer.data_ptr(), *kv_cache_layer.stride()[:4], num_blocks, block_size,
                    slots.data_ptr(), key.shape[0], num_kv_heads, head_dim)
    if status != 0:
        raise ValueError(f"write_kv: a slot outside the cache's {num_blocks} x {block_size}")
    return True


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache_layer: torch.Tensor,
             slot_mapping: torch.Tensor, force_triton: bool = False) -> None:
    """key, value: [num_tokens, num_kv_heads, head_dim]; kv_cache_layer: [num_blocks, 2,
    block_size, num_kv_heads, head_dim] (a strided view is fine); slot_mapping: [num_tokens]
    int64, slot = block_id * block_size + offset, -1 skips the token. Writes in place."""
    if key.shape != value.shape or slot_mapping.shape != key.shape[:1] or key.shape[1:] != kv_cache_layer.shape[3:]:
        raise ValueError(
            f"write_kv: key {tuple(key.shape)}, value {tuple(value.shape)}, slots "
            f"{tuple(slot_mapping.shape)}, cache {tuple(kv_cache_layer.shape)}"
        )
    if not use_triton(key, force_triton):
        if not _write_kv_cpu(key, value, kv_cache_layer, slot_mapping):
            write_kv_ref(key, value, kv_cache_layer, slot_mapping)
        return None
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return None
    _write_kv_kernel[(num_tokens, num_heads)](
        key, value, kv_cache_layer, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *kv_cache_layer.stride()[:4],
        BLOCK_SIZE=kv_cache_layer.shape[2], HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return None


if triton is not None:

    @triton.jit
    def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr,
                         stride_key_token, stride_key_head, stride_value_token, stride_value_head,
                         stride_cache_block, stride_cache_kv, stride_cache_offset, stride_cache_head,
                         BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1)
        slot = tl.load(slot_ptr + token)
        if slot >= 0:
            offs_d = tl.arange(0, BLOCK_D)
            mask_d = offs_d < HEAD_DIM
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            dst = (cache_ptr + block * stride_cache_block + offset * stride_cache_offset
                   + head * stride_cache_head + offs_d)
            k = tl.load(key_ptr + token * stride_key_token + head * stride_key_head + offs_d, mask=mask_d)
            v = tl.load(value_ptr + token * stride_value_token + head * stride_value_head + offs_d, mask=mask_d)
            tl.store(dst, k, mask=mask_d)
            tl.store(dst + stride_cache_kv, v, mask=mask_d)
