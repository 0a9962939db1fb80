"""The compiled CPU kernels' row-wise ops and attention, on CPU tensors, through the typed boundary
(kernels/cpu/native.py). Each returns None (or False) where its kernel does not take the tensors
(another dtype, a stride, sizes without a path): the CPU backend then runs the reference."""

from __future__ import annotations

import torch

from kernels.cpu.native import NativeLibrary
from kernels.errors import KernelRangeError
from kernels.reference.ops import cdiv

SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def row_suffix(*tensors: torch.Tensor) -> str | None:
    """"f32" or "bf16" where all are CPU 2-D rows of that dtype with a unit stride along the row."""
    suffix = SUFFIXES.get(tensors[0].dtype) if tensors else None
    if suffix is None:
        return None
    dtype = tensors[0].dtype
    if all(t.is_cpu and t.dtype == dtype and t.dim() == 2 and t.stride(1) == 1 for t in tensors):
        return suffix
    return None


def argmax_rows(lib: NativeLibrary, x: torch.Tensor) -> torch.Tensor | None:
    suffix = row_suffix(x)
    if suffix is None or x.shape[1] == 0:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        getattr(lib, f"argmax_rows_{suffix}")(x, x.stride(0), x.shape[0], x.shape[1], out)
    return out


def silu_and_mul(lib: NativeLibrary, x: torch.Tensor) -> torch.Tensor | None:
    suffix = row_suffix(x)
    if suffix is None:
        return None
    num_rows, half = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, half, dtype=x.dtype)
    getattr(lib, f"silu_and_mul_{suffix}")(x, x.stride(0), out, out.stride(0), num_rows, half)
    return out


def add_rms_norm(lib: NativeLibrary, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(out, new residual); without a residual (out, x)."""
    tensors = (x, weight.view(1, -1)) + ((residual,) if residual is not None else ())
    suffix = row_suffix(*tensors)
    if suffix is None or not weight.is_contiguous():
        return None
    num_rows, hidden = x.shape
    out = torch.empty(num_rows, hidden, dtype=x.dtype)
    new_residual = torch.empty(num_rows, hidden, dtype=x.dtype) if residual is not None else x
    getattr(lib, f"add_rms_norm_{suffix}")(
        x, x.stride(0), residual, residual.stride(0) if residual is not None else 0, weight, out, out.stride(0),
        new_residual, new_residual.stride(0), num_rows, hidden, eps)
    return out, new_residual


def apply_rotary(lib: NativeLibrary, query, key, positions, cos_sin_cache) -> bool:
    """In place; False where the kernel does not take them. Raises KernelRangeError for a position
    outside the cache."""
    suffix = SUFFIXES.get(query.dtype)
    if suffix is None or any(not t.is_cpu or t.dtype != query.dtype for t in (query, key, cos_sin_cache)):
        return False
    if cos_sin_cache.stride(-1) != 1:
        return False
    positions = positions.to(torch.int64).contiguous()
    try:
        getattr(lib, f"rotary_{suffix}")(
            query, query.stride(0), query.stride(1), query.shape[1], key, key.stride(0), key.stride(1), key.shape[1],
            positions, cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.shape[0], query.shape[0],
            query.shape[-1] // 2)
    except KernelRangeError as exc:
        raise KernelRangeError(exc.entry, f"a position outside the cache's {cos_sin_cache.shape[0]}") from None
    return True


def write_kv(lib: NativeLibrary, key, value, kv_cache_layer, slot_mapping) -> bool:
    """Row copies straight into the slots; False where the kernel does not take them. Raises
    KernelRangeError for a slot outside the cache."""
    suffix = SUFFIXES.get(key.dtype)
    tensors = (key, value, kv_cache_layer)
    if suffix is None or any(not t.is_cpu or t.dtype != key.dtype or t.stride(-1) != 1 for t in tensors):
        return False
    slots = slot_mapping.to(torch.int64).contiguous()
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
    try:
        getattr(lib, f"write_kv_{suffix}")(
            key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1), kv_cache_layer,
            *kv_cache_layer.stride()[:4], num_blocks, block_size, slots, key.shape[0], num_kv_heads, head_dim)
    except KernelRangeError as exc:
        raise KernelRangeError(exc.entry, f"a slot outside the cache's {num_blocks} x {block_size}") from None
    return True


def decode_attention(lib: NativeLibrary, query, kv_cache_layer, block_tables, seq_lens, scale,
                     memo: BoundsMemo | None = None) -> torch.Tensor | None:
    """Reads the blocks in place (a bfloat16 cache widened as it is read, sums in float32); None
    where it has no path. Raises ValueError for a length past its block table or a block id outside
    the cache (it reads memory directly)."""
    dtype = query.dtype
    if not query.is_cpu or dtype not in SUFFIXES or kv_cache_layer.dtype != dtype:
        return None
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, _, block_size, num_kv_heads, _ = kv_cache_layer.shape
    kv_bf16 = int(dtype == torch.bfloat16)
    if kv_cache_layer.stride(-1) != 1 or not lib.paged_decode_attention_takes(num_heads, head_dim, block_size, kv_bf16):
        return None
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=dtype)
    if num_seqs == 0:
        return out
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    check_bounds(tables, lens, num_blocks, block_size, memo)
    lib.paged_decode_attention(
        query, query.stride(0), query.stride(1), kv_cache_layer, *kv_cache_layer.stride()[:4], tables,
        tables.stride(0), lens, out, out.stride(0), out.stride(1), num_seqs, num_kv_heads, num_heads // num_kv_heads,
        head_dim, block_size, scale, kv_bf16)
    return out


class BoundsMemo:
    """The last block-table and length tensors that passed check_bounds, with torch's version
    counters: the model calls attention once per layer with the same pair, checked once. One per
    backend (and so per engine)."""

    def __init__(self) -> None:
        self.last: tuple | None = None


def check_bounds(tables: torch.Tensor, lens: torch.Tensor, num_blocks: int, block_size: int,
                 memo: BoundsMemo | None = None) -> None:
    """Raises ValueError for a length past the table's width or a block id outside [0, num_blocks)."""
    versions = (tables._version, lens._version, num_blocks, block_size)
    last = memo.last if memo is not None else None
    if last is not None and last[0] is tables and last[1] is lens and last[2] == versions:
        return
    longest = int(lens.max())
    if longest > tables.shape[1] * block_size or int(lens.min()) < 0:
        raise ValueError(f"decode_attention: seq_lens up to {longest} for block tables of width {tables.shape[1]}")
    used = tables[:, :cdiv(longest, block_size)]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        raise ValueError(f"decode_attention: block ids outside [0, {num_blocks})")
    if memo is not None:
        memo.last = (tables, lens, versions)


def prefill_kernel(lib: NativeLibrary, dtype: torch.dtype, head_dim: int) -> str | None:
    """The prefill attention entry this build takes for dtype and head_dim: AMX for bfloat16 heads
    of a multiple of 32 up to 128, else the AVX-512 kernels (head_dim a multiple of 16 up to 256)."""
    if dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 128 and _ready(lib, "amx_attention"):
        return "amx_prefill_attention_bf16"
    if dtype in SUFFIXES and head_dim % 16 == 0 and head_dim <= 256 and _ready(lib, "prefill_attention_f32"):
        name = f"prefill_attention_{SUFFIXES[dtype]}"
        return name if lib.has(name) else None
    return None


def _ready(lib: NativeLibrary, library: str) -> bool:
    return lib.has(f"{library}_ready") and bool(getattr(lib, f"{library}_ready")())


def prefill_attention(lib: NativeLibrary, query, kv_cache_layer, block_tables, cu_query_lens, seq_lens,
                      scale) -> torch.Tensor | None:
    """None where no compiled kernel takes it (then the reference). Raises ValueError for chunks,
    lengths or block ids out of range (it reads memory directly)."""
    if query.device.type != "cpu" or kv_cache_layer.dtype != query.dtype or kv_cache_layer.stride(-1) != 1:
        return None
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
    name = prefill_kernel(lib, query.dtype, head_dim)
    if name is None or block_size % 16:
        return None
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype)
    num_seqs = seq_lens.shape[0]
    if query.shape[0] == 0 or num_seqs == 0:
        return out
    tables = block_tables.to(torch.int32).contiguous()
    cu = cu_query_lens.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    getattr(lib, name)(
        query, query.stride(0), query.stride(1), kv_cache_layer, *kv_cache_layer.stride()[:4], num_blocks, block_size,
        tables, tables.stride(0), tables.shape[1], cu, lens, num_seqs, query.shape[0], query.shape[1], num_kv_heads,
        head_dim, scale, out, out.stride(0), out.stride(1))
    return out
