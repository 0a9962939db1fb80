"""KV-cache write into one layer's strided view of the block-major cache: reference and Triton
vs a per-token loop; slot -1 skips; other layers and blocks stay untouched."""

import pytest
import torch

from tests.kernels.conftest import BLOCK_SIZE, DEVICE, DTYPES, gpu, make_cache, randn, requires_cuda
from tests.kernels.ops import write_kv, write_kv_ref


def naive_write(cache, layer, key, value, slots):
    want = cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[slot // BLOCK_SIZE, layer, 0, slot % BLOCK_SIZE] = key[t]
            want[slot // BLOCK_SIZE, layer, 1, slot % BLOCK_SIZE] = value[t]
    return want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("force_triton", [False, True])
def test_write_kv_matches_per_token_loop_and_skips_negative_slots(dtype, force_triton):
    cache = make_cache(2, 32, dtype)
    key, value = randn(6, 2, 32, dtype=dtype, seed=8), randn(6, 2, 32, dtype=dtype, seed=9)
    slots = torch.tensor([0, 17, -1, 5 * BLOCK_SIZE + 15, 39 * BLOCK_SIZE, 3], device=DEVICE)
    want = naive_write(cache, 1, key, value, slots)
    write_kv(key, value, cache[:, 1], slots, force_triton=force_triton)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("force_triton", [False, True])
def test_write_kv_from_strided_views_of_a_fused_qkv(force_triton):
    qkv = randn(4, (4 + 2 + 2) * 32)
    _, key, value = qkv.split([128, 64, 64], dim=-1)
    key, value = key.view(4, 2, 32), value.view(4, 2, 32)
    cache = make_cache(2, 32)
    slots = torch.tensor([33, 34, 35, 36], device=DEVICE)
    want = naive_write(cache, 0, key, value, slots)
    write_kv(key, value, cache[:, 0], slots, force_triton=force_triton)
    assert torch.equal(cache, want)


def test_write_kv_all_skipped_and_empty():
    cache = make_cache(2, 32)
    before = cache.clone()
    for force_triton in (False, True):
        skipped, no_slots = torch.tensor([-1, -1], device=DEVICE), torch.zeros(0, dtype=torch.long, device=DEVICE)
        write_kv(randn(2, 2, 32), randn(2, 2, 32), cache[:, 0], skipped, force_triton=force_triton)
        write_kv(randn(0, 2, 32), randn(0, 2, 32), cache[:, 0], no_slots, force_triton=force_triton)
    assert torch.equal(cache, before)


def test_write_kv_rejects_mismatched_shapes():
    layer = make_cache(2, 32)[:, 0]
    slots = torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"write_kv: key \(3, 2, 32\), value \(3, 2, 16\)"):
        write_kv(randn(3, 2, 32), randn(3, 2, 16), layer, slots)
    with pytest.raises(ValueError, match="write_kv"):
        write_kv(randn(3, 4, 32), randn(3, 4, 32), layer, slots)
    with pytest.raises(ValueError, match="write_kv"):
        write_kv(randn(2, 2, 32), randn(2, 2, 32), layer, slots)


@gpu
@requires_cuda
def test_write_kv_cuda_large_batch():
    cache = make_cache(8, 128, torch.bfloat16, num_blocks=512)
    slots = torch.randperm(512 * BLOCK_SIZE, device="cuda")[:4000]
    key, value = randn(4000, 8, 128, dtype=torch.bfloat16), randn(4000, 8, 128, dtype=torch.bfloat16, seed=1)
    want = cache.clone()
    write_kv_ref(key, value, want[:, 1], slots)
    write_kv(key, value, cache[:, 1], slots)
    assert torch.equal(cache, want)


def test_compiled_cpu_write_refuses_a_slot_outside_the_cache():
    cache = make_cache(2, 32).cpu()
    before = cache.clone()
    key, value = torch.randn(2, 2, 32), torch.randn(2, 2, 32)
    with pytest.raises(ValueError, match="slot"):
        write_kv(key, value, cache[:, 0], torch.tensor([1, cache.shape[0] * BLOCK_SIZE]))
    assert torch.equal(cache, before)  # nothing written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_write_in_groups_of_heads_equal_the_reference(dtype):
    """The Triton rotary-and-write kernel takes a token's heads 16 at a time: with 32 query heads and
    8 KV heads (Llama-3's 1B and 8B) a token's heads span three programs, the last half empty; each
    query and key head rotated as the reference does, keys and values written, slot -1 skipped, from
    strided views of a fused QKV output."""
    from kernels.reference.backend import ReferenceBackend
    from kernels.reference.ops import rotary_cos_sin_cache
    from kernels.triton.backend import TritonBackend

    heads, kv_heads, head_dim, tokens = 32, 8, 32, 3
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=4)
    cos_sin = rotary_cos_sin_cache(head_dim, 64, 10000.0, None, torch.float32).to(dtype=dtype, device=DEVICE)
    positions, slots = torch.tensor([0, 9, 63], device=DEVICE), torch.tensor([17, -1, 40], device=DEVICE)
    results = []
    for backend in (TritonBackend(DEVICE), ReferenceBackend(DEVICE)):
        fused, cache = qkv.clone(), make_cache(kv_heads, head_dim, dtype)
        q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k, v = (part.view(tokens, -1, head_dim) for part in (q, k, v))
        backend.rotary_and_write_kv(q, k, v, positions, cos_sin, cache[:, 1], slots)
        results.append((fused, cache))
    (got_qkv, got_cache), (want_qkv, want_cache) = results
    atol = 0 if dtype == torch.float32 else 2e-2  # NOTE: the interpreter truncates to bfloat16, torch rounds
    torch.testing.assert_close(got_qkv, want_qkv, atol=atol, rtol=atol)
    torch.testing.assert_close(got_cache, want_cache, atol=atol, rtol=atol)
    assert torch.equal(got_cache[:, 0], make_cache(kv_heads, head_dim, dtype)[:, 0])  # other layers untouched
