"""The plain-torch reference of every op: the test oracle of the other backends, and a correct path on
any device. Each follows transformers' Llama code's roundings (normalize in float32, cast back, then
scale; rotary products in the cache's dtype)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] -> silu(x[:, :I]) * x[:, I:], [num_tokens, intermediate]."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the inputs are not modified."""
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual


def rotary_cos_sin_cache(head_dim: int, max_position: int, base: float, rope_scaling: dict | None,
                         dtype: torch.dtype) -> torch.Tensor:
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
        # The products and sums of transformers' x * cos + rotate_half(x) * sin, without the copy.
        x1, x2 = x[..., :half], x[..., half:]
        first = x1 * cos - x2 * sin
        x2.mul_(cos).add_(x1 * sin)
        x1.copy_(first)


def write_kv_ref(key, value, kv_cache_layer, slot_mapping) -> None:
    """Each token's K and V rows into its slot (block_id * block_size + offset; -1 skips it)."""
    block_size = kv_cache_layer.shape[2]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_cache_layer[block_ids, 0, offsets] = key
    kv_cache_layer[block_ids, 1, offsets] = value


def decode_attention_ref(query, kv_cache_layer, block_tables, seq_lens, scale) -> torch.Tensor:
    """Batched decode attention: one gather of every sequence's blocks up to the longest length, a
    length mask, one SDPA call over the whole batch (the GQA group folded into SDPA's query length).
    A sequence of length 0 gets zeros."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache_layer.shape[3]
    group = num_heads // num_kv_heads
    if num_seqs == 0:
        return torch.empty_like(query)
    width = int(seq_lens.max())
    num_blocks = cdiv(max(width, 1), kv_cache_layer.shape[2])
    # NOTE: index_select with flat ids copies whole block rows (7x faster on CPU than indexing
    # the block-major cache with the 2-D table).
    block_ids = block_tables[:, :num_blocks].reshape(-1)
    key = kv_cache_layer[:, 0].index_select(0, block_ids).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    value = kv_cache_layer[:, 1].index_select(0, block_ids).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    lens = seq_lens.long().unsqueeze(1)
    mask = torch.arange(key.shape[2], device=query.device).unsqueeze(0) < lens.clamp(min=1)
    q = query.view(num_seqs, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask[:, None, None, :], scale=scale)
    out = out.reshape(num_seqs, num_heads, head_dim)
    if bool((seq_lens == 0).any()):
        out = out.masked_fill((seq_lens == 0).view(-1, 1, 1), 0.0)
    return out


def prefill_attention_ref(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale) -> torch.Tensor:
    """Each sequence's query chunk attending causally to its cached prefix and itself (its K/V
    already written): one SDPA call per sequence."""
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
        value = kv_cache_layer[:, 1].index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:seq_len]
        q = query[start:end].transpose(0, 1)
        out[start:end] = _causal_sdpa(q, key.transpose(0, 1), value.transpose(0, 1), group, scale).transpose(0, 1)
    return out


def _causal_sdpa(q, key, value, group, scale):
    """q: [heads, q_len, d] at the last q_len positions of key/value: [kv_heads, seq_len, d]."""
    q_len, seq_len = q.shape[1], key.shape[1]
    # NOTE: 4-D inputs with is_causal take SDPA's flash path on CPU (4x 3-D inputs, 3x a mask);
    # enable_gqa instead of repeating K/V: the same bits, faster.
    q, key, value = q.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    gqa = group > 1
    if q_len == seq_len:
        return F.scaled_dot_product_attention(q, key, value, is_causal=True, scale=scale, enable_gqa=gqa)[0]
    rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (seq_len - q_len)
    mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= rows
    return F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale, enable_gqa=gqa)[0]


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, cols] -> int64 [rows]: the first index of each row's maximum (or first NaN)."""
    return x.argmax(dim=-1)


def gather_blocks_ref(kv_cache, block_ids, out) -> None:
    """out[i] = kv_cache[block_ids[i]], one indexed copy."""
    out.copy_(kv_cache[block_ids.long()])


def scatter_blocks_ref(staging, kv_cache, block_ids) -> None:
    """kv_cache[block_ids[i]] = staging[i], one indexed write."""
    kv_cache[block_ids.long()] = staging


def copy_blocks_ref(kv_cache, src_block_ids, dst_block_ids) -> None:
    """kv_cache[dst[i]] = kv_cache[src[i]]; the sources are gathered first."""
    kv_cache[dst_block_ids.long()] = kv_cache[src_block_ids.long()]
