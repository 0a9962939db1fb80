"""KVConnector: the interface both nodes use to move paged KV blocks between engines.

Decode side (the reader): hold() keeps a remote lease alive while the node holds its request;
start_read() queues a pull of the lease's blocks into local blocks; poll() drives it and
returns finished or failed reads. A read succeeds only once the holder confirmed that the lease
was held throughout (so the blocks read were never freed or reused); otherwise it fails with
FailureCode.LEASE_LOST and its data must not be used. Prefill side (the holder): serve_leases()
answers renewals, confirmations and releases from the node's LeaseTable. A connector never
allocates or frees engine blocks: the node does, on what these calls return. No call waits on
the network; poll() may copy bytes (a NIXL READ within one host is carried out while it is
posted, about 30 ms per 94 MB).
"""

from __future__ import annotations

import enum
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass

from kv_transfer.config import TransferConfig
from kv_transfer.layout import KVLayout
from kv_transfer.lease import LeaseTable


class FailureCode(enum.Enum):
    """Why a read failed. HANDSHAKE, TRANSFER, TIMEOUT and LEASE_LOST are transient (the node
    may prefill locally instead); LAYOUT_MISMATCH and BAD_BLOCKS mean the two sides cannot or
    must not exchange these blocks at all."""

    HANDSHAKE = "handshake"  # the holder's side channel did not answer, refused, or restarted
    LAYOUT_MISMATCH = "layout_mismatch"
    BAD_BLOCKS = "bad_blocks"  # block ids outside either side's cache
    TRANSFER = "transfer"
    TIMEOUT = "timeout"
    LEASE_LOST = "lease_lost"  # the holder did not confirm the lease after the read
    ABORTED = "aborted"  # a read abort_read() could not stop at once, reported when its transfer ended


class TransferState(enum.Enum):
    """Where one block transfer stands, whatever the backend (each maps its own states to
    these once, where it reads them)."""

    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class ReadResult:
    """One read's outcome. When is_ok is False, error names the request and the cause, failure
    its code, and the local blocks hold nothing the caller may rely on (the caller frees them,
    unless blocks_held: a transfer into them never ended and may still write them, so they must
    stay out of use)."""

    request_id: str
    is_ok: bool
    error: str | None = None
    failure: FailureCode | None = None
    blocks_held: bool = False


@dataclass(frozen=True)
class RemoteLease:
    """A lease on a holder's blocks, as its KV handle names it."""

    engine_id: str
    address: str  # host:port of the holder's side channel
    block_ids: list[int]
    generation: int
    lease_timeout_s: float


def check_read(request_id: str, lease: RemoteLease, local_block_ids: list[int], reads_in_flight) -> None:
    """The start_read contract every connector keeps: raises ValueError on unequal block counts or
    a request id already in reads_in_flight."""
    if len(lease.block_ids) != len(local_block_ids):
        raise ValueError(f"request {request_id}: {len(lease.block_ids)} remote vs "
                         f"{len(local_block_ids)} local blocks")
    if request_id in reads_in_flight:
        raise ValueError(f"request {request_id} already has a read in flight")


def check_address(address: str) -> None:
    """Raises ValueError unless address is HOST:PORT with a port in [1, 65536)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c in host for c in " /;"):
        raise ValueError(f"KV side channel address must be HOST:PORT, got {address!r}")


def new_engine_id(node_id: str) -> str:
    """Unique per process start, so a restarted peer is never mistaken for its old self."""
    return f"{node_id}-{uuid.uuid4().hex[:8]}"


class KVConnector(ABC):
    """One per engine: registers kv_cache [num_blocks, num_layers, 2, block_size, heads, dim] (or
    each tensor-parallel rank's: kv_transfer.shards) once, serves peers at agent_address
    ("host:port"), and is driven by its owner's loop (not thread-safe: call it from one thread)."""

    config: TransferConfig
    layout: KVLayout
    engine_id: str
    agent_address: str

    # ---- reader side (decode node) ------------------------------------------------------------

    @abstractmethod
    def hold(self, request_id: str, lease: RemoteLease) -> None:
        """Keep lease alive (renewed every lease_timeout_s / 3, from a thread of the connector,
        so a long model step does not starve it) until release_remote() or the read's outcome.
        Never blocks. Raises ValueError for a malformed address."""

    @abstractmethod
    def start_read(self, request_id: str, lease: RemoteLease, local_block_ids: list[int],
                   confirm: bool = True) -> None:
        """Queue a read of the lease's blocks into local blocks, pairwise (same count). Never
        blocks (the first read from a peer handshakes in the background); the outcome comes
        from poll(). The local blocks stay the caller's, who must not free them before that
        outcome or abort_read(). Raises ValueError on unequal counts, a malformed address or a
        request id already in flight.

        confirm False: a part of a streamed lease (lease.block_ids some of its blocks). Its
        success is the transfer's alone: the holder is not asked, the lease stays held and
        renewed, and the data read is usable only once a later read of the same lease with
        confirm succeeds (that confirmation covers every part read before it). A failed part
        leaves the lease held too: the caller reads again or calls release_remote()."""

    @abstractmethod
    def poll(self) -> list[ReadResult]:
        """Drive handshakes, transfers and confirmations; return the reads that finished,
        failed, or passed transfer_timeout_s (failed and cancelled) since the last call, each
        once. A failed read whose transfer could not be stopped is reported once it ended, or
        after another transfer_timeout_s with blocks_held. On success the holder confirmed the
        lease and ended it (it frees its blocks); on failure the caller frees its local blocks
        and tells the holder with release_remote(). Either way the lease is no longer renewed
        (except after a part read: see start_read)."""

    @abstractmethod
    def abort_read(self, request_id: str) -> bool:
        """Cancel a read (no-op if unknown or finished). True: nothing writes into its local
        blocks any more, and poll() never reports it: the blocks are the caller's. False: its
        transfer could not be stopped yet and may still write them; poll() reports the read
        (failure ABORTED) once it ended, and only then are they the caller's (never, where that
        result says blocks_held). The holder is not told: call release_remote() for that."""

    @abstractmethod
    def release_remote(self, request_id: str, lease: RemoteLease) -> None:
        """Stop renewing the lease and tell its holder it may free the blocks: they will not be
        read (request rejected, aborted, or its read failed). Fire and forget; never blocks."""

    @property
    @abstractmethod
    def num_reads_in_flight(self) -> int:
        """Reads started and not yet reported or aborted."""

    @property
    def num_rejected_messages(self) -> int:
        """Side-channel messages refused (malformed, unauthenticated, unexpected); see RejectLog."""
        return 0

    def wake_sockets(self) -> list:
        """ZMQ sockets whose next message moves a read on (a confirmation's answer): a caller
        waiting for work may wait on them too, and poll() when one is readable."""
        return []

    @property
    def is_copying(self) -> bool:
        """Whether a read's transfer is a copy under way that no message announces the end of and
        that ends within microseconds (kv_transfer.cuda_ipc): the caller polls again at once."""
        return False

    # ---- holder side (prefill node) -----------------------------------------------------------

    @abstractmethod
    def serve_leases(self, leases: LeaseTable) -> None:
        """Answer readers' renewals, confirmations and releases from leases (from another
        thread: LeaseTable is thread-safe). Leases ended for readers wait in
        leases.pop_ended() for the caller to free their blocks. Until called, every read of
        this holder fails with LEASE_LOST."""

    @abstractmethod
    def close(self) -> None:
        """Abort reads in flight, deregister the cache, stop serving. Idempotent enough to call
        from a finalizer; the cache tensor is the caller's again afterwards."""
