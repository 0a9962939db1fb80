"""Rotary embedding: the cos/sin cache vs transformers (default and llama3 scaling), the
in-place reference vs transformers' apply_rotary_pos_emb and per-token math, Triton vs both."""

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tests.kernels.conftest import DEVICE, DTYPES, assert_close, gpu, randn, requires_cuda
from tests.kernels.ops import apply_rotary, apply_rotary_ref, rotary_cos_sin_cache

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def naive_rotary(x, positions, cache):
    """Per token and head: pair i with i + d/2 and rotate by angle position * freq_i, in float64."""
    half = cache.shape[-1] // 2
    out = torch.empty(x.shape, dtype=torch.float64)
    for t, pos in enumerate(positions.tolist()):
        cos, sin = cache[pos, :half].double().cpu(), cache[pos, half:].double().cpu()
        for h in range(x.shape[1]):
            x1, x2 = x[t, h, :half].double().cpu(), x[t, h, half:].double().cpu()
            out[t, h] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])
    return out


def transformers_rotary(query, key, positions, head_dim, max_position, scaling, dtype):
    rope_parameters = {**(scaling or {"rope_type": "default"}), "rope_theta": 500000.0}
    config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4,
                                      max_position_embeddings=max_position, rope_parameters=rope_parameters)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, 1, head_dim, dtype=dtype), positions.cpu().unsqueeze(0))
    # transformers' layout is [batch, heads, tokens, head_dim]
    q, k = apply_rotary_pos_emb(query.cpu().transpose(0, 1)[None], key.cpu().transpose(0, 1)[None], cos, sin)
    return q[0].transpose(0, 1), k[0].transpose(0, 1)


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_cos_sin_cache_matches_transformers(scaling):
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=128,
                                      rope_parameters={**(scaling or {"rope_type": "default"}), "rope_theta": 500000.0})
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, 128, 64), torch.arange(128).unsqueeze(0))
    cache = rotary_cos_sin_cache(64, 128, 500000.0, scaling, torch.float32)
    assert cache.shape == (128, 64)
    assert torch.equal(cache[:, :32], cos[0, :, :32]) and torch.equal(cache[:, 32:], sin[0, :, :32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_rotary_ref_equals_transformers_bit_for_bit(dtype, scaling):
    query, key = randn(9, 6, 64, dtype=dtype), randn(9, 2, 64, dtype=dtype, seed=1)
    positions = torch.tensor([0, 1, 5, 15, 16, 17, 100, 300, 511], device=DEVICE)
    want_q, want_k = transformers_rotary(query, key, positions, 64, 512, scaling, dtype)
    cache = rotary_cos_sin_cache(64, 512, 500000.0, scaling, dtype).to(DEVICE)
    apply_rotary_ref(query, key, positions, cache)
    assert torch.equal(query.cpu(), want_q) and torch.equal(key.cpu(), want_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
def test_rotary_ref_and_triton_match_per_token_math(dtype, head_dim):
    cache = rotary_cos_sin_cache(head_dim, 512, 10000.0, None, dtype).to(DEVICE)
    query, key = randn(9, 8, head_dim, dtype=dtype), randn(9, 2, head_dim, dtype=dtype, seed=1)
    positions = torch.tensor([0, 1, 5, 15, 16, 17, 100, 300, 511], device=DEVICE)
    want_q, want_k = naive_rotary(query, positions, cache), naive_rotary(key, positions, cache)
    for force_triton in (False, True):
        q, k = query.clone(), key.clone()
        if force_triton:
            apply_rotary(q, k, positions, cache, force_triton=True)
        else:
            apply_rotary_ref(q, k, positions, cache)
        assert_close(q, want_q, dtype)
        assert_close(k, want_k, dtype)


@pytest.mark.parametrize("force_triton", [False, True])
def test_rotary_writes_through_strided_views_of_a_fused_qkv(force_triton):
    qkv = randn(5, (4 + 2 + 2) * 32)
    value_before = qkv[:, 192:].clone()
    query, key, _ = qkv.split([128, 64, 64], dim=-1)
    query, key = query.view(5, 4, 32), key.view(5, 2, 32)
    cache = rotary_cos_sin_cache(32, 64, 10000.0, None, torch.float32).to(DEVICE)
    positions = torch.tensor([3, 0, 7, 63, 8], device=DEVICE)
    want_q, want_k = naive_rotary(query, positions, cache), naive_rotary(key, positions, cache)
    apply_rotary(query, key, positions, cache, force_triton=force_triton)
    assert_close(qkv[:, :128].view(5, 4, 32), want_q, torch.float32)
    assert_close(qkv[:, 128:192].view(5, 2, 32), want_k, torch.float32)
    assert torch.equal(qkv[:, 192:], value_before)


def test_rotary_rejects_unknown_type_and_mismatched_shapes():
    with pytest.raises(ValueError, match="yarn"):
        rotary_cos_sin_cache(64, 16, 10000.0, {"rope_type": "yarn"}, torch.float32)
    cache = rotary_cos_sin_cache(32, 16, 10000.0, {"rope_type": "default"}, torch.float32).to(DEVICE)
    with pytest.raises(ValueError, match="apply_rotary"):
        apply_rotary(randn(3, 4, 32), randn(2, 2, 32), torch.zeros(3, dtype=torch.long, device=DEVICE), cache)
    with pytest.raises(ValueError, match="apply_rotary"):
        apply_rotary(randn(3, 4, 32), randn(3, 2, 32), torch.zeros(2, dtype=torch.long, device=DEVICE), cache)


@gpu
@requires_cuda
def test_rotary_cuda_many_tokens():
    scaling = {**LLAMA3, "original_max_position_embeddings": 8192}
    cache = rotary_cos_sin_cache(128, 8192, 500000.0, scaling, torch.bfloat16).cuda()
    query, key = randn(3000, 32, 128, dtype=torch.bfloat16), randn(3000, 8, 128, dtype=torch.bfloat16, seed=1)
    positions = torch.randint(0, 8192, (3000,), device="cuda")
    q_ref, k_ref = query.clone(), key.clone()
    apply_rotary_ref(q_ref, k_ref, positions, cache)
    apply_rotary(query, key, positions, cache)
    assert_close(query, q_ref, torch.bfloat16)
    assert_close(key, k_ref, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, LLAMA3])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
def test_compiled_cpu_rotary_equals_transformers_bit_for_bit(scaling, head_dim, dtype):
    """The C kernel (float32 and bfloat16 on the CPU) rounds each product and sum as transformers
    does: bit-equal, through strided views of a fused qkv row as the model passes them."""
    num_heads, num_kv_heads, num_tokens = 6, 2, 37
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, seed=11).cpu().to(dtype)
    query, key, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    query, key = query.view(num_tokens, num_heads, head_dim), key.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 512, (num_tokens,), generator=torch.Generator().manual_seed(12))
    want_q, want_k = transformers_rotary(query, key, positions, head_dim, 512, scaling, dtype)
    cache = rotary_cos_sin_cache(head_dim, 512, 500000.0, scaling, dtype)
    apply_rotary(query, key, positions, cache)
    assert torch.equal(query, want_q) and torch.equal(key, want_k)


def test_compiled_cpu_rotary_refuses_a_position_outside_the_cache():
    cache = rotary_cos_sin_cache(32, 16, 10000.0, None, torch.float32)
    query, key = torch.randn(2, 4, 32), torch.randn(2, 2, 32)
    before = query.clone()
    with pytest.raises(ValueError, match="position"):
        apply_rotary(query, key, torch.tensor([3, 16]), cache)
    assert torch.equal(query, before)  # nothing changed
