"""PrefixDigests: what a node tells proxies about its prefix cache, for cache-aware routing.

The digest (protocol.PrefixCacheDigest: the keys of the cached blocks, most recently used first,
at most MAX_DIGEST_BLOCKS) is rebuilt by the node's loop at most once per min_interval_s when the
cache changed, and every resend_interval_s regardless (the recency order moves without the set
changing). Each proxy gets it in a LoadReport when it has not seen that version yet, and again
resend_interval_s after the last time, so a proxy that connects later learns it; reports in
between carry None (a digest is ~33 KB at its bound: not for every 0.25 s heartbeat).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from engine import protocol
from engine.engine import LLMEngine

# NOTE: a digest at most once a second per proxy bounds its cost (~33 KB at 4,096 keys) to a
# few percent of a loopback link's idle capacity and its build (~1 ms per 4k blocks) to the loop.
MIN_INTERVAL_S = 1.0
RESEND_INTERVAL_S = 5.0


class PrefixDigests:
    """refresh() from the node's loop; due_for() from any thread (the heartbeat's, the loop's)."""

    def __init__(self, engine: LLMEngine, clock: Callable[[], float] = time.monotonic,
                 min_interval_s: float = MIN_INTERVAL_S, resend_interval_s: float = RESEND_INTERVAL_S) -> None:
        self._engine = engine
        self._clock = clock
        self.min_interval_s = min_interval_s
        self.resend_interval_s = resend_interval_s
        self._lock = threading.Lock()
        self._digest: protocol.PrefixCacheDigest | None = None
        self._built_at = float("-inf")
        self._sent: dict[bytes, tuple[int, float]] = {}  # proxy -> (version, when) it last got

    @property
    def is_enabled(self) -> bool:
        return self._engine.config.enable_prefix_caching

    def refresh(self) -> None:
        """Rebuild the digest if it is due (the loop's thread: it reads the engine)."""
        if not self.is_enabled:
            return
        now = self._clock()
        since = now - self._built_at
        current = self._digest
        changed = current is None or current.version != self._engine.block_pool.cache_version
        if since < self.min_interval_s or (not changed and since < self.resend_interval_s):
            return
        version, keys = self._engine.prefix_cache_keys(protocol.MAX_DIGEST_BLOCKS)
        with self._lock:
            self._digest = protocol.PrefixCacheDigest(version, keys)
            self._built_at = now

    def due_for(self, identity: bytes) -> protocol.PrefixCacheDigest | None:
        """The digest if the proxy at identity is due one (and record it as sent), else None."""
        now = self._clock()
        with self._lock:
            digest = self._digest
            if digest is None:
                return None
            sent = self._sent.get(identity)
            if sent is not None and sent[0] == digest.version and now - sent[1] < self.resend_interval_s:
                return None
            self._sent[identity] = (digest.version, now)
            return digest

    def forget(self, identity: bytes) -> None:
        with self._lock:
            self._sent.pop(identity, None)
