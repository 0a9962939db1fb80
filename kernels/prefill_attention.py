"""Prefill / extend attention: varlen query chunks attending causally to themselves and to the
sequence's already cached paged prefix (chunked prefill, prefix caching).

Everything is read from the cache: the chunk's own K/V are written before this runs.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from kernels._cpu import cpu_function
from kernels._triton import LOG2E, cdiv, dot_in_fp32, tl, triton, use_triton


def prefill_attention_ref(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale) -> torch.Tensor:
    out = torch.empty_like(query)
    block_size, num_kv_heads, head_dim = kv_cache_layer.shape[2:]
    group = query.shape[1] // num_kv_heads
    bounds = cu_query_lens.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        start, end = bounds[seq], bounds[seq + 1]
        if end == start:
            continue
        block_ids = block_tables[seq, : cdiv(seq_len, block_size)]
        key = kv_cache_layer[:, 0].index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:seq_len]
        key = key.transpose(0, 1)
        value = kv_cache_layer[:, 1].index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:seq_len]
        value = value.transpose(0, 1)
        q = query[start:end].transpose(0, 1)
        out[start:end] = _causal_sdpa(q, key, value, group, scale).transpose(0, 1)
    return out


def _causal_sdpa(q, key, value, group, scale):
    """q: [heads, q_len, d] at the last q_len positions of key/value: [kv_heads, seq_len, d]."""
    q_len, seq_len = q.shape[1], key.shape[1]
    # NOTE: 4-D inputs and is_causal take SDPA's flash path on CPU: measured 4x faster than
    # 3-D inputs and 3x faster than an explicit mask for a 256-token prompt. enable_gqa instead
    # of repeating K/V per query head: the same bits, 3-12% faster (9 heads over 3, 256 tokens).
    q, key, value = q.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    gqa = group > 1
    if q_len == seq_len:
        return F.scaled_dot_product_attention(q, key, value, is_causal=True, scale=scale, enable_gqa=gqa)[0]
    rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (seq_len - q_len)
    mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= rows
    return F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale, enable_gqa=gqa)[0]


def prefill_attention(query: torch.Tensor, kv_cache_layer: torch.Tensor, block_tables: torch.Tensor,
                      cu_query_lens: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                      force_triton: bool = False, max_query_len: int | None = None) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim]; kv_cache_layer: [num_blocks, 2, block_size,
    num_kv_heads, head_dim] (strided view); block_tables: [num_seqs, max_blocks] int32;
    cu_query_lens: [num_seqs + 1] int32; seq_lens: [num_seqs] int32. Sequence b's queries are
    query[cu_query_lens[b]:cu_query_lens[b+1]] at positions seq_lens[b] - q_len .. seq_lens[b] - 1,
    each attending to cache positions 0..its own (the chunk's K/V already written). Returns
    [num_tokens, num_heads, head_dim]; raises ValueError on mismatched shapes. max_query_len
    (Triton only), when the caller knows it, saves a device-to-host sync."""
    if query.dim() != 3 or query.shape[-1] != kv_cache_layer.shape[-1] or query.shape[1] % kv_cache_layer.shape[3]:
        raise ValueError(f"prefill_attention: query {tuple(query.shape)}, cache {tuple(kv_cache_layer.shape)}")
    if cu_query_lens.shape[0] != seq_lens.shape[0] + 1 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"prefill_attention: cu_query_lens {tuple(cu_query_lens.shape)}, seq_lens {tuple(seq_lens.shape)}, "
            f"block tables {tuple(block_tables.shape)}"
        )
    if not use_triton(query, force_triton):
        out = prefill_attention_cpu(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale)
        if out is None:
            return prefill_attention_ref(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale)
        return out
    return _prefill_triton(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale, max_query_len)


def prefill_attention_cpu(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale) -> torch.Tensor | None:
    """A compiled CPU kernel where one applies, else None: bfloat16 on AMX (csrc/amx_attention.c;
    head_dim a multiple of 32 up to 128), float32 and (without AMX) bfloat16 on AVX-512
    (csrc/prefill_attention_f32.c; head_dim a multiple of 16 up to 256); query and cache of one
    dtype, blocks a multiple of 16 tokens. Raises ValueError for chunks, lengths or block ids out
    of range (it reads memory directly)."""
    if query.device.type != "cpu" or kv_cache_layer.dtype != query.dtype or kv_cache_layer.stride(-1) != 1:
        return None
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
    kernel = None
    if query.dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 128:
        kernel = _amx_kernel()
    if kernel is None and query.dtype in (torch.float32, torch.bfloat16) and head_dim % 16 == 0 and head_dim <= 256:
        kernel = _f32_kernel() if query.dtype == torch.float32 else _avx512_bf16_kernel()
    if kernel is None or block_size % 16:
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
    status = kernel(
        query.data_ptr(), query.stride(0), query.stride(1), kv_cache_layer.data_ptr(), *kv_cache_layer.stride()[:4],
        num_blocks, block_size, tables.data_ptr(), tables.stride(0), tables.shape[1], cu.data_ptr(), lens.data_ptr(),
        num_seqs, query.shape[0], query.shape[1], num_kv_heads, head_dim, scale, out.data_ptr(), out.stride(0),
        out.stride(1),
    )
    if status == 1:
        raise ValueError("prefill_attention: chunk lengths, sequence lengths or block ids out of range")
    if status != 0:
        raise MemoryError("prefill_attention: the CPU kernel could not allocate its buffers")
    return out


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_CPU_SIGNATURE = (_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64,
                  _I64, _I64, _I64, _I64, ctypes.c_float, _PTR, _I64, _I64)


@functools.cache
def _cpu_kernel(library: str, ready: str, name: str):
    """Function name of the compiled kernels/csrc/<library>.c, or None where the library is
    unavailable or its ready() says the kernel cannot run here."""
    can_run = cpu_function(library, ready, (), ctypes.c_int)
    if can_run is None or not can_run():
        return None
    return cpu_function(library, name, _CPU_SIGNATURE, ctypes.c_int)


def _amx_kernel():
    return _cpu_kernel("amx_attention", "amx_attention_ready", "amx_prefill_attention_bf16")


def _f32_kernel():
    return _cpu_kernel("prefill_attention_f32", "prefill_attention_f32_ready", "prefill_attention_f32")


def _avx512_bf16_kernel():
    """The float32 kernel's bfloat16 entry (K/V widened per block), for CPUs without AMX."""
    return _cpu_kernel("prefill_attention_f32", "prefill_attention_f32_ready", "prefill_attention_bf16")


def _tile_sizes(query: torch.Tensor) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). On CUDA the sizes of Triton's fused-attention tutorial
    for Hopper; under the interpreter small tiles so odd lengths cross several tiles."""
    if not query.is_cuda:
        return 16, 32, 4
    return 128, 64, 8 if query.shape[-1] > 64 else 4


def _prefill_triton(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale, max_query_len):
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_query_lens[1:] - cu_query_lens[:-1]).max())
    block_m, block_n, num_warps = _tile_sizes(query)
    grid = (cdiv(max_query_len, block_m), num_seqs * num_heads)
    _prefill_attention_kernel[grid](
        query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, out, scale * LOG2E,
        query.stride(0), query.stride(1), *kv_cache_layer.stride()[:4], block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, GROUP=num_heads // kv_cache_layer.shape[3], HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache_layer.shape[2], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim), DOT_FP32=dot_in_fp32(query), num_warps=num_warps, num_stages=2,
    )
    return out


if triton is not None:

    @triton.jit
    def _attend_tile(q, m_i, l_i, acc, table_ptr, head_ptr, start, seq_len, positions, qk_scale,
                     stride_cache_block, stride_cache_kv, stride_cache_offset,
                     BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                     IS_DIAGONAL: tl.constexpr, DOT_FP32: tl.constexpr):
        """Fold keys start..start+BLOCK_N-1 (each token's block looked up in the block table) into
        the running (max, sum, accumulator); only diagonal tiles need the causal and length mask."""
        offs_n = start + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_n = offs_n < seq_len
        if not IS_DIAGONAL:
            mask_n = offs_n >= 0  # every key of a full tile is inside the sequence
        block_ids = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        token_offs = block_ids * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_offset
        kv_ptrs = head_ptr + token_offs[:, None] + offs_d[None, :]
        mask_kv = mask_n[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(kv_ptrs, mask=mask_kv, other=0.0)
        v = tl.load(kv_ptrs + stride_cache_kv, mask=mask_kv, other=0.0)
        if DOT_FP32:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * qk_scale
        else:
            scores = tl.dot(q, tl.trans(k)) * qk_scale
        if IS_DIAGONAL:
            allowed = (offs_n[None, :] <= positions[:, None]) & mask_n[None, :]
            scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row can see no key in a diagonal tile; keep its exponents finite.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _prefill_attention_kernel(
        query_ptr, cache_ptr, block_tables_ptr, cu_query_lens_ptr, seq_lens_ptr, out_ptr, qk_scale,
        stride_query_token, stride_query_head, stride_cache_block, stride_cache_kv, stride_cache_offset,
        stride_cache_head, stride_table_seq, stride_out_token, stride_out_head,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
    ):
        """One (query tile, sequence, head). Keys every row of the tile may see run unmasked;
        the tiles crossing the diagonal or the sequence end run masked."""
        # NOTE: over 40 lines: the prologue (tile bounds, query load) and two loops belong together.
        tile = tl.program_id(0)
        seq = tl.program_id(1) // NUM_HEADS
        head = tl.program_id(1) % NUM_HEADS
        q_start = tl.load(cu_query_lens_ptr + seq)
        q_len = tl.load(cu_query_lens_ptr + seq + 1) - q_start
        if tile * BLOCK_M < q_len:
            seq_len = tl.load(seq_lens_ptr + seq)
            first_pos = seq_len - q_len + tile * BLOCK_M
            offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, BLOCK_D)
            mask_m = offs_m < q_len
            mask_d = offs_d < HEAD_DIM
            rows = (q_start + offs_m).to(tl.int64)
            q = tl.load(query_ptr + rows[:, None] * stride_query_token + head * stride_query_head + offs_d[None, :],
                        mask=mask_m[:, None] & mask_d[None, :], other=0.0)
            if DOT_FP32:
                q = q.to(tl.float32)
            positions = first_pos + tl.arange(0, BLOCK_M)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
            head_ptr = cache_ptr + (head // GROUP).to(tl.int64) * stride_cache_head
            # Keys 0..first_pos are visible to every row of the tile.
            full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
            for start in range(0, full_end, BLOCK_N):
                m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, table_ptr, head_ptr, start, seq_len, positions,
                                             qk_scale, stride_cache_block, stride_cache_kv, stride_cache_offset,
                                             BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, False, DOT_FP32)
            tile_end = tl.minimum(first_pos + BLOCK_M, seq_len)
            for start in range(full_end, tile_end, BLOCK_N):
                m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, table_ptr, head_ptr, start, seq_len, positions,
                                             qk_scale, stride_cache_block, stride_cache_kv, stride_cache_offset,
                                             BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, True, DOT_FP32)
            result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + rows[:, None] * stride_out_token + head * stride_out_head + offs_d[None, :],
                     result.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
