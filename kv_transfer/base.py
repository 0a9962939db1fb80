"""KVConnector: the interface both nodes use to move paged KV blocks between engines.

Decode side (the reader): start_read() queues a pull of remote blocks into local blocks;
poll() drives it and returns finished or failed reads. Prefill side (the holder):
poll_released() returns request ids whose blocks a reader has read or given up, so the node
can free them. A connector never allocates or frees engine blocks: the node does, on what
these calls return. No call waits on the network; poll() may copy bytes (a NIXL READ within
one host is carried out while it is posted, about 30 ms per 94 MB).
"""

from __future__ import annotations

import enum
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kv_transfer.config import TransferConfig
from kv_transfer.layout import KVLayout


class TransferState(enum.Enum):
    """Where one block transfer stands, whatever the backend (each maps its own states to
    these once, where it reads them)."""

    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class ReadResult:
    """One read's outcome. When is_ok is False, error names the request and the cause and the
    local blocks hold nothing the caller may rely on (the caller frees them)."""

    request_id: str
    is_ok: bool
    error: str | None = None


def new_engine_id(node_id: str) -> str:
    """Unique per process start, so a restarted peer is never mistaken for its old self."""
    return f"{node_id}-{uuid.uuid4().hex[:8]}"


def check_cache(kv_cache: torch.Tensor, layout: KVLayout) -> None:
    """Raises ValueError unless kv_cache is the contiguous block-major cache layout describes."""
    if not kv_cache.is_contiguous() or kv_cache.shape[0] != layout.num_blocks:
        raise ValueError(f"kv_cache must be contiguous with {layout.num_blocks} blocks, got {tuple(kv_cache.shape)}")
    if kv_cache[0].numel() != layout.block_numel:
        raise ValueError(f"kv_cache blocks hold {kv_cache[0].numel()} elements, layout says {layout.block_numel}")
    if str(kv_cache.dtype).removeprefix("torch.") != layout.dtype:
        raise ValueError(f"kv_cache dtype is {kv_cache.dtype}, layout says {layout.dtype}")


class KVConnector(ABC):
    """One per engine: registers kv_cache [num_blocks, num_layers, 2, block_size, heads, dim]
    once, serves peers at agent_address ("host:port"), and is driven by its owner's loop
    (not thread-safe: call it from one thread)."""

    config: TransferConfig
    layout: KVLayout
    engine_id: str
    agent_address: str

    # ---- reader side (decode node) ------------------------------------------------------------

    @abstractmethod
    def start_read(self, request_id: str, remote_engine_id: str, remote_address: str,
                   remote_block_ids: list[int], local_block_ids: list[int]) -> None:
        """Queue a read of remote blocks into local blocks, pairwise (same count). Never blocks
        (the first read from a peer handshakes in the background); the outcome comes from
        poll(). The local blocks stay the caller's, who must not free them before that outcome
        or abort_read(). Raises ValueError on unequal counts or a request id already in flight."""

    @abstractmethod
    def poll(self) -> list[ReadResult]:
        """Drive handshakes and transfers; return the reads that finished, failed, or passed
        transfer_timeout_s (failed and cancelled) since the last call, each once. On success
        the holder has been told it may free its blocks; on failure the caller frees its local
        blocks and, if it wants, tells the holder with release_remote()."""

    @abstractmethod
    def abort_read(self, request_id: str) -> None:
        """Cancel a read (no-op if unknown or finished). When this returns nothing writes into
        its local blocks any more, and poll() never reports it: the blocks are the caller's.
        The holder is not told: call release_remote() for that."""

    @abstractmethod
    def release_remote(self, request_id: str, remote_engine_id: str, remote_address: str) -> None:
        """Tell the holder it may free the request's blocks: they will not be read (request
        rejected, aborted, or its read failed). Fire and forget; never blocks."""

    @property
    @abstractmethod
    def num_reads_in_flight(self) -> int:
        """Reads started and not yet reported or aborted."""

    # ---- holder side (prefill node) -----------------------------------------------------------

    @abstractmethod
    def poll_released(self) -> list[str]:
        """Request ids whose blocks a reader has read or released since the last call: the
        caller frees those blocks (a request id the caller no longer leases is to be ignored)."""

    @abstractmethod
    def close(self) -> None:
        """Abort reads in flight, deregister the cache, stop serving. Idempotent enough to call
        from a finalizer; the cache tensor is the caller's again afterwards."""
