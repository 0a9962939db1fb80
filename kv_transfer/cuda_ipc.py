"""KV reads between two processes of one host with their caches on GPUs, as device copies: the
holder offers its cache over CUDA IPC (torch's own sharing of CUDA memory between processes) in its
NIXL handshake reply, and a reader on the same host maps it once and reads a request's blocks with
copy kernels on a stream of its own: at the GPU's copy rate from a cache on its own GPU (the same
device UUID), over NVLink or PCIe peer-to-peer from another GPU. CUDA opens the memory of a GPU this
process does not see (another CUDA_VISIBLE_DEVICES), so one GPU per node still copies. A cache on
another GPU is used only once a probe (a tensor of known bytes the holder offers beside its cache)
copied from there reads back equal: peer-to-peer copies a platform gets wrong are never trusted
blindly. Between tensor-parallel nodes each of the holder's rank caches is offered, and each of the
reader's ranks copies its heads from the holder's ranks that hold them (kv_transfer.shards'
head segments), on a stream of that rank's device. NIXL carries every other read (other hosts,
host memory), and any read whose mappings or copies cannot start. The lease rules are the NIXL
path's: the copy is one more way to transfer, and a read is used only once the holder confirmed
its lease (kv_transfer.side_channel_connector).

A copy cannot be stopped once launched: a read aborted meanwhile waits for its event
(CopyRead.is_done), as a NIXL READ that cannot be released does. A peer's cache stays mapped
while reads use it and is let go after IDLE_RELEASE_S without one (MappedCache), so a holder that
went away does not keep its memory held here; the next read maps it again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from pathlib import Path

import torch

from kv_transfer.messages import CudaIpcCache
from kv_transfer.ucx import Transport

logger = logging.getLogger(__name__)

SAME_GPU, PEER_GPU = "same-gpu", "peer-gpu"  # where a peer's cache is, seen from the reader's
TRANSPORTS = {route: Transport(transport=f"cuda_ipc/{route}", method="device copy", memory="cuda")
              for route in (SAME_GPU, PEER_GPU)}
# The probe: int32 values of a fixed pattern, 1 MiB; checked whole and as rows of _PROBE_ROW gathered.
PROBE_NUMEL = 1 << 18
_PROBE_ROW = 256
# NOTE: a read of many scattered blocks is gathered into a staging buffer of at most this many
# bytes at a time, then scattered into the reader's blocks: two kernels per piece instead of one
# copy per run of blocks.
_STAGING_BYTES = 64 << 20
# Up to this many runs of consecutive blocks (on both sides) are copied run by run.
_MAX_RUN_COPIES = 16
IDLE_RELEASE_S = 60.0


def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID: two processes name the same GPU by it whatever their CUDA_VISIBLE_DEVICES."""
    return str(torch.cuda.get_device_properties(device).uuid)


@functools.cache
def host_id() -> str:
    """This host as CUDA IPC sees it: the kernel's boot id and this process's PID namespace (CUDA
    IPC fails between PID namespaces, e.g. containers that do not share one). "": unknown."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/pid:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def probe_pattern(device: torch.device) -> torch.Tensor:
    """The probe's bytes, the same wherever made: PROBE_NUMEL int32 of a multiplicative hash (on a GPU,
    written before this returns: a peer may read it as soon as it is offered)."""
    values = torch.arange(PROBE_NUMEL, dtype=torch.int64, device=device)
    probe = values.mul_(2654435761).remainder_(2**31 - 1).to(torch.int32)
    if probe.is_cuda:
        torch.cuda.current_stream(device).synchronize()
    return probe


def export_cache(cache: torch.Tensor) -> CudaIpcCache:
    """What a reader on the same host maps cache from (open_cache): torch's CUDA IPC reduction of
    the tensor, as plain fields (nothing pickled crosses the side channel)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(cache)
    (_, size, stride, offset, _, dtype, _, handle, storage_bytes, storage_offset_bytes, _, ref_counter_handle,
     ref_counter_offset, event_handle, event_sync_required) = args
    return CudaIpcCache(gpu_uuid=gpu_uuid(cache.device), handle=handle, size_bytes=storage_bytes,
                        offset_bytes=storage_offset_bytes, ref_counter_handle=ref_counter_handle,
                        ref_counter_offset=ref_counter_offset, event_handle=event_handle,
                        event_sync_required=event_sync_required, shape=list(size), stride=list(stride),
                        storage_offset=offset, dtype=str(dtype).removeprefix("torch."), host_id=host_id())


def open_cache(info: CudaIpcCache, device: torch.device) -> torch.Tensor:
    """The holder's tensor mapped into this process, addressed from device (its memory on the GPU
    info names: this one, or a peer reached over NVLink or PCIe)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    dtype = getattr(torch, info.dtype)
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(info.shape), tuple(info.stride), info.storage_offset,
                               torch.storage.TypedStorage, dtype, device.index or 0, info.handle, info.size_bytes,
                               info.offset_bytes, False, info.ref_counter_handle, info.ref_counter_offset,
                               info.event_handle, False)  # NOTE: no wait on the export's event: leases order writes


class ProbeMismatch(RuntimeError):
    """A probe copied from a peer's GPU read back other bytes than it holds."""


class MappedCache:
    """A peer's cache on this host (its offer), reached by route, mapped at the first get() and
    again after a release; released by release_if_idle once unused for IDLE_RELEASE_S (a copy in
    flight keeps its own reference). With a probe offer, the first get() copies the probe from the
    peer's GPU and compares it with probe_pattern before mapping the cache (ProbeMismatch: unequal)."""

    def __init__(self, offer: CudaIpcCache, device: torch.device, route: str,
                 probe: CudaIpcCache | None = None) -> None:
        self.offer = offer
        self.route = route
        self._device = device
        self._probe = probe
        self._cache: torch.Tensor | None = None
        self._used_at = 0.0

    def get(self) -> torch.Tensor:
        """The mapped cache; raises what torch raises where the mapping fails (the holder gone)."""
        if self._cache is None:
            if self._probe is not None:
                check_probe(open_cache(self._probe, self._device))
                self._probe = None  # checked: this pair of GPUs copies right
            self._cache = open_cache(self.offer, self._device)
        self._used_at = time.monotonic()
        return self._cache

    @property
    def is_mapped(self) -> bool:
        return self._cache is not None

    def release_if_idle(self, now: float) -> None:
        if self._cache is not None and now - self._used_at > IDLE_RELEASE_S:
            self._cache = None


def check_probe(remote: torch.Tensor) -> None:
    """Copy a peer's probe here both ways reads copy (a copy of contiguous memory, as a read of few
    runs; an index_select kernel loading through the mapping, as the gather of a scattered read) and
    compare each with the pattern it holds (synchronizing, once per peer); raises ProbeMismatch where
    any byte differs."""
    expected = probe_pattern(remote.device)
    if remote.shape != expected.shape:
        raise ProbeMismatch(f"the peer's probe has shape {tuple(remote.shape)}, not {tuple(expected.shape)}")
    rows = expected.view(-1, _PROBE_ROW)
    order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(0)).to(remote.device)
    copied, gathered = remote.clone(), remote.view(-1, _PROBE_ROW).index_select(0, order)
    if not (torch.equal(copied, expected) and torch.equal(gathered, rows.index_select(0, order))):
        raise ProbeMismatch("a probe copied from the peer's GPU read back other bytes than it holds: device "
                            "copies from there are not used")


def is_probe(offer: CudaIpcCache, cache_offer: CudaIpcCache) -> bool:
    """Whether offer is a probe as probe_pattern makes one, on the GPU and host of cache_offer, its
    view inside the memory it shares."""
    return (offer.shape == [PROBE_NUMEL] and offer.dtype == "int32" and fits(offer, 4)
            and offer.gpu_uuid == cache_offer.gpu_uuid and offer.host_id == cache_offer.host_id)


def route(offer: CudaIpcCache, cache: torch.Tensor, mode: str) -> str | None:
    """How this cache's blocks can be copied from the holder's (offer; either one a tensor-parallel
    rank's) under mode (TransferConfig.device_copy): SAME_GPU, PEER_GPU (another GPU of this host) or
    None (through UCX). The caches [blocks, layers, 2, block_size, heads, head_dim] must agree in all
    but the blocks and the heads they hold, and in dtype, and the offer's view stay inside the memory
    it shares."""
    if mode == "off" or not cache.is_cuda or len(offer.shape) != 6 or len(cache.shape) != 6:
        return None
    if (list(cache.shape[1:4]) != offer.shape[1:4] or cache.shape[5] != offer.shape[5]
            or str(cache.dtype).removeprefix("torch.") != offer.dtype or not fits(offer, cache.element_size())):
        return None
    if offer.gpu_uuid == gpu_uuid(cache.device):
        return SAME_GPU
    if mode == "auto" and offer.host_id and offer.host_id == host_id():
        return PEER_GPU
    return None


def fits(info: CudaIpcCache, element_size: int) -> bool:
    """Whether the view (shape, stride, offset) stays inside the shared memory's size_bytes."""
    if len(info.shape) != len(info.stride) or min(info.shape, default=1) < 1 or min(info.stride, default=0) < 0:
        return False
    last = info.storage_offset + sum((n - 1) * step for n, step in zip(info.shape, info.stride, strict=True))
    return info.storage_offset >= 0 and (last + 1) * element_size <= info.size_bytes


def runs(local_ids: list[int], remote_ids: list[int]) -> list[tuple[int, int, int]]:
    """(local start, remote start, length) for each run of blocks consecutive on both sides."""
    out: list[tuple[int, int, int]] = []
    for local, remote in zip(local_ids, remote_ids, strict=True):
        if out and out[-1][0] + out[-1][2] == local and out[-1][1] + out[-1][2] == remote:
            start_local, start_remote, length = out[-1]
            out[-1] = (start_local, start_remote, length + 1)
        else:
            out.append((local, remote, 1))
    return out


def mapping_devices(segments: list, local_devices: list[torch.device]) -> dict[int, torch.device] | None:
    """The device each peer rank's cache is mapped on: that of our ranks its heads go to (segments:
    kv_transfer.shards.HeadSegment; local_devices: each of our ranks' cache's); None where a peer rank
    feeds ranks of ours on two devices (torch and CUDA map a handle once in a process)."""
    devices: dict[int, torch.device] = {}
    for segment in segments:
        device = local_devices[segment.local_rank]
        if devices.setdefault(segment.remote_rank, device) != device:
            return None
    return devices


class PeerCopies:
    """How a peer's blocks are copied here: for each run of heads (kv_transfer.shards.HeadSegment:
    one, all heads, between two caches of one rank each), the peer rank's cache mapped on the device
    of our rank that takes them (mapped, by (peer rank, our device))."""

    def __init__(self, segments: list, mapped: dict[tuple[int, torch.device], MappedCache]) -> None:
        self.segments = segments
        self.mapped = mapped

    @property
    def route(self) -> str:
        """PEER_GPU where any of the peer's caches is on another GPU than the one it is copied to."""
        return PEER_GPU if any(m.route == PEER_GPU for m in self.mapped.values()) else SAME_GPU

    def release_if_idle(self, now: float) -> None:
        for mapped in self.mapped.values():
            mapped.release_if_idle(now)


class CopyRead:
    """A read's copies: for each piece (our view, the peer's view: a cache's heads, or all of it),
    ours[local_ids] = theirs[remote_ids], run by run where there are few runs, else gathered and
    scattered through a bounded staging buffer, on the stream streams gives our view's device (none:
    the current one), each after what this process queued before on its device and on after's.
    is_done() says whether they have all run (never waits)."""

    def __init__(self, pieces: list[tuple[torch.Tensor, torch.Tensor]], local_ids: list[int], remote_ids: list[int],
                 streams: dict[torch.device, torch.cuda.Stream] | None, after: torch.device | None = None) -> None:
        self._remote = [theirs for _, theirs in pieces]  # NOTE: kept until done: the mappings must outlive the copies
        self._events = []
        streams = streams or {}
        for device in dict.fromkeys(ours.device for ours, _ in pieces):
            stream = streams.get(device)
            if stream is not None:
                # NOTE: after what this process queued before: a step still in flight may write blocks
                # the scheduler has since handed to this read (a request that finished a step late)
                stream.wait_stream(torch.cuda.current_stream(device))
                if after is not None and after.type == "cuda" and after != device:
                    stream.wait_stream(torch.cuda.current_stream(after))
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for ours, theirs in pieces:
                    if ours.device == device:
                        _copy_blocks(ours, theirs, local_ids, remote_ids)
                if device.type == "cuda":
                    event = torch.cuda.Event()
                    event.record()
                    self._events.append(event)

    def is_done(self) -> bool:
        if all(event.query() for event in self._events):
            self._remote = None
            return True
        return False


def _copy_blocks(ours: torch.Tensor, theirs: torch.Tensor, local_ids: list[int], remote_ids: list[int]) -> None:
    pieces = runs(local_ids, remote_ids)
    if len(pieces) <= _MAX_RUN_COPIES:
        for start_local, start_remote, length in pieces:
            ours[start_local:start_local + length].copy_(theirs[start_remote:start_remote + length], non_blocking=True)
    else:
        _gather_scatter(ours, theirs, local_ids, remote_ids)


def _gather_scatter(local: torch.Tensor, remote: torch.Tensor, local_ids: list[int], remote_ids: list[int]) -> None:
    block_bytes = local[0].numel() * local.element_size()
    step = max(1, _STAGING_BYTES // block_bytes)
    # NOTE: the ids go over from pinned memory without waiting (a pageable copy would hold this
    # thread until the stream, which waits for the step in flight, got to it)
    ids = torch.tensor([local_ids, remote_ids], dtype=torch.long)
    if local.is_cuda:
        ids = ids.pin_memory().to(local.device, non_blocking=True)
    for start in range(0, len(local_ids), step):
        into, out_of = ids[0, start:start + step], ids[1, start:start + step]
        local.index_copy_(0, into, remote.index_select(0, out_of))
