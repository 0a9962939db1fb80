"""The handshake's rules, the same for every backend: what a holder refuses, and by which code;
how a reader checks the reply and which error it raises (LayoutMismatch or HandshakeFailed)."""

from __future__ import annotations

from kv_transfer.errors import HandshakeFailed, KVTransferError, LayoutMismatch
from kv_transfer.layout import KVLayout, check_compatible
from kv_transfer.messages import (
    SIDE_CHANNEL_VERSION,
    Ack,
    BackendInfo,
    HandshakeErrorCode,
    HandshakeRefusal,
    Hello,
    HelloReply,
    SideMessage,
)


def refusal_for(hello: Hello, backend: str, layout: KVLayout,
                reader_info_type: type[BackendInfo] | None) -> HandshakeRefusal | None:
    """Holder side: why hello is refused (version, backend, the reader's backend info, which
    must be of reader_info_type, or None when that is None; layout), or None to accept it."""
    if hello.version != SIDE_CHANNEL_VERSION:
        return HandshakeRefusal(HandshakeErrorCode.VERSION_MISMATCH,
                                f"side channel version mismatch: local {SIDE_CHANNEL_VERSION}, remote {hello.version}")
    if hello.backend != backend:
        return HandshakeRefusal(HandshakeErrorCode.BACKEND_MISMATCH,
                                f"backend mismatch: local {backend!r}, remote {hello.backend!r}")
    if not is_info_of(hello.backend_info, reader_info_type):
        return HandshakeRefusal(HandshakeErrorCode.BAD_BACKEND_INFO,
                                f"{backend} hello from {hello.engine_id!r} carries {_type_name(hello.backend_info)}, "
                                f"expected {_type_name(reader_info_type)}")
    try:
        check_compatible(layout, hello.layout)
    except LayoutMismatch as exc:
        return HandshakeRefusal(HandshakeErrorCode.LAYOUT_MISMATCH, str(exc))
    return None


def check_reply(reply: SideMessage, address: str, layout: KVLayout,
                holder_info_type: type[BackendInfo] | None) -> HelloReply:
    """Reader side: reply, when it accepts our Hello with layout-compatible, well-typed details.
    Raises LayoutMismatch if the layouts differ (the holder's refusal or our own check), and
    HandshakeFailed for any other refusal or an answer that is no proper HelloReply."""
    if not isinstance(reply, HelloReply):
        detail = f": {reply.error}" if isinstance(reply, Ack) and reply.error else ""
        raise HandshakeFailed(f"KV side channel {address} answered {type(reply).__name__}{detail}")
    if reply.refusal is not None:
        raise error_for(reply.refusal)
    if reply.version != SIDE_CHANNEL_VERSION:
        raise HandshakeFailed(f"{address} accepted with side channel version {reply.version}, "
                              f"local {SIDE_CHANNEL_VERSION}")
    if not is_info_of(reply.backend_info, holder_info_type):
        raise HandshakeFailed(f"{address} answered with {_type_name(reply.backend_info)}, "
                              f"expected {_type_name(holder_info_type)}")
    check_compatible(layout, reply.layout)
    return reply


def error_for(refusal: HandshakeRefusal) -> KVTransferError:
    """The exception a reader raises for a holder's refusal, chosen by its code."""
    if refusal.code is HandshakeErrorCode.LAYOUT_MISMATCH:
        return LayoutMismatch(refusal.message)
    return HandshakeFailed(refusal.message)


def is_info_of(info: BackendInfo | None, expected: type[BackendInfo] | None) -> bool:
    """Whether info is of the expected backend-info type (absent when expected is None)."""
    return info is None if expected is None else isinstance(info, expected)


def _type_name(info_or_type: object) -> str:
    if info_or_type is None:
        return "no backend info"
    return info_or_type.__name__ if isinstance(info_or_type, type) else type(info_or_type).__name__
