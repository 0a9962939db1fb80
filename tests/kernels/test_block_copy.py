"""Whole-block copies: gather into a staging buffer, scatter back, block to block; Triton and
reference vs plain indexing, blocks not named stay untouched."""

import pytest
import torch

from kernels.triton.block_copy import copy_blocks, gather_blocks, scatter_blocks
from tests.kernels.conftest import DEVICE, DTYPES, NUM_BLOCKS, gpu, make_cache, randn, requires_cuda

IDS = [7, 0, 33, 12]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("force_triton", [False, True])
def test_gather_then_scatter_round_trips_only_the_named_blocks(dtype, force_triton):
    cache = make_cache(2, 32, dtype)
    ids = torch.tensor(IDS, device=DEVICE)
    staging = torch.empty((len(IDS), *cache.shape[1:]), dtype=dtype, device=DEVICE)
    gather_blocks(cache, ids, staging, force_triton=force_triton)
    for i, block_id in enumerate(IDS):
        assert torch.equal(staging[i], cache[block_id])
    target = torch.zeros_like(cache)
    scatter_blocks(staging, target, ids, force_triton=force_triton)
    for block_id in range(NUM_BLOCKS):
        assert torch.equal(target[block_id], cache[block_id] if block_id in IDS else torch.zeros_like(cache[0]))


@pytest.mark.parametrize("force_triton", [False, True])
def test_copy_blocks_copies_sources_and_leaves_the_rest(force_triton):
    cache = make_cache(2, 32)
    before = cache.clone()
    copy_blocks(cache, torch.tensor([1, 2, 5], device=DEVICE), torch.tensor([30, 31, 3], device=DEVICE),
                force_triton=force_triton)
    moved = {30: 1, 31: 2, 3: 5}
    for block_id in range(NUM_BLOCKS):
        assert torch.equal(cache[block_id], before[moved.get(block_id, block_id)])


def test_block_copies_with_any_block_shape_and_no_ids():
    cache = randn(9, 3, 5, 7)
    staging = torch.empty(2, 3, 5, 7, device=DEVICE)
    gather_blocks(cache, torch.tensor([8, 1], device=DEVICE), staging, force_triton=True)
    assert torch.equal(staging, cache[[8, 1]])
    empty = torch.empty(0, 3, 5, 7, device=DEVICE)
    none = torch.zeros(0, dtype=torch.long, device=DEVICE)
    gather_blocks(cache, none, empty, force_triton=True)
    scatter_blocks(empty, cache, none, force_triton=True)
    copy_blocks(cache, none, none, force_triton=True)


def test_block_copies_reject_mismatched_buffers():
    cache = make_cache(2, 32)
    with pytest.raises(ValueError, match="gather_blocks"):
        gather_blocks(cache, torch.tensor([1, 2], device=DEVICE), torch.empty(3, *cache.shape[1:], device=DEVICE))
    with pytest.raises(ValueError, match="scatter_blocks"):
        scatter_blocks(torch.empty(2, 5, device=DEVICE), cache, torch.tensor([1, 2], device=DEVICE))
    with pytest.raises(ValueError, match="copy_blocks"):
        copy_blocks(cache, torch.tensor([1, 2], device=DEVICE), torch.tensor([3], device=DEVICE))


@gpu
@requires_cuda
def test_block_copies_cuda_many_large_blocks():
    cache = randn(600, 4, 2, 16, 8, 128, dtype=torch.bfloat16)
    ids = torch.randperm(600, device="cuda")[:300]
    staging = torch.empty(300, *cache.shape[1:], dtype=torch.bfloat16, device="cuda")
    gather_blocks(cache, ids, staging)
    assert torch.equal(staging, cache[ids])
