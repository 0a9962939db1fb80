"""kv_transfer's exceptions: each names the request or peer and the values involved."""


class KVTransferError(Exception):
    """Base of every kv_transfer error."""


class LayoutMismatch(KVTransferError):
    """The two sides' KV layouts cannot exchange blocks (found locally, or the holder's refusal
    with code LAYOUT_MISMATCH)."""


class HandshakeFailed(KVTransferError):
    """The peer's side channel did not answer in time, answered with something but an accepting
    HelloReply, or refused the handshake for a reason other than the layout (its code)."""


class TransferFailed(KVTransferError):
    """A block read failed (peer died, transport error)."""

