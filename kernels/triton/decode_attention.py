"""Paged decode attention in Triton: one query token per sequence over its block table (GQA,
split-K: each (sequence, KV head, split) program writes a partial softmax, a second kernel merges
them; with one split the program writes the output itself). The split count is planned on the
host from the batch and the table's width; each sequence's splits are cut from its own length in
the kernel (at least min_tokens_per_split, on BLOCK_N boundaries), so a wide table (a CUDA graph's,
as wide as max_model_len) with short sequences still spreads them over the splits. Shapes are
checked by the backend interface (kernels/interface.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.triton.common import LOG2E, cdiv, dot_in_fp32, tl, triton

# NOTE: split-K partitions of at least this many tokens keep each program's loop long enough
# to hide latency while still filling the GPU when only a few long sequences decode.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 32


@dataclass(frozen=True)
class Tuning:
    """The attention kernel's tile of tokens, its warps and pipeline stages, and the fewest tokens a
    split-K partition gets (the defaults are the backend's; gpu_engine's attention phase times others)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    min_tokens_per_split: int = _MIN_TOKENS_PER_SPLIT


DEFAULT_TUNING = Tuning()


def decode_attention(query, kv_cache_layer, block_tables, seq_lens, scale, num_splits: int | None = None,
                     tuning: Tuning = DEFAULT_TUNING):
    """As Backend.decode_attention; num_splits fixes the split-K partition count instead of
    sizing it to the device. seq_lens must not exceed the block table's width."""
    return _decode_triton(query, kv_cache_layer, block_tables, seq_lens, scale, num_splits, tuning)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any small number exercises the split-K path
    return torch.cuda.get_device_properties(device).multi_processor_count


def _plan_splits(num_seqs: int, num_kv_heads: int, max_len: int, device: torch.device,
                 num_splits: int | None, min_tokens: int = _MIN_TOKENS_PER_SPLIT) -> tuple[int, int]:
    """(num_splits, min_tokens_per_split): enough programs to fill the device a few times over,
    no more than the longest possible sequence gives splits of min_tokens tokens; a forced
    num_splits (tests) splits down to one token."""
    if num_splits is not None:
        return max(1, num_splits), 1
    wanted = cdiv(4 * _num_sms(device), max(1, num_seqs * num_kv_heads))
    return max(1, min(_MAX_SPLITS, wanted, cdiv(max_len, min_tokens))), min_tokens


def _decode_triton(query, kv_cache_layer, block_tables, seq_lens, scale, num_splits, tuning: Tuning):
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache_layer.shape[2], kv_cache_layer.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    block_n = tuning.block_n if query.is_cuda else 32
    # NOTE: the planned length is the block table's width, not max(seq_lens): no host sync.
    max_len = max(1, block_tables.shape[1] * block_size)
    num_splits, min_tokens_per_split = _plan_splits(num_seqs, num_kv_heads, max_len, query.device, num_splits,
                                                    tuning.min_tokens_per_split)
    single = num_splits == 1
    # One split (a batch whose sequences alone fill the device, a table of at most one split's
    # tokens, or a forced count) writes the output itself: no partials, no merge launch.
    if single:  # NOTE: placeholders the kernel never touches (a real pointer: no null in a kernel's arguments)
        partial_acc = partial_max = partial_sum = torch.empty(1, dtype=torch.float32, device=query.device)
    else:
        partial_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        partial_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
    block_d = triton.next_power_of_2(head_dim)
    _decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, kv_cache_layer, block_tables, seq_lens, partial_acc, partial_max, partial_sum, out,
        scale * LOG2E, min_tokens_per_split,
        query.stride(0), query.stride(1), *kv_cache_layer.stride()[:4], block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_GROUP=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_FP32=dot_in_fp32(query), num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )
    if single:
        return out
    _decode_reduce_kernel[(num_seqs, num_heads)](
        partial_acc, partial_max, partial_sum, out, out.stride(0), out.stride(1), num_splits,
        # NOTE: as wide as the most splits a plan gives, whatever this step's count: one compile
        BLOCK_SPLITS=triton.next_power_of_2(max(num_splits, _MAX_SPLITS)), HEAD_DIM=head_dim, BLOCK_D=block_d,
    )
    return out


if triton is not None:

    # NOTE: the table's width varies step to step: one compiled kernel for every width, not one each
    # for 1, multiples of 16 and the rest (a compile mid-serving stalls every request).
    @triton.jit(do_not_specialize=["stride_table_seq"])
    def _decode_attention_kernel(
        query_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, acc_ptr, max_ptr, sum_ptr, out_ptr,
        qk_scale, min_tokens_per_split,
        stride_query_seq, stride_query_head, stride_cache_block, stride_cache_kv, stride_cache_offset,
        stride_cache_head, stride_table_seq, stride_out_seq, stride_out_head,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
    ):
        """One (sequence, KV head, split): the GROUP query heads sharing that KV head against the
        split's tokens, BLOCK_N at a time, each token's block looked up in the block table.
        Writes the split's running max and sum (base 2) and unnormalized accumulator; with one
        split, the normalized output itself (what the merge gives one split; 0 for no tokens)."""
        # NOTE: over 40 lines because the online softmax reads best as one loop body.
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        # NOTE: the split count is the grid's, not a constexpr: one compiled kernel for every count.
        num_splits = tl.num_programs(2)
        seq_len = tl.load(seq_lens_ptr + seq)
        # This sequence's splits: its length over num_splits, at least min_tokens_per_split, whole
        # BLOCK_N steps once longer than one (the last splits of a short sequence are empty).
        tokens_per_split = tl.maximum(tl.cdiv(seq_len, num_splits), min_tokens_per_split)
        if tokens_per_split > BLOCK_N:
            tokens_per_split = tl.cdiv(tokens_per_split, BLOCK_N) * BLOCK_N
        split_start = split * tokens_per_split
        split_end = tl.minimum(split_start + tokens_per_split, seq_len)
        offs_g = tl.arange(0, BLOCK_GROUP)
        offs_d = tl.arange(0, BLOCK_D)
        mask_g = offs_g < GROUP
        mask_d = offs_d < HEAD_DIM
        heads = kv_head * GROUP + offs_g
        q = tl.load(query_ptr + seq.to(tl.int64) * stride_query_seq + heads[:, None] * stride_query_head
                    + offs_d[None, :], mask=mask_g[:, None] & mask_d[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_GROUP], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_GROUP], tl.float32)
        acc = tl.zeros([BLOCK_GROUP, BLOCK_D], tl.float32)
        table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
        head_ptr = cache_ptr + kv_head.to(tl.int64) * stride_cache_head
        for start in range(split_start, split_end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < split_end
            block_ids = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
            token_offs = block_ids * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_offset
            kv_ptrs = head_ptr + token_offs[:, None] + offs_d[None, :]
            mask_kv = mask_n[:, None] & mask_d[None, :]
            k = tl.load(kv_ptrs, mask=mask_kv, other=0.0)
            v = tl.load(kv_ptrs + stride_cache_kv, mask=mask_kv, other=0.0)
            if DOT_FP32:
                scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(mask_n[None, :], scores * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if DOT_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        # NOTE: a branch on the grid, not a constexpr: one compiled kernel for one split and for several
        if num_splits == 1:
            result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + seq.to(tl.int64) * stride_out_seq + heads[:, None] * stride_out_head + offs_d[None, :],
                     result.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
        else:
            out_offs = (seq * GROUP * tl.num_programs(1) + heads).to(tl.int64) * num_splits + split
            tl.store(max_ptr + out_offs, m_i, mask=mask_g)
            tl.store(sum_ptr + out_offs, l_i, mask=mask_g)
            tl.store(acc_ptr + out_offs[:, None] * HEAD_DIM + offs_d[None, :], acc,
                     mask=mask_g[:, None] & mask_d[None, :])

    @triton.jit(do_not_specialize=["num_splits"])
    def _decode_reduce_kernel(acc_ptr, max_ptr, sum_ptr, out_ptr, stride_out_seq, stride_out_head, num_splits,
                              BLOCK_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                              BLOCK_D: tl.constexpr):
        """One (sequence, head): merge the splits' partial softmaxes; an empty sequence gives 0."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_SPLITS)
        offs_d = tl.arange(0, BLOCK_D)
        mask_s = offs_s < num_splits
        mask_d = offs_d < HEAD_DIM
        row = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits
        m = tl.load(max_ptr + row + offs_s, mask=mask_s, other=float("-inf"))
        split_sums = tl.load(sum_ptr + row + offs_s, mask=mask_s, other=0.0)
        m_all = tl.max(m, axis=0)
        # An empty split has max -inf; where every split is empty (seq_len 0) so is m_all.
        has_tokens = m > float("-inf")
        weight = tl.where(has_tokens, tl.exp2(tl.where(has_tokens, m, 0.0) - tl.where(has_tokens, m_all, 0.0)), 0.0)
        total = tl.sum(split_sums * weight, axis=0)
        acc = tl.load(acc_ptr + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        result = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + seq.to(tl.int64) * stride_out_seq + head * stride_out_head + offs_d,
                 result.to(out_ptr.dtype.element_ty), mask=mask_d)
