"""ServerConfig: what every node kind's server is configured with (address, trust, timeouts,
admission bounds), checked once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_transfer.security import CurveKeys, check_bind_host


@dataclass(frozen=True)
class ServerConfig:
    node_id: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    load_report_interval_s: float = 0.25
    # A proxy heard from neither by message nor by ping for this long is gone: its requests are
    # aborted and their blocks and leases freed. Proxies ping every node at least every second.
    orphan_timeout_s: float = 10.0
    # Longest wait for a proxy to take a frame (its queue full) before its requests are ended.
    send_timeout_s: float = 5.0
    # The cluster's CURVE keys (engine.protocol.curve_keys): only holders of the secret connect.
    # None: no secret, and host must be loopback.
    curve_keys: CurveKeys | None = field(default=None, repr=False)
    # Port of the HTTP /health and /ready endpoint for orchestrators (on host); 0: none.
    health_port: int = 0
    # Longest a drain (SIGTERM) waits for running requests and unpulled leases before the node
    # stops anyway (what is left is aborted with the process).
    drain_timeout_s: float = 60.0
    # Bounded waiting queue: a new request is refused (ErrorReply kind QUEUE_FULL_ERROR_KIND,
    # which the proxy retries on another node) while this many wait here (not yet running: in the
    # scheduler's queue, or for a KV pull). Each proxy bounds what it sends; this bounds what
    # several proxies together can queue on one node.
    max_num_waiting: int = 1024
    # Structured requests' grammars compile on this many threads, off the loop (node.grammar_gate);
    # one compile may take grammar_compile_timeout_s (then its schema is refused, a 400), and may
    # wait as long for a free thread (then the request is refused as QueueFull, to retry elsewhere).
    grammar_threads: int = 2
    grammar_compile_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_num_waiting", "grammar_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("port", "health_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65536), got {getattr(self, name)}")
        for name in ("load_report_interval_s", "orphan_timeout_s", "send_timeout_s", "drain_timeout_s",
                     "grammar_compile_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        check_bind_host(self.host, self.curve_keys, "node")
