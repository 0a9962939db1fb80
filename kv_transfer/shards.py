"""A node's KV cache as its tensor-parallel ranks hold it: one cache per rank, each with a range of
the model's KV heads (one rank holding them all is the plain case), and what moving blocks between
two nodes of different TP degrees takes: which rank's heads come from which peer rank, as whole
head-major blocks (gloo, the fake) or as byte runs (NIXL).

Within a block's layer the heads are the innermost dimension but one ([2, block_size, heads,
head_dim]), so a part of a rank's heads is one run of bytes per token and K/V, while all of them
are one run per layer (per block where stored block-major): reads between equal head ranges merge
into the descriptors they always were, while a part of a rank's heads read straight would take
2 x block_size runs per block and layer. NIXL reads such a peer rank's blocks whole into a
staging buffer instead and copies the heads in memory (plan_read; benchmarks/kv_transfer_tp.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kv_transfer.layout import KVLayout


@dataclass(frozen=True)
class CacheShard:
    """One rank's cache [num_blocks, num_layers, 2, block_size, len(kv_heads), head_dim] and the
    model's KV heads it holds."""

    cache: torch.Tensor
    kv_heads: range


@dataclass(frozen=True)
class HeadSegment:
    """Heads [start, stop) of the model go from the peer's rank remote_rank to our rank local_rank."""

    local_rank: int
    remote_rank: int
    start: int
    stop: int


def as_shards(kv_cache: torch.Tensor | list[CacheShard]) -> list[CacheShard]:
    """A plain cache is one shard holding every head."""
    if isinstance(kv_cache, torch.Tensor):
        return [CacheShard(kv_cache, range(kv_cache.shape[4]))]
    return list(kv_cache)


def head_ranges(shards: list[CacheShard]) -> list[tuple[int, int]]:
    """The shards' head ranges as the layout record carries them."""
    return [(s.kv_heads.start, s.kv_heads.stop) for s in shards]


def check_shards(shards: list[CacheShard], layout: KVLayout) -> None:
    """Raises ValueError unless every shard is a cache of layout's blocks holding its heads (stored
    block-major or layer-major) and the shards hold every head of the model between them."""
    if not shards:
        raise ValueError("a KV connector needs one cache at least")
    held = set()
    for rank, shard in enumerate(shards):
        cache, heads = shard.cache, shard.kv_heads
        if cache.dim() != 6 or cache.shape[0] != layout.num_blocks:
            raise ValueError(f"rank {rank}: kv_cache must have {layout.num_blocks} blocks, got {tuple(cache.shape)}")
        if not (cache.is_contiguous() or cache.transpose(0, 1).is_contiguous()):
            raise ValueError(f"rank {rank}: kv_cache must be stored block-major or layer-major, got strides "
                             f"{cache.stride()}")
        want = (layout.num_layers, 2, layout.block_size, len(heads), layout.head_dim)
        if tuple(cache.shape[1:]) != want or not 0 <= heads.start < heads.stop <= layout.num_kv_heads:
            raise ValueError(f"rank {rank}: kv_cache blocks are {tuple(cache.shape[1:])} for heads {heads.start}-"
                             f"{heads.stop}, the layout's {want} of {layout.num_kv_heads} heads")
        if str(cache.dtype).removeprefix("torch.") != layout.dtype:
            raise ValueError(f"rank {rank}: kv_cache dtype is {cache.dtype}, layout says {layout.dtype}")
        held.update(heads)
    if held != set(range(layout.num_kv_heads)):
        raise ValueError(f"the ranks hold KV heads {sorted(held)}, not all {layout.num_kv_heads}")


def head_segments(local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> list[HeadSegment]:
    """For each of our ranks' heads, the peer rank it is read from (the first that holds it), as
    maximal runs of heads: what a read between the two TP layouts moves, and between which ranks."""
    segments = []
    for local_rank, (start, stop) in enumerate(local):
        head = start
        while head < stop:
            remote_rank = next(r for r, (a, b) in enumerate(remote) if a <= head < b)
            end = min(stop, remote[remote_rank][1])
            segments.append(HeadSegment(local_rank, remote_rank, head, end))
            head = end
    return segments


def gather_heads(shards: list[CacheShard], block_ids: list[int], num_kv_heads: int) -> torch.Tensor:
    """Blocks block_ids with every head of the model, [n, num_layers, 2, block_size, num_kv_heads,
    head_dim] (each head from the first rank holding it): what a holder sends a gloo reader."""
    first = shards[0].cache
    index = torch.tensor(block_ids, device=first.device)
    if len(shards) == 1:
        return first[index].contiguous()
    out = torch.empty((len(block_ids), *first.shape[1:4], num_kv_heads, first.shape[5]), dtype=first.dtype,
                      device=first.device)
    whole = [(0, num_kv_heads)]
    for segment in head_segments(whole, head_ranges(shards)):
        shard = shards[segment.remote_rank]
        offset = shard.kv_heads.start
        # NOTE: the block index and the head slice in one indexing: only the segment's heads are copied
        rows = index.to(shard.cache.device)  # NOTE: a rank's cache may be on a GPU of its own
        out[..., segment.start : segment.stop, :] = shard.cache[rows, :, :, :,
                                                                segment.start - offset : segment.stop - offset]
    return out


def scatter_heads(shards: list[CacheShard], block_ids: list[int], blocks: torch.Tensor) -> None:
    """Write blocks (every head of the model, as gather_heads gives them) into block_ids of each
    rank's cache, each rank its own heads."""
    for shard in shards:
        index = torch.tensor(block_ids, device=shard.cache.device)
        shard.cache[index] = blocks[..., shard.kv_heads.start : shard.kv_heads.stop, :].to(shard.cache.device)
    wait_for_writes({shard.cache.device for shard in shards})


def wait_for_writes(devices: set[torch.device]) -> None:
    """Wait until this process's writes to the caches on devices are done: a worker rank's process
    reads its cache on streams of its own, which no stream of this process orders (a no-op on the CPU)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


@dataclass(frozen=True)
class ShardRegions:
    """Where one rank's blocks lie in memory: block b's layer l is layer_bytes at base_address +
    b * block_stride + l * layer_stride, holding [2, block_size, len(kv_heads), head_dim]."""

    base_address: int
    block_stride: int
    layer_stride: int
    layer_bytes: int
    kv_heads: range
    device_id: int

    @classmethod
    def of(cls, shard: CacheShard) -> ShardRegions:
        cache = shard.cache
        elem = cache.element_size()
        return cls(cache.data_ptr(), cache.stride(0) * elem, cache.stride(1) * elem, cache[0, 0].numel() * elem,
                   shard.kv_heads, cache.device.index or 0)

    def is_block_major(self, num_layers: int) -> bool:
        return self.layer_stride == self.layer_bytes and self.block_stride == num_layers * self.layer_bytes


@dataclass(frozen=True)
class ByteRuns:
    """A read as byte runs: local_addresses[i] <- remote_addresses[i], lengths[i] bytes, on the
    given devices; adjacent runs merged on both sides."""

    local_addresses: np.ndarray
    local_devices: np.ndarray
    remote_addresses: np.ndarray
    remote_devices: np.ndarray
    lengths: np.ndarray


@dataclass(frozen=True)
class ReadPlan:
    """How a read between two splits goes: direct, the segments between ranks holding the same
    heads (their runs merge into whole blocks or layers); staged, for each peer rank whose heads
    some rank of ours holds only a part of (or more than), the segments its whole blocks, read
    into a staging buffer first (a few runs), give our ranks (copied in memory)."""

    direct: list[HeadSegment]
    staged: dict[int, list[HeadSegment]]


def plan_read(local: list[ShardRegions], remote: list[ShardRegions]) -> ReadPlan:
    direct, staged = [], {}
    for segment in head_segments([(r.kv_heads.start, r.kv_heads.stop) for r in local],
                                 [(r.kv_heads.start, r.kv_heads.stop) for r in remote]):
        if local[segment.local_rank].kv_heads == remote[segment.remote_rank].kv_heads:
            direct.append(segment)
        else:
            staged.setdefault(segment.remote_rank, []).append(segment)
    return ReadPlan(direct, staged)


def byte_runs(local: list[ShardRegions], remote: list[ShardRegions], local_block_ids: list[int],
              remote_block_ids: list[int], layout: KVLayout, element_bytes: int,
              segments: list[HeadSegment] | None = None) -> ByteRuns:
    """The runs reading remote_block_ids of the peer's ranks into local_block_ids of ours, pairwise:
    for each head segment (default: every one, head_segments), per block, layer, K/V and token the
    segment's heads, in an order that puts runs adjacent in both caches next to each other (blocks
    within a layer, or whole blocks where both sides are block-major), then merged."""
    parts = []
    if segments is None:
        segments = head_segments([(r.kv_heads.start, r.kv_heads.stop) for r in local],
                                 [(r.kv_heads.start, r.kv_heads.stop) for r in remote])
    local_blocks = np.asarray(local_block_ids, dtype=np.int64)
    remote_blocks = np.asarray(remote_block_ids, dtype=np.int64)
    for segment in segments:
        ours, theirs = local[segment.local_rank], remote[segment.remote_rank]
        block_major = ours.is_block_major(layout.num_layers) and theirs.is_block_major(layout.num_layers)
        rows = _segment_offsets(ours, local_blocks, segment, layout, element_bytes, block_major)
        remote_rows = _segment_offsets(theirs, remote_blocks, segment, layout, element_bytes, block_major)
        length = (segment.stop - segment.start) * layout.head_dim * element_bytes
        parts.append((ours.base_address + rows, ours.device_id, theirs.base_address + remote_rows, theirs.device_id,
                      length))
    return _merged_runs(parts)


def _segment_offsets(regions: ShardRegions, blocks: np.ndarray, segment: HeadSegment, layout: KVLayout,
                     element_bytes: int, block_major: bool) -> np.ndarray:
    """The offsets of the segment's heads in each (block, layer, K/V, token) of one rank's cache,
    flattened block-outermost where block_major, else layer-outermost."""
    num_heads = len(regions.kv_heads)
    head_bytes = layout.head_dim * element_bytes
    rows = np.arange(2 * layout.block_size, dtype=np.int64) * num_heads * head_bytes  # K/V and token
    first = (segment.start - regions.kv_heads.start) * head_bytes
    layers = np.arange(layout.num_layers, dtype=np.int64) * regions.layer_stride
    block_starts = blocks * regions.block_stride
    if block_major:
        grid = block_starts[:, None, None] + layers[None, :, None] + rows[None, None, :]
    else:
        grid = layers[:, None, None] + block_starts[None, :, None] + rows[None, None, :]
    return grid.reshape(-1) + first


def joined_runs(runs: list[ByteRuns]) -> ByteRuns:
    """Several reads' runs as one read's (unmerged across them)."""
    return ByteRuns(*(np.concatenate([getattr(r, name) for r in runs]) for name in
                      ("local_addresses", "local_devices", "remote_addresses", "remote_devices", "lengths")))


def _merged_runs(parts: list) -> ByteRuns:
    """The parts' runs, adjacent ones merged within a part (one pair of ranks): never across two,
    whose caches are registered apart even where one ends in memory where the next begins."""
    local = np.concatenate([p[0] for p in parts])
    remote = np.concatenate([p[2] for p in parts])
    local_dev = np.concatenate([np.full(len(p[0]), p[1], dtype=np.int64) for p in parts])
    remote_dev = np.concatenate([np.full(len(p[0]), p[3], dtype=np.int64) for p in parts])
    lengths = np.concatenate([np.full(len(p[0]), p[4], dtype=np.int64) for p in parts])
    part = np.concatenate([np.full(len(p[0]), i, dtype=np.int64) for i, p in enumerate(parts)])
    breaks = np.ones(len(local), dtype=bool)
    breaks[1:] = ((local[1:] != local[:-1] + lengths[:-1]) | (remote[1:] != remote[:-1] + lengths[:-1])
                  | (part[1:] != part[:-1]))
    starts = np.flatnonzero(breaks)
    return ByteRuns(local[starts], local_dev[starts], remote[starts], remote_dev[starts],
                    np.add.reduceat(lengths, starts))
