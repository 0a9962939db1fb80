"""Whole-block copies of the paged cache: gather into / scatter out of a contiguous staging
buffer (for transfer layouts that need one) and block-to-block copies.

A block is everything under kv_cache[block_id] (all layers' K and V), treated as a flat run of
elements, so these work for any cache layout whose first dim is the block. The Triton kernel on CUDA
tensors (and with force_triton under TRITON_INTERPRET=1), the reference elsewhere.
"""

from __future__ import annotations

import torch

from kernels.reference.ops import copy_blocks_ref, gather_blocks_ref, scatter_blocks_ref
from kernels.triton.common import tl, triton

_CHUNK = 4096  # elements per program: 8 KiB of bf16, a few wide loads per thread


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor,
                  force_triton: bool = False) -> None:
    """out[i] = kv_cache[block_ids[i]]. kv_cache: [num_blocks, *block shape] contiguous;
    block_ids: [n] int64; out: [n, *block shape] contiguous, owned by the caller. Raises
    ValueError on mismatched shapes. Asynchronous on CUDA (stream order)."""
    _check(kv_cache, block_ids, out, "gather_blocks")
    if not (kv_cache.is_cuda or force_triton):
        return gather_blocks_ref(kv_cache, block_ids, out)
    return _launch(kv_cache, out, block_ids, None)


def scatter_blocks(staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                   force_triton: bool = False) -> None:
    """kv_cache[block_ids[i]] = staging[i]; shapes as gather_blocks, ids must be distinct."""
    _check(kv_cache, block_ids, staging, "scatter_blocks")
    if not (kv_cache.is_cuda or force_triton):
        return scatter_blocks_ref(staging, kv_cache, block_ids)
    return _launch(staging, kv_cache, None, block_ids)


def copy_blocks(kv_cache: torch.Tensor, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor,
                force_triton: bool = False) -> None:
    """kv_cache[dst[i]] = kv_cache[src[i]]; sources and destinations must not overlap (the
    Triton path reads and writes in one pass)."""
    if src_block_ids.shape != dst_block_ids.shape or src_block_ids.dim() != 1:
        raise ValueError(
            f"copy_blocks: {tuple(src_block_ids.shape)} sources, {tuple(dst_block_ids.shape)} destinations")
    if not kv_cache.is_contiguous():
        raise ValueError("copy_blocks: the cache must be contiguous")
    if not (kv_cache.is_cuda or force_triton):
        return copy_blocks_ref(kv_cache, src_block_ids, dst_block_ids)
    return _launch(kv_cache, kv_cache, src_block_ids, dst_block_ids)


def _check(kv_cache, block_ids, buffer, name) -> None:
    if not kv_cache.is_contiguous() or not buffer.is_contiguous():
        raise ValueError(f"{name}: cache and buffer must be contiguous")
    if buffer.shape[1:] != kv_cache.shape[1:] or buffer.shape[0] != block_ids.shape[0]:
        raise ValueError(
            f"{name}: buffer {tuple(buffer.shape)} vs cache {tuple(kv_cache.shape)}, {block_ids.shape[0]} ids")


def _launch(src, dst, src_ids, dst_ids) -> None:
    """Copy flat blocks from src to dst; a None id list means rows 0..n-1 on that side."""
    ids = src_ids if src_ids is not None else dst_ids
    if ids.shape[0] == 0:
        return None
    block_numel = src[0].numel()
    grid = (ids.shape[0], triton.cdiv(block_numel, _CHUNK))
    _copy_blocks_kernel[grid](
        src, dst, ids if src_ids is None else src_ids, ids if dst_ids is None else dst_ids, block_numel,
        SRC_INDEXED=src_ids is not None, DST_INDEXED=dst_ids is not None, CHUNK=_CHUNK,
    )
    return None


if triton is not None:

    @triton.jit
    def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, block_numel,
                            SRC_INDEXED: tl.constexpr, DST_INDEXED: tl.constexpr, CHUNK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        mask = offs < block_numel
        # NOTE: int64 offsets: a block-major block of a large model is ~1M elements.
        src_block = row.to(tl.int64)
        dst_block = row.to(tl.int64)
        if SRC_INDEXED:
            src_block = tl.load(src_ids_ptr + row).to(tl.int64)
        if DST_INDEXED:
            dst_block = tl.load(dst_ids_ptr + row).to(tl.int64)
        values = tl.load(src_ptr + src_block * block_numel + offs, mask=mask)
        tl.store(dst_ptr + dst_block * block_numel + offs, values, mask=mask)
