"""kv_transfer's exceptions: each names the request or peer and the values involved."""


class KVTransferError(Exception):
    """Base of every kv_transfer error."""


class LayoutMismatch(KVTransferError):
    """The two sides' KV layouts cannot exchange blocks."""


class HandshakeFailed(KVTransferError):
    """The peer's side channel did not answer in time or answered with an error."""


class TransferFailed(KVTransferError):
    """A block read failed (peer died, transport error)."""


class TransferTimeout(TransferFailed):
    """A block read did not finish within transfer_timeout_s."""


class LeaseExpired(KVTransferError):
    """Blocks held for a pull were freed because nobody read them in time."""
