"""KV reads between two processes on the same GPU, as device copies: the holder offers its cache
over CUDA IPC (torch's own sharing of CUDA memory between processes) in its NIXL handshake reply,
and a reader whose cache is on that very GPU (the same device UUID) maps it once and reads a
request's blocks with copy kernels on a stream of its own, at the GPU's copy rate. NIXL carries
every other read (other GPUs, other hosts, host memory, split caches). The lease rules are the
NIXL path's: the copy is one more way to transfer, and a read is used only once the holder
confirmed its lease (kv_transfer.side_channel_connector).

A copy cannot be stopped once launched: a read aborted meanwhile waits for its event
(CopyRead.is_done), as a NIXL READ that cannot be released does. A peer's cache stays mapped
while reads use it and is let go after IDLE_RELEASE_S without one (MappedCache), so a holder that
went away does not keep its memory held here; the next read maps it again.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from kv_transfer.messages import CudaIpcCache
from kv_transfer.ucx import Transport

logger = logging.getLogger(__name__)

TRANSPORT = Transport(transport="cuda_ipc/same-gpu", method="device copy", memory="cuda")
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


def export_cache(cache: torch.Tensor) -> CudaIpcCache:
    """What a reader on the same GPU maps cache from (open_cache): torch's CUDA IPC reduction of
    the tensor, as plain fields (nothing pickled crosses the side channel)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(cache)
    (_, size, stride, offset, _, dtype, _, handle, storage_bytes, storage_offset_bytes, _, ref_counter_handle,
     ref_counter_offset, event_handle, event_sync_required) = args
    return CudaIpcCache(gpu_uuid=gpu_uuid(cache.device), handle=handle, size_bytes=storage_bytes,
                        offset_bytes=storage_offset_bytes, ref_counter_handle=ref_counter_handle,
                        ref_counter_offset=ref_counter_offset, event_handle=event_handle,
                        event_sync_required=event_sync_required, shape=list(size), stride=list(stride),
                        storage_offset=offset, dtype=str(dtype).removeprefix("torch."))


def open_cache(info: CudaIpcCache, device: torch.device) -> torch.Tensor:
    """The holder's cache mapped into this process on device (the GPU info names: the caller
    checked the UUID)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    dtype = getattr(torch, info.dtype)
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(info.shape), tuple(info.stride), info.storage_offset,
                               torch.storage.TypedStorage, dtype, device.index or 0, info.handle, info.size_bytes,
                               info.offset_bytes, False, info.ref_counter_handle, info.ref_counter_offset,
                               info.event_handle, False)  # NOTE: no wait on the export's event: leases order writes


class MappedCache:
    """A peer's cache on this GPU (its offer), mapped at the first get() and again after a
    release; released by release_if_idle once unused for IDLE_RELEASE_S (a copy in flight keeps
    its own reference)."""

    def __init__(self, offer: CudaIpcCache, device: torch.device) -> None:
        self.offer = offer
        self._device = device
        self._cache: torch.Tensor | None = None
        self._used_at = 0.0

    def get(self) -> torch.Tensor:
        """The mapped cache; raises what torch raises where the mapping fails (the holder gone)."""
        if self._cache is None:
            self._cache = open_cache(self.offer, self._device)
        self._used_at = time.monotonic()
        return self._cache

    @property
    def is_mapped(self) -> bool:
        return self._cache is not None

    def release_if_idle(self, now: float) -> None:
        if self._cache is not None and now - self._used_at > IDLE_RELEASE_S:
            self._cache = None


def is_same_gpu(info: CudaIpcCache, cache: torch.Tensor) -> bool:
    """Whether the holder's cache (info) sits on the GPU this cache does, with the same shape past
    the block dimension and the same dtype, its view inside the memory it shares: then its blocks
    copy straight into ours."""
    if not cache.is_cuda:
        return False
    return (info.gpu_uuid == gpu_uuid(cache.device) and list(cache.shape[1:]) == info.shape[1:]
            and str(cache.dtype).removeprefix("torch.") == info.dtype and fits(info, cache.element_size()))


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


class CopyRead:
    """A read's copies, launched on stream: local[local_ids] = remote[remote_ids], run by run
    where there are few runs, else gathered and scattered through a bounded staging buffer.
    is_done() says whether they have all run (never waits)."""

    def __init__(self, local: torch.Tensor, remote: torch.Tensor, local_ids: list[int], remote_ids: list[int],
                 stream: torch.cuda.Stream | None) -> None:
        self._remote = remote  # NOTE: kept until done: the mapping must outlive the copy
        self._event = None
        if stream is not None:
            # NOTE: after what this process queued before: a step still in flight may write blocks
            # the scheduler has since handed to this read (a request that finished a step late)
            stream.wait_stream(torch.cuda.current_stream(local.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            pieces = runs(local_ids, remote_ids)
            if len(pieces) <= _MAX_RUN_COPIES:
                for start_local, start_remote, length in pieces:
                    local[start_local:start_local + length].copy_(remote[start_remote:start_remote + length],
                                                                  non_blocking=True)
            else:
                _gather_scatter(local, remote, local_ids, remote_ids)
            if local.is_cuda:
                self._event = torch.cuda.Event()
                self._event.record()

    def is_done(self) -> bool:
        if self._event is None or self._event.query():
            self._remote = None
            return True
        return False


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
