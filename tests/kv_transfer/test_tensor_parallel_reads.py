"""Reads between nodes of different tensor-parallel degrees (kv_transfer.shards): each of the
reader's ranks gets exactly its own KV heads from the holder's ranks that hold them, over NIXL and
gloo, between caches stored block-major and layer-major; equal head ranges still merge into the
descriptors of a one-rank read, a part of a rank's heads takes one per token and K/V."""

from __future__ import annotations

import dataclasses
import random

import msgspec
import pytest
import torch

from engine.kv_cache import stored_layer_major
from kv_transfer.config import TransferConfig
from kv_transfer.factory import create_connector
from kv_transfer.layout import KVLayout
from kv_transfer.shards import CacheShard, HeadSegment, ShardRegions, byte_runs, head_segments
from tests.kernels.conftest import gpu, requires_cuda
from tests.kv_transfer.helpers import poll_until
from tests.kv_transfer.test_connectors import Holder

LAYOUT = KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, block_size=16, dtype="float32", num_blocks=40,
                  model_fingerprint="abc", code_version="1")


@pytest.fixture
def holders():
    started: list[Holder] = []

    def start(*args, **kwargs) -> Holder:
        holder = Holder(*args, layout=LAYOUT, **kwargs)
        started.append(holder)
        return holder

    yield start
    for holder in started:
        holder.kill()


def reader_shards(ranges: list[tuple[int, int]], storage: str, device: str = "cpu") -> list[CacheShard]:
    shards = []
    for start, stop in ranges:
        shape = (LAYOUT.num_blocks, LAYOUT.num_layers, 2, LAYOUT.block_size, stop - start, LAYOUT.head_dim)
        cache = torch.full(shape, float("nan"), device=device)
        shards.append(CacheShard(stored_layer_major(cache) if storage == "layer" else cache, range(start, stop)))
    return shards


SPLITS = [
    ([(0, 4)], [(0, 2), (2, 4)], "layer"),  # 1P(TP=1) + 1D(TP=2)
    ([(0, 2), (2, 4)], [(0, 4)], "layer"),  # 1P(TP=2) + 1D(TP=1)
    ([(0, 2), (2, 4)], [(0, 2), (2, 4)], "block"),  # equal splits
    ([(0, 1), (1, 2), (2, 3), (3, 4)], [(0, 3), (3, 4)], "layer"),  # uneven: 4 ranks into 2
    ([(0, 1), (0, 1), (1, 2), (1, 2), (2, 3), (2, 3), (3, 4), (3, 4)], [(0, 2), (2, 4)], "block"),  # replicated
]


# NOTE: gloo moves every head of a block whatever the splits (gather_heads / scatter_heads), so two
# splits that each gather from and scatter to several ranks cover it; NIXL's runs differ per split.
# On a GPU (both sides' caches on it, stored block-major as a GPU engine's): every split over NIXL
# (VRAM registered, staged heads copied on the device), one over gloo (through host memory).
_ON_CUDA = [pytest.param(backend, holder, reader, "block", "cuda", marks=[gpu, requires_cuda])
            for backend, (holder, reader, _) in [*(("nixl", s) for s in SPLITS), ("gloo", SPLITS[3])]]


@pytest.mark.parametrize(("backend", "holder_ranges", "reader_ranges", "storage", "device"),
                         [("nixl", *split, "cpu") for split in SPLITS] + [("gloo", *SPLITS[3], "cpu"),
                                                                          ("gloo", *SPLITS[4], "cpu")] + _ON_CUDA)
def test_every_reader_rank_gets_its_own_heads(backend, holder_ranges, reader_ranges, storage, device, holders):
    holder = holders(backend, seed=3, storage=storage, head_ranges=holder_ranges, device=device)
    shards = reader_shards(reader_ranges, storage, device)
    layout = msgspec.structs.replace(LAYOUT, kv_head_ranges=reader_ranges)
    connector = create_connector(TransferConfig(backend=backend), shards, layout, "reader")
    try:
        rng = random.Random(1)
        free = list(range(LAYOUT.num_blocks))
        rng.shuffle(free)
        plans = {}
        for i in range(4):
            n = rng.randint(1, 4)
            remote, local = rng.sample(range(LAYOUT.num_blocks), n), [free.pop() for _ in range(n)]
            plans[f"r{i}"] = (remote, local)
            connector.start_read(f"r{i}", holder.lease(f"r{i}", remote), local)
        results = poll_until(connector, set(plans), timeout_s=30)
        assert all(r.is_ok for r in results.values()), [r.error for r in results.values()]
        for request_id, (remote, local) in plans.items():
            for shard in shards:
                heads = shard.kv_heads
                assert torch.equal(shard.cache[local].cpu(), holder.cache[remote][..., heads.start : heads.stop, :]), \
                    (request_id, heads)
    finally:
        connector.close()


def test_head_segments_read_each_head_from_the_first_peer_rank_holding_it():
    assert head_segments([(0, 4)], [(0, 2), (2, 4)]) == [HeadSegment(0, 0, 0, 2), HeadSegment(0, 1, 2, 4)]
    assert head_segments([(0, 2), (2, 4)], [(0, 4)]) == [HeadSegment(0, 0, 0, 2), HeadSegment(1, 0, 2, 4)]
    assert head_segments([(1, 2), (1, 2)], [(0, 2), (0, 2)]) == [HeadSegment(0, 0, 1, 2), HeadSegment(1, 0, 1, 2)]


def _regions(ranges, storage):
    return [ShardRegions.of(s) for s in reader_shards(ranges, storage)]


def test_runs_never_merge_across_two_ranks_caches_lying_end_to_end():
    """Two ranks' caches one right after the other in memory (as an allocator may place them on one
    GPU), on both sides: a read of every block takes a run per rank, not one spanning both caches,
    which no registration holds."""
    blocks = list(range(LAYOUT.num_blocks))

    def end_to_end(regions):
        first, second = regions
        return [first, dataclasses.replace(second, base_address=first.base_address + LAYOUT.num_blocks
                                           * first.block_stride)]

    local = end_to_end(_regions([(0, 2), (2, 4)], "block"))
    remote = end_to_end(_regions([(0, 2), (2, 4)], "block"))
    runs = byte_runs(local, remote, blocks, blocks, LAYOUT, 4)
    assert len(runs.lengths) == 2
    for regions, addresses in ((local, runs.local_addresses), (remote, runs.remote_addresses)):
        for region, address, length in zip(regions, addresses, runs.lengths):
            assert address == region.base_address and length == LAYOUT.num_blocks * region.block_stride


@pytest.mark.parametrize("storage", ["block", "layer"])
def test_equal_splits_merge_like_one_rank_and_a_part_of_a_rank_costs_a_run_per_token(storage):
    blocks = list(range(8))  # consecutive on both sides: a one-rank read merges them all
    one = byte_runs(_regions([(0, 4)], storage), _regions([(0, 4)], storage), blocks, blocks, LAYOUT, 4)
    equal = byte_runs(_regions([(0, 2), (2, 4)], storage), _regions([(0, 2), (2, 4)], storage), blocks, blocks,
                      LAYOUT, 4)
    split = byte_runs(_regions([(0, 2), (2, 4)], storage), _regions([(0, 4)], storage), blocks, blocks, LAYOUT, 4)
    per_rank = 1 if storage == "block" else LAYOUT.num_layers
    assert len(one.lengths) == per_rank and len(equal.lengths) == 2 * per_rank
    assert len(split.lengths) == 2 * len(blocks) * LAYOUT.num_layers * 2 * LAYOUT.block_size
    whole = len(blocks) * LAYOUT.block_numel * 4
    assert one.lengths.sum() == equal.lengths.sum() == split.lengths.sum() == whole


@pytest.mark.parametrize(("holder_ranges", "reader_ranges"), [split[:2] for split in SPLITS])
def test_device_copies_give_every_reader_rank_its_own_heads(holder_ranges, reader_ranges, holders, monkeypatch):
    """The holder's rank caches offered over CUDA IPC (kv_transfer.cuda_ipc) and copied head run by
    head run into the reader's ranks, on the CPU: a mapping of a holder rank's cache stands in as that
    rank's heads of the holder's blocks, the route as one GPU. Each read is a device copy, confirmed
    with the live holder as a NIXL read is, and every reader rank gets exactly its own heads."""
    from kv_transfer import cuda_ipc
    from kv_transfer.messages import CudaIpcCache

    holder = holders("nixl", seed=4, storage="block", head_ranges=holder_ranges)
    shards = reader_shards(reader_ranges, "block")
    layout = msgspec.structs.replace(LAYOUT, kv_head_ranges=reader_ranges)
    connector = create_connector(TransferConfig(backend="nixl"), shards, layout, "reader")
    ranks = {f"rank{i}".encode(): holder.cache[..., start:stop, :].contiguous()
             for i, (start, stop) in enumerate(holder_ranges)}
    offers = [CudaIpcCache(gpu_uuid="GPU-1", handle=name, size_bytes=cache.numel() * 4, offset_bytes=0,
                           ref_counter_handle=b"r", ref_counter_offset=0, event_handle=None,
                           event_sync_required=False, shape=list(cache.shape), stride=list(cache.stride()),
                           storage_offset=0, dtype="float32") for name, cache in ranks.items()]
    monkeypatch.setattr(cuda_ipc, "open_cache", lambda offer, device: ranks[offer.handle])
    monkeypatch.setattr(cuda_ipc, "route", lambda offer, cache, mode: cuda_ipc.SAME_GPU)
    real = connector._device_copies  # NOTE: a holder on the CPU offers none: here, what one on a GPU would
    monkeypatch.setattr(connector, "_device_copies",
                        lambda info: real(msgspec.structs.replace(info, cuda_ipc_shards=offers)))
    try:
        rng = random.Random(2)
        free = list(range(LAYOUT.num_blocks))
        rng.shuffle(free)
        plans = {}
        for i, n in enumerate([1, 3, 20]):  # the last gathered and scattered (more than 16 runs)
            remote, local = rng.sample(range(LAYOUT.num_blocks), n), [free.pop() for _ in range(n)]
            plans[f"r{i}"] = (remote, local)
            connector.start_read(f"r{i}", holder.lease(f"r{i}", remote), local)
            results = poll_until(connector, {f"r{i}"}, timeout_s=30)
            assert all(r.is_ok for r in results.values()), [r.error for r in results.values()]
        assert connector.num_device_copy_reads == len(plans)
        for request_id, (remote, local) in plans.items():
            for shard in shards:
                heads = shard.kv_heads
                assert torch.equal(shard.cache[local], holder.cache[remote][..., heads.start : heads.stop, :]), \
                    (request_id, heads)
        untouched = sorted(set(range(LAYOUT.num_blocks)) - {b for _, local in plans.values() for b in local})
        assert all(shard.cache[untouched].isnan().all() for shard in shards)
    finally:
        connector.close()
