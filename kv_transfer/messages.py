"""Every message on the KV side channel, as tagged msgspec structs (torch-free, cheap to import).

SIDE_CHANNEL_VERSION covers all of them; peers compare it once, in the handshake.
"""

from __future__ import annotations

import enum

import msgspec

from kv_transfer.layout import KVLayout

# 1: the unversioned handshake with an untyped `extra` dict. 2: typed backend info, refusals
# by code. Bump on any change an older peer could not decode or would misread.
SIDE_CHANNEL_VERSION = 2


class HandshakeErrorCode(str, enum.Enum):
    """Why a holder refused a Hello; the reader raises LayoutMismatch for LAYOUT_MISMATCH and
    HandshakeFailed for the rest."""

    VERSION_MISMATCH = "version_mismatch"
    BACKEND_MISMATCH = "backend_mismatch"
    LAYOUT_MISMATCH = "layout_mismatch"
    BAD_BACKEND_INFO = "bad_backend_info"  # the Hello lacks the backend's info or has another's


class HandshakeRefusal(msgspec.Struct, tag="handshake_refusal", frozen=True):
    code: HandshakeErrorCode
    message: str  # names both sides' values


class NixlAgentInfo(msgspec.Struct, tag="nixl_agent_info", frozen=True):
    """What a reader needs to READ a holder's cache: its agent and the registered region."""

    agent_metadata: bytes
    base_address: int
    block_bytes: int
    num_blocks: int
    device_id: int
    mem_type: str  # NIXL's memory type: "DRAM" or "VRAM"


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


class Release(msgspec.Struct, tag="release", frozen=True):
    """The reader is done with these requests' blocks (read, or never to be read)."""

    request_ids: list[str]


class ReadRequest(msgspec.Struct, tag="read_request", frozen=True):
    """gloo: please send these blocks to me under this tag."""

    engine_id: str
    request_id: str
    block_ids: list[int]
    tag: int


class Ack(msgspec.Struct, tag="ack", frozen=True):
    """The answer to a message the server could not handle (error says why), for logs only."""

    error: str | None = None


SideMessage = Hello | HelloReply | Release | ReadRequest | Ack
