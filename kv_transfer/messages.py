"""Every message on the KV side channel, as tagged msgspec structs (torch-free, cheap to import).

SIDE_CHANNEL_VERSION covers all of them: every frame opens with it (kv_transfer.side_channel
refuses frames of another version), and the handshake compares it once more by code.
"""

from __future__ import annotations

import enum

import msgspec

from kv_transfer.layout import KVLayout

# 1: the unversioned handshake with an untyped `extra` dict. 2: typed backend info, refusals
# by code. 3: a version header on every frame; leases with generations (renewed, confirmed
# after a read, released by generation). 4: NIXL's holder info describes its cache's layout
# (block and layer strides: CPU caches are layer-major). 5: a cache per tensor-parallel rank (the
# layout's kv_head_ranges, NIXL's regions per rank). Bump on any change an older peer could not
# decode or would misread.
SIDE_CHANNEL_VERSION = 5


class HandshakeErrorCode(enum.StrEnum):
    """Why a holder refused a Hello; the reader raises LayoutMismatch for LAYOUT_MISMATCH and
    HandshakeFailed for the rest."""

    VERSION_MISMATCH = "version_mismatch"
    BACKEND_MISMATCH = "backend_mismatch"
    LAYOUT_MISMATCH = "layout_mismatch"
    BAD_BACKEND_INFO = "bad_backend_info"  # the Hello lacks the backend's info or has another's


class HandshakeRefusal(msgspec.Struct, tag="handshake_refusal", frozen=True):
    code: HandshakeErrorCode
    message: str  # names both sides' values


class NixlShardInfo(msgspec.Struct, frozen=True, array_like=True):
    """One rank's registered cache: block b's layer l is layer_bytes at base_address + b *
    block_stride + l * layer_stride (kv_transfer.shards.ShardRegions), holding KV heads
    [kv_head_start, kv_head_stop) of the model."""

    base_address: int
    block_stride: int
    layer_stride: int
    layer_bytes: int
    kv_head_start: int
    kv_head_stop: int
    device_id: int


class CudaIpcCache(msgspec.Struct, frozen=True):
    """A holder's GPU tensor (its cache, or the probe a reader on another GPU checks first) as a
    process on the same host maps it (kv_transfer.cuda_ipc): torch's CUDA IPC sharing of its memory,
    and the tensor's view of it."""

    gpu_uuid: str
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    shape: list[int]
    stride: list[int]
    storage_offset: int
    dtype: str  # torch's name: "bfloat16", "float32", ...
    host_id: str = ""  # kv_transfer.cuda_ipc.host_id() ("": an older holder's, which offers to its GPU only)


class NixlAgentInfo(msgspec.Struct, tag="nixl_agent_info", frozen=True):
    """What a reader needs to READ a holder's cache: its agent and every rank's registered region;
    caches on GPUs are also offered over CUDA IPC to readers on the same host, with a probe tensor of
    known bytes on each of their GPUs that a reader on another GPU copies first (an older reader
    ignores the fields)."""

    agent_metadata: bytes
    shards: list[NixlShardInfo]
    num_blocks: int
    mem_type: str  # NIXL's memory type: "DRAM" or "VRAM"
    cuda_ipc: CudaIpcCache | None = None  # a cache of one rank (an older reader takes only this)
    cuda_ipc_probe: CudaIpcCache | None = None
    cuda_ipc_shards: list[CudaIpcCache] = []  # every rank's cache, in the order of shards
    cuda_ipc_probes: list[CudaIpcCache] = []  # a probe on each GPU the caches are on


class GlooStoreInfo(msgspec.Struct, tag="gloo_store_info", frozen=True):
    """The TCPStore a gloo reader hosts for the pair's process group."""

    store_host: str
    store_port: int


BackendInfo = NixlAgentInfo | GlooStoreInfo


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """A reader's first message to a holder; answered by a HelloReply."""

    version: int
    engine_id: str
    layout: KVLayout
    backend: str
    backend_info: BackendInfo | None = None  # what the holder needs from this reader, if anything


class HelloReply(msgspec.Struct, tag="hello_reply", frozen=True):
    version: int
    engine_id: str
    layout: KVLayout
    backend: str
    refusal: HandshakeRefusal | None = None  # set when the holder refused the Hello
    backend_info: BackendInfo | None = None  # what the reader needs to read from this holder


class LeaseRef(msgspec.Struct, frozen=True, array_like=True):
    """One lease on a holder: the request it holds blocks for and its generation there."""

    request_id: str
    generation: int


class RenewLeases(msgspec.Struct, tag="renew_leases", frozen=True):
    """Reader -> holder engine_id: keep these leases (the reader still holds their requests).
    No answer; a lease that ended already stays ended."""

    engine_id: str  # the holder's: a restarted holder ignores what was meant for its old self
    leases: list[LeaseRef]


class Release(msgspec.Struct, tag="release", frozen=True):
    """Reader -> holder engine_id: these leases' blocks will not be read (request rejected,
    aborted, or its read failed); the holder may free them. No answer."""

    engine_id: str
    leases: list[LeaseRef]


class ConfirmRead(msgspec.Struct, tag="confirm_read", frozen=True):
    """Reader -> holder engine_id, after its read of the lease's blocks completed: was the
    lease held all along? Ends the lease either way; answered by ReadConfirmed."""

    engine_id: str
    lease: LeaseRef


class ReadConfirmed(msgspec.Struct, tag="read_confirmed", frozen=True):
    """is_held: the lease (request id and generation) was held from its start until this
    answer, so its blocks were never freed or reused during the read; now it has ended. False:
    the read may hold another request's KV and must be discarded."""

    lease: LeaseRef
    is_held: bool


class ReadRequest(msgspec.Struct, tag="read_request", frozen=True):
    """gloo: please send the blocks of this lease to me under this tag."""

    engine_id: str  # the reader's
    lease: LeaseRef
    block_ids: list[int]
    tag: int


class Ack(msgspec.Struct, tag="ack", frozen=True):
    """The answer to a message the server could not handle (error says why), for logs only."""

    error: str | None = None


SideMessage = Hello | HelloReply | RenewLeases | Release | ConfirmRead | ReadConfirmed | ReadRequest | Ack
