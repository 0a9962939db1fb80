"""The paged KV cache tensor: its layout and its size from a memory budget.

Shape: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim], indexed by block
everywhere. On CUDA it is stored block-major (contiguous): one block (all layers' K and V of
block_size tokens) is one region, one NIXL descriptor per block. On the CPU it is stored
layer-major (the shape above over a [num_layers, num_blocks, ...] buffer: block b's layer l at
(l * num_blocks + b) x its size), so that one layer's blocks handed out in a row (a prompt's, as
the block pool hands them out) are one run of memory for decode attention, which reads a layer's
blocks of every sequence at the memory's speed. Each (block, layer) slice stays contiguous; the
KV connectors move blocks slice by slice where a side is not block-major (kv_transfer/base.py).
Layer-major measured faster for CPU decode attention (benchmarks/kernels.py --cpu).
"""

from __future__ import annotations

import math
import os

import torch

from engine.config import CacheConfig, ModelConfig
from engine.host_memory import advise_huge_pages, zeroed_pages
from engine.tp_group import ranks_share_gpu

# NOTE: with no explicit budget, the CPU cache takes this share of the memory that is free at
# start-up, capped at 2 GiB: zero-filling the cache is start-up time (`make run` starts two nodes
# on one machine), and 2 GiB already holds ~46k tokens of SmolLM2, more than a CPU node decodes
# at once.
_CPU_MEMORY_FRACTION = 0.25
_CPU_MAX_BYTES = 2 << 30
# NOTE: on a GPU, room kept free beyond the engine's share for what is allocated after the cache
# (activations of the largest step, CUDA graphs' pool, library workspaces).
_GPU_RESERVE_FRACTION = 0.05


def block_shape(model: ModelConfig, block_size: int) -> tuple[int, ...]:
    return (model.num_layers, 2, block_size, model.num_kv_heads, model.head_dim)


def block_size_bytes(model: ModelConfig, block_size: int) -> int:
    return math.prod(block_shape(model, block_size)) * model.dtype.itemsize


def num_cache_blocks(model: ModelConfig, cache: CacheConfig, device: str, num_ranks: int = 1) -> int:
    """The block count: cache.num_blocks if set, else the memory budget over the block size (model:
    this rank's share of the model, tp_shard.local_model_config). On a GPU call it after the
    weights are loaded: the default budget is what is left of the engine's share (gpu_budget_bytes),
    per GPU. On the CPU a tensor-parallel engine's num_ranks ranks split one budget (they share
    the host's memory), so its block count is about a one-rank engine's; so do ranks sharing one
    GPU (tp_group.ranks_share_gpu)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    budget = cache.kv_cache_memory_bytes or _default_budget_bytes(device, cache.gpu_memory_utilization)
    if not device.startswith("cuda") or ranks_share_gpu():
        budget //= num_ranks
    num_blocks = budget // block_size_bytes(model, cache.block_size)
    if num_blocks < 1:
        raise ValueError(
            f"kv cache budget {budget} bytes is smaller than one block "
            f"({block_size_bytes(model, cache.block_size)} bytes)"
        )
    return int(num_blocks)


def stored_layer_major(cache: torch.Tensor) -> torch.Tensor:
    """cache's values in a cache of the same shape stored layer-major, as allocate_kv_cache stores a
    CPU one (for tests and benchmarks that fill a cache of their own)."""
    return cache.transpose(0, 1).contiguous().transpose(0, 1)


def allocate_kv_cache(model: ModelConfig, num_blocks: int, block_size: int, device: str,
                      shared_file: str | None = None, prefault: bool = True) -> torch.Tensor:
    """The zeroed cache; on the CPU layer-major (see above) on transparent huge pages where Linux
    gives them, its pages faulted in here where prefault (else by the steps that first write
    them: a page fault in one of a step's threads stalls them all at the next barrier).
    shared_file (the CPU only): the cache is that file, mapped shared and created at its size (a
    tmpfs path, /dev/shm: memory another process maps too, map_shared_kv_cache)."""
    shape = (num_blocks, *block_shape(model, block_size))
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=model.dtype, device=device)
    if shared_file is not None:
        return map_shared_kv_cache(model, num_blocks, block_size, shared_file)
    stored = zeroed_pages((shape[1], shape[0], *shape[2:]), model.dtype)  # layer-major: see above
    advise_huge_pages(stored)  # NOTE: the advice applies to pages not yet touched: all of them here
    if prefault:
        stored.zero_()
    return stored.transpose(0, 1)


def map_shared_kv_cache(model: ModelConfig, num_blocks: int, block_size: int, path: str) -> torch.Tensor:
    """The CPU cache stored in file path (layer-major, as allocate_kv_cache stores one), mapped
    shared: writes by any process that maps it are every one's. A file made here is zeros."""
    shape = (num_blocks, *block_shape(model, block_size))
    numel = math.prod(shape)
    if not os.path.exists(path):
        # NOTE: tmpfs files are sparse: a cache past the free space maps fine and dies of SIGBUS when touched.
        folder = os.statvfs(os.path.dirname(path) or ".")
        free, needed = folder.f_bavail * folder.f_frsize, numel * model.dtype.itemsize
        if needed > free:
            raise ValueError(f"a KV cache of {needed / 2**30:.2f} GiB does not fit in {os.path.dirname(path)} "
                             f"({free / 2**30:.2f} GiB free): give it more room (docker --shm-size, a memory "
                             "emptyDir on /dev/shm) or the node a smaller --kv-cache-memory-gb")
    stored = torch.from_file(path, shared=True, size=numel, dtype=model.dtype)
    return stored.view(shape[1], shape[0], *shape[2:]).transpose(0, 1)


def gpu_budget_bytes(free: int, total: int, own: int, utilization: float) -> int:
    """The KV cache's bytes on a GPU with free of total bytes free, this process holding own
    (its weights): its share (utilization of total) less what it holds, and never more than
    what is free less a reserve (other processes on the GPU hold the rest)."""
    return int(min(utilization * total - own, free - _GPU_RESERVE_FRACTION * total))


def _default_budget_bytes(device: str, utilization: float) -> int:
    if device.startswith("cuda"):
        dev = torch.device(device)
        free_bytes, total_bytes = torch.cuda.mem_get_info(dev)
        budget = gpu_budget_bytes(free_bytes, total_bytes, torch.cuda.memory_reserved(dev), utilization)
        if budget <= 0:
            held = torch.cuda.memory_reserved(dev) / 2**30
            raise ValueError(f"no GPU memory left for the KV cache: {free_bytes / 2**30:.1f} of "
                             f"{total_bytes / 2**30:.1f} GiB free, this engine's share is {utilization:.2f} of it "
                             f"(--gpu-memory-utilization) and its weights hold {held:.1f} GiB")
        return budget
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(min(available * _CPU_MEMORY_FRACTION, _CPU_MAX_BYTES))


def kv_layout_fields(model: ModelConfig, block_size: int, num_blocks: int, fingerprint: str,
                     kv_head_ranges: list[tuple[int, int]] | None = None) -> dict:
    """What a KV transfer peer must agree on, as plain fields (kv_transfer.layout.KVLayout), and
    the KV heads each tensor-parallel rank holds (which peers need not agree on)."""
    return {
        "kv_head_ranges": kv_head_ranges or [],
        "num_layers": model.num_layers,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "block_size": block_size,
        "dtype": model.dtype_name,
        "num_blocks": num_blocks,
        "model_fingerprint": fingerprint,
    }
