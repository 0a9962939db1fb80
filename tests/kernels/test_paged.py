"""Paged kernels: KV write, block copies, decode and prefill attention. Reference vs naive
per-token math, Triton vs reference, over GQA ratios, odd lengths and shuffled block tables."""

import math

import pytest
import torch

from kernels.block_copy import copy_blocks, gather_blocks, scatter_blocks
from kernels.decode_attention import decode_attention, decode_attention_ref
from kernels.prefill_attention import prefill_attention, prefill_attention_ref
from kernels.write_kv import write_kv, write_kv_ref
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, randn

BLOCK_SIZE = 16
NUM_BLOCKS = 40
NUM_LAYERS = 2


def make_cache(num_kv_heads: int, head_dim: int, dtype=torch.float32, seed=0) -> torch.Tensor:
    return randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype, seed=seed)


def shuffled_block_tables(seq_lens: list[int], seed=0) -> torch.Tensor:
    """Non-contiguous block ids, each sequence its own."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    width = max(1, max(math.ceil(n / BLOCK_SIZE) for n in seq_lens))
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for row, n in enumerate(seq_lens):
        for col in range(math.ceil(n / BLOCK_SIZE)):
            table[row, col] = order.pop()
    return table.to(DEVICE)


def naive_attention(q, kv_layer, table_row, seq_len, positions, scale):
    """q: [q_len, heads, d] at positions; per token, per head softmax over keys <= position."""
    heads, num_kv_heads = q.shape[1], kv_layer.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for t in range(q.shape[0]):
        for h in range(heads):
            keys, values = [], []
            for pos in range(positions[t] + 1):
                block = int(table_row[pos // BLOCK_SIZE])
                keys.append(kv_layer[block, 0, pos % BLOCK_SIZE, h // (heads // num_kv_heads)].float())
                values.append(kv_layer[block, 1, pos % BLOCK_SIZE, h // (heads // num_kv_heads)].float())
            weights = torch.softmax(torch.stack(keys).cpu() @ q[t, h].float().cpu() * scale, 0)
            out[t, h] = weights @ torch.stack(values).cpu()
    return out


GQA = [(4, 4), (6, 2), (8, 2), (8, 1)]  # (heads, kv heads): ratios 1, 3, 4, 8
SEQ_LENS = [1, 16, 17, 40, 0]


@pytest.mark.parametrize("heads, kv_heads", GQA)
def test_decode_reference_matches_naive(heads, kv_heads):
    kv_layer = make_cache(kv_heads, 32)[:, 1]
    table = shuffled_block_tables(SEQ_LENS)
    q = randn(len(SEQ_LENS), heads, 32, seed=3)
    out = decode_attention_ref(q, kv_layer, table, torch.tensor(SEQ_LENS, dtype=torch.int32, device=DEVICE), 0.17)
    for i, n in enumerate(SEQ_LENS):
        if n == 0:
            assert torch.all(out[i] == 0)
            continue
        want = naive_attention(q[i:i + 1], kv_layer, table[i], n, [n - 1], 0.17)
        torch.testing.assert_close(out[i:i + 1].float().cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [32, 80])
def test_decode_triton_matches_reference(heads, kv_heads, head_dim, dtype):
    kv_layer = make_cache(kv_heads, head_dim, dtype)[:, 0]
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=DEVICE)
    table = shuffled_block_tables(SEQ_LENS, seed=1)
    q = randn(len(SEQ_LENS), heads, head_dim, dtype=dtype, seed=4)
    want = decode_attention_ref(q, kv_layer, table, seq_lens, head_dim ** -0.5)
    got = decode_attention(q, kv_layer, table, seq_lens, head_dim ** -0.5, force_triton=True)
    assert_close(got, want, dtype)


def prefill_case(q_lens, seq_lens, heads, kv_heads, head_dim, dtype, seed):
    kv_layer = make_cache(kv_heads, head_dim, dtype, seed)[:, 1]
    table = shuffled_block_tables(seq_lens, seed=seed)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=DEVICE)
    q = randn(int(cu[-1]), heads, head_dim, dtype=dtype, seed=seed + 1)
    return q, kv_layer, table, cu, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


# (chunk lengths, total lengths): whole prompts, one token, empty, chunks over a cached prefix
Q_LENS, TOTALS = [5, 1, 0, 16, 7, 17], [5, 1, 3, 16, 40, 33]


@pytest.mark.parametrize("heads, kv_heads", GQA)
def test_prefill_reference_matches_naive(heads, kv_heads):
    q, kv_layer, table, cu, seq_lens = prefill_case(Q_LENS, TOTALS, heads, kv_heads, 32, torch.float32, 5)
    out = prefill_attention_ref(q, kv_layer, table, cu, seq_lens, 0.2)
    for i, (q_len, total) in enumerate(zip(Q_LENS, TOTALS)):
        if q_len == 0:
            continue
        start = int(cu[i])
        positions = list(range(total - q_len, total))
        want = naive_attention(q[start:start + q_len], kv_layer, table[i], total, positions, 0.2)
        torch.testing.assert_close(out[start:start + q_len].float().cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", GQA)
def test_prefill_triton_matches_reference(heads, kv_heads, dtype):
    q, kv_layer, table, cu, seq_lens = prefill_case(Q_LENS, TOTALS, heads, kv_heads, 64, dtype, 7)
    want = prefill_attention_ref(q, kv_layer, table, cu, seq_lens, 0.125)
    got = prefill_attention(q, kv_layer, table, cu, seq_lens, 0.125, force_triton=True)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_skips_negative_slots_and_matches_naive(dtype):
    cache = make_cache(2, 32, dtype)
    layer = cache[:, 1]
    key, value = randn(6, 2, 32, dtype=dtype, seed=8), randn(6, 2, 32, dtype=dtype, seed=9)
    slots = torch.tensor([0, 17, -1, 5 * BLOCK_SIZE + 15, 39 * BLOCK_SIZE, 3], device=DEVICE)
    want = cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[slot // BLOCK_SIZE, 1, 0, slot % BLOCK_SIZE] = key[t]
            want[slot // BLOCK_SIZE, 1, 1, slot % BLOCK_SIZE] = value[t]
    ref_cache, tri_cache = cache.clone(), cache.clone()
    write_kv_ref(key, value, ref_cache[:, 1], slots)
    write_kv(key, value, tri_cache[:, 1], slots, force_triton=True)
    assert torch.equal(ref_cache, want)
    assert torch.equal(tri_cache, want)


def test_write_kv_rejects_mismatched_shapes():
    layer = make_cache(2, 32)[:, 0]
    with pytest.raises(ValueError, match="write_kv"):
        write_kv(randn(3, 2, 32), randn(3, 2, 16), layer, torch.zeros(3, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_gather_scatter_copy(dtype):
    cache = make_cache(2, 32, dtype)
    ids = torch.tensor([7, 0, 33, 12], device=DEVICE)
    staging = torch.empty((4, *cache.shape[1:]), dtype=dtype, device=DEVICE)
    gather_blocks(cache, ids, staging, force_triton=True)
    assert torch.equal(staging, cache[ids])
    target = torch.zeros_like(cache)
    scatter_blocks(staging, target, ids, force_triton=True)
    assert torch.equal(target[ids], cache[ids])
    assert torch.count_nonzero(target[[i for i in range(NUM_BLOCKS) if i not in ids.tolist()]]) == 0
    before = cache.clone()
    copy_blocks(cache, torch.tensor([1, 2], device=DEVICE), torch.tensor([30, 31], device=DEVICE), force_triton=True)
    assert torch.equal(cache[[30, 31]], before[[1, 2]])
    assert torch.equal(cache[:30], before[:30])
