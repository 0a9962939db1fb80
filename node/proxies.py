"""ProxyTable: the proxies a node serves and the requests each of them owns."""

from __future__ import annotations

import time
from collections.abc import Callable


class ProxyTable:
    """When each proxy (by its socket identity) was last heard from, the seq of its last
    request (echoed in its LoadReports), and the owner of each request in flight here. The
    node's loop owns it (not thread-safe; the heartbeat thread reads snapshots)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last_heard: dict[bytes, float] = {}
        self.last_request_seqs: dict[bytes, int] = {}
        self._owners: dict[str, bytes] = {}

    def heard(self, identity: bytes) -> None:
        """A valid message came from identity: it is alive and gets LoadReports."""
        self._last_heard[identity] = self._clock()
        self.last_request_seqs.setdefault(identity, 0)

    def own(self, request_id: str, identity: bytes, seq: int) -> None:
        self._owners[request_id] = identity
        self.last_request_seqs[identity] = seq

    def owner(self, request_id: str) -> bytes | None:
        return self._owners.get(request_id)

    def forget(self, request_id: str) -> bytes | None:
        """Stop tracking a request; returns its owner (None if unknown)."""
        return self._owners.pop(request_id, None)

    def owned_by(self, identity: bytes) -> list[str]:
        return [rid for rid, owner in self._owners.items() if owner == identity]

    def forgive(self, seconds: float) -> None:
        """The node's own loop was away for seconds (a long step, a stall): that time does not
        count as the proxies' silence (what they sent meanwhile waits unread in the socket)."""
        for identity in self._last_heard:
            self._last_heard[identity] += seconds

    def pop_silent(self, timeout_s: float) -> list[bytes]:
        """Proxies not heard from for timeout_s: dropped here (no more reports); the caller
        ends their requests."""
        now = self._clock()
        silent = [identity for identity, at in self._last_heard.items() if now - at > timeout_s]
        for identity in silent:
            self.drop(identity)
        return silent

    def drop(self, identity: bytes) -> None:
        self._last_heard.pop(identity, None)
        self.last_request_seqs.pop(identity, None)


def short_id(identity: bytes) -> str:
    """A proxy's socket identity for logs."""
    return identity.hex()[:12]
