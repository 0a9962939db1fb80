"""Prefill / extend attention in Triton: varlen query chunks attending causally to themselves and to
the sequence's already cached paged prefix (chunked prefill, prefix caching). Everything is read from
the cache: the chunk's own K/V are written before this runs. Shapes are checked by the backend
interface (kernels/interface.py)."""

from __future__ import annotations

import torch

from kernels.triton.common import LOG2E, cdiv, dot_in_fp32, tl, triton


def prefill_attention(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale,
                      max_query_len: int | None = None):
    """As Backend.prefill_attention; max_query_len, when the caller knows it, saves a
    device-to-host sync."""
    return _prefill_triton(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale, max_query_len)


def _tile_sizes(query: torch.Tensor) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). On CUDA the sizes of Triton's fused-attention tutorial
    for Hopper, halved for float32 heads over 64 wide (their Q tile and two stages of K and V
    would take ~190 KiB of shared memory); under the interpreter small tiles so odd lengths
    cross several tiles."""
    if not query.is_cuda:
        return 16, 32, 4
    if query.shape[-1] <= 64:
        return 128, 64, 4
    return (64, 32, 4) if query.dtype == torch.float32 else (128, 64, 8)


def _prefill_triton(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale, max_query_len):
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_query_lens[1:] - cu_query_lens[:-1]).max())
    block_m, block_n, num_warps = _tile_sizes(query)
    # NOTE: a 1-D grid (the second and third axes stop at 65,535): each (sequence, head) pair's
    # query tiles side by side (they read the same K/V), the last (the longest causal) first.
    num_tiles = cdiv(max_query_len, block_m)
    _prefill_attention_kernel[(num_seqs * num_heads * num_tiles,)](
        query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, out, scale * LOG2E, num_tiles,
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

    # NOTE: the tile count and the table's width vary step to step (see _decode_attention_kernel).
    @triton.jit(do_not_specialize=["num_tiles", "stride_table_seq"])
    def _prefill_attention_kernel(
        query_ptr, cache_ptr, block_tables_ptr, cu_query_lens_ptr, seq_lens_ptr, out_ptr, qk_scale, num_tiles,
        stride_query_token, stride_query_head, stride_cache_block, stride_cache_kv, stride_cache_offset,
        stride_cache_head, stride_table_seq, stride_out_token, stride_out_head,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
    ):
        """One (query tile, sequence, head). Keys every row of the tile may see run unmasked;
        the tiles crossing the diagonal or the sequence end run masked."""
        # NOTE: over 40 lines: the prologue (tile bounds, query load) and two loops belong together.
        pair = tl.program_id(0) // num_tiles
        tile = num_tiles - 1 - tl.program_id(0) % num_tiles
        seq = pair // NUM_HEADS
        head = pair % NUM_HEADS
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
