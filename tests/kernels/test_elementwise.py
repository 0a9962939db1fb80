"""RMSNorm (with fused residual), rotary embedding, SiLU-and-mul: reference vs naive math,
Triton vs reference (on CPU under TRITON_INTERPRET=1, on CUDA when present)."""

import pytest
import torch
import transformers

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.rms_norm import add_rms_norm, rms_norm, rms_norm_ref
from kernels.rotary import apply_rotary, apply_rotary_ref, rotary_cos_sin_cache
from tests.kernels.conftest import DTYPES, assert_close, randn

SHAPES = [(1, 64), (7, 96), (33, 256)]


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_ref_matches_transformers_rmsnorm(shape):
    x, weight = randn(*shape), randn(shape[1], seed=1)
    hf = transformers.models.llama.modeling_llama.LlamaRMSNorm(shape[1], eps=1e-5)
    hf.weight.data.copy_(weight.cpu())
    torch.testing.assert_close(rms_norm_ref(x, weight, 1e-5).cpu(), hf(x.cpu()), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_triton_matches_reference(shape, dtype):
    x, residual, weight = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype, seed=1), randn(shape[1], dtype=dtype, seed=2)
    assert_close(rms_norm(x, weight, 1e-6, force_triton=True), rms_norm_ref(x, weight, 1e-6), dtype)
    out, new_residual = add_rms_norm(x, residual, weight, 1e-6, force_triton=True)
    assert_close(new_residual, x + residual, dtype)
    assert_close(out, rms_norm_ref(x + residual, weight, 1e-6), dtype)


def test_rms_norm_empty_batch():
    x, weight = randn(0, 64), randn(64)
    assert rms_norm(x, weight, 1e-6, force_triton=True).shape == (0, 64)


def naive_rotary(x, positions, cache):
    half = cache.shape[-1] // 2
    cos = torch.cat([cache[positions, :half]] * 2, -1).unsqueeze(1)
    sin = torch.cat([cache[positions, half:]] * 2, -1).unsqueeze(1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 80])
def test_rotary_reference_and_triton(dtype, head_dim):
    cache = rotary_cos_sin_cache(head_dim, 512, 10000.0, None, torch.float32).to(dtype=dtype, device=randn(1).device)
    query, key = randn(9, 8, head_dim, dtype=dtype), randn(9, 2, head_dim, dtype=dtype, seed=1)
    positions = torch.tensor([0, 1, 5, 15, 16, 17, 100, 300, 511], device=query.device)
    want_q, want_k = naive_rotary(query, positions, cache), naive_rotary(key, positions, cache)
    q_ref, k_ref = query.clone(), key.clone()
    apply_rotary_ref(q_ref, k_ref, positions, cache)
    assert_close(q_ref, want_q, dtype)
    assert_close(k_ref, want_k, dtype)
    q_tri, k_tri = query.clone(), key.clone()
    apply_rotary(q_tri, k_tri, positions, cache, force_triton=True)
    assert_close(q_tri, want_q, dtype)
    assert_close(k_tri, want_k, dtype)


def test_rotary_on_strided_views_of_a_fused_qkv():
    qkv = randn(5, (4 + 2 + 2) * 32)
    query, key, _ = qkv.split([128, 64, 64], dim=-1)
    query, key = query.view(5, 4, 32), key.view(5, 2, 32)
    cache = rotary_cos_sin_cache(32, 64, 10000.0, None, torch.float32).to(qkv.device)
    positions = torch.arange(5, device=qkv.device)
    want_q = naive_rotary(query.clone(), positions, cache)
    apply_rotary(query, key, positions, cache, force_triton=True)
    assert_close(qkv[:, :128].view(5, 4, 32), want_q, torch.float32)


@pytest.mark.parametrize("rope_type", ["default", "llama3"])
def test_rotary_cache_matches_transformers_inv_freq(rope_type):
    scaling = None
    kwargs = {}
    if rope_type == "llama3":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
        kwargs["rope_parameters"] = {**scaling, "rope_theta": 500000.0}
    else:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=128, **kwargs)
    rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.arange(128).unsqueeze(0)
    cos, sin = rope(torch.zeros(1, 128, 64), positions)
    cache = rotary_cos_sin_cache(64, 128, 500000.0, scaling, torch.float32)
    torch.testing.assert_close(cache[:, :32], cos[0, :, :32], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache[:, 32:], sin[0, :, :32], atol=1e-6, rtol=1e-6)


def test_rotary_unknown_type_raises():
    with pytest.raises(ValueError, match="rope_type"):
        rotary_cos_sin_cache(64, 16, 10000.0, {"rope_type": "yarn"}, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, intermediate", [(1, 64), (5, 96), (17, 1500)])
def test_silu_and_mul(num_tokens, intermediate, dtype):
    x = randn(num_tokens, 2 * intermediate, dtype=dtype)
    naive = (x[:, :intermediate].float() * torch.sigmoid(x[:, :intermediate].float()) * x[:, intermediate:].float())
    assert_close(silu_and_mul_ref(x), naive, dtype)
    assert_close(silu_and_mul(x, force_triton=True), naive, dtype)
