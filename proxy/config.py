"""ProxyConfig: the proxy's settings, built once by `pdserve proxy` and passed down."""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass, field

from engine.protocol import MIN_CLUSTER_SECRET_CHARS


class RoutingPolicy(enum.StrEnum):
    """How the proxy picks nodes (proxy.routing)."""

    CACHE_AWARE = "cache-aware"  # longest cached prefix balanced against load
    LEAST_LOADED = "least-loaded"  # prefill: fewest queued prompt tokens; decode: most free blocks
    ROUND_ROBIN = "round-robin"  # each kind's nodes in turn (among those that take requests)


@dataclass(frozen=True)
class ProxyConfig:
    model_dir: str  # tokenizer.json, tokenizer_config.json, config.json, generation_config.json
    served_model_name: str  # the only model name requests may use
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_addresses: tuple[str, ...] = ()  # HOST:PORT of prefill nodes; none: colocated mode
    decode_addresses: tuple[str, ...] = ()  # HOST:PORT of decode (or colocated) nodes
    # Discovery (proxy.discovery): names re-resolved every discovery_interval_s (each A record a
    # node), a YAML/JSON file re-read when it changes; nodes join and leave without a restart.
    prefill_dns: tuple[str, ...] = ()  # HOST:PORT
    decode_dns: tuple[str, ...] = ()
    nodes_file: str | None = None
    discovery_interval_s: float = 5.0
    # The admin endpoint (/admin/nodes: list, add, drain, remove) needs "Authorization: Bearer
    # <admin_token>"; None: served only on a loopback proxy (unauthenticated), else not at all.
    admin_token: str | None = field(default=None, repr=False)
    # Longest wait for a prompt's first token (queueing and prefill), and for a decoding request's
    # next tokens; past either the node is given up on (the request is retried or migrated
    # elsewhere, within max_attempts and max_migrations, else it ends with a 504 or an SSE error
    # event). NOTE: one engine step takes up to ~6 s on one core (see stall_timeout_s), so 30 s
    # between tokens is five steps' silence; 60 s before the first token covers a 10,000-token
    # prefill on one core (five 2,048-token chunks, ~30 s) and as long again queued. Longer
    # prompts on slower nodes need more.
    request_timeout_s: float = 30.0
    first_token_timeout_s: float = 60.0
    heartbeat_timeout_s: float = 3.0  # a node silent this long is down: no new requests, its own fail
    # A node whose loop made no progress for this long while it had work is stuck (its heartbeat
    # thread may still report): down, its requests failed over. One engine step of the small
    # preset takes up to ~6 s on one core (a 2,048-token prefill chunk): well past that.
    stall_timeout_s: float = 20.0
    # Sends of a request before its first token (a node failed, timed out, drained or was full:
    # another one is tried), and moves of a request to another decode node after tokens were
    # streamed; past either, its error reaches the client.
    max_attempts: int = 3
    max_migrations: int = 2
    # A prompt is prefilled only once a decode node can take it: while none can (all starting,
    # down, or of another KV layout), it waits this long, then gets a 503 naming why.
    decode_wait_s: float = 10.0
    # On SIGTERM: no new requests (503, /ready 503), open streams get this long to finish, then
    # end with an error event and [DONE]; then the proxy exits.
    drain_timeout_s: float = 30.0
    api_key: str | None = None  # set: /v1/ needs "Authorization: Bearer <api_key>"
    max_model_len: int | None = None  # None: the nodes' reports, else config.json max_position_embeddings
    # Conditional disaggregation: a prompt is prefilled on its decode node instead when the
    # prefill pool's estimated queue wait is at least local_prefill_min_wait_s and the decode
    # node's own wait, times local_prefill_penalty (its decodes slow down meanwhile), is shorter.
    # None: always the prefill pool.
    local_prefill_min_wait_s: float | None = 1.0
    local_prefill_penalty: float = 2.0
    # KV streaming: a prompt of at least kv_stream_min_tokens tokens that its prefill node runs in
    # several chunks is read by its decode node chunk by chunk while it is prefilled (the decode
    # node is picked, and takes the prompt's blocks, at the first chunk). None: never; the whole
    # prompt's KV is read once it is prefilled.
    kv_stream_min_tokens: int | None = 0
    # Routing (proxy.routing): cache-aware sends a prompt to the prefill node with the lowest
    # uncached prompt tokens + queued prefill tokens, passing over nodes queued more than
    # routing_max_extra_prefill_tokens past the least queued one, and to the decode node caching
    # the longest prefix of it among those within routing_max_extra_decode_requests requests of
    # the least loaded one. least-loaded and round-robin ignore caches (for comparison).
    routing: RoutingPolicy = RoutingPolicy.CACHE_AWARE
    routing_max_extra_prefill_tokens: int = 2048
    routing_max_extra_decode_requests: int = 8
    chat_template_path: str | None = None  # a Jinja file replacing the model's chat template(s)
    # NOTE: rendering a 1,000-message conversation (~60k tokens) with SmolLM2's template takes
    # 5-11 ms, 10,000 messages ~100 ms; a template still running after 1 s is looping, and is
    # stopped with a 400 (the stop lands within ~20 ms of the deadline).
    chat_template_timeout_s: float = 1.0
    # Requests may bring their own chat_template (vLLM's --trust-request-chat-template): off, as
    # there, since a template runs code of the client's choosing in the proxy (sandboxed, bounded).
    trust_request_chat_template: bool = False
    # Unknown top-level fields of a completion body are ignored, as vLLM ignores them, and named in
    # the Pdserve-Ignored-Fields response header and a WARNING line (once per distinct set); True:
    # refused with a 400 naming them. vLLM fields that cannot be honoured are refused either way.
    strict_fields: bool = False
    # /metrics also carries every node's vllm:* series, read from the nodes at each scrape
    # (proxy.node_metrics). Off where something scrapes the nodes themselves (no double counts).
    node_metrics: bool = True
    # Shared with every node: the proxy's sockets then speak CURVE with keys derived from it and
    # reach only nodes holding it. None: the proxy and its nodes must all be on loopback.
    cluster_secret: str | None = field(default=None, repr=False)
    # Overload control (proxy.admission): a request past a limit gets a 429 with Retry-After at
    # once; nothing queues in the proxy. Choices (prompts x n) held at once, each a request on
    # the nodes. With max_body_bytes this bounds the memory requests take in the proxy.
    max_num_requests: int = 1024
    max_queue_wait_s: float | None = None  # refuse a request whose estimated queue wait is longer; None: off
    slo_ttft_ms: float | None = None  # refuse a request whose predicted TTFT misses this; None: off
    # A node with this many queued requests is full (as one with no free KV block while any
    # queue): no new requests go there, and a request that no node can take gets a 429. None:
    # only the KV blocks count.
    max_node_waiting: int | None = None
    # HTTP input: bodies past max_body_bytes get a 413 (8 MiB holds a ~2M-token prompt as text),
    # a body still arriving after body_timeout_s a 408.
    max_body_bytes: int = 8 << 20
    body_timeout_s: float = 30.0
    # A body must bring min_upload_bytes_per_s * upload_rate_window_s bytes in each window of
    # upload_rate_window_s from its start, else a 408 closes its connection: a stalled or trickled
    # upload is cut within one to two windows (Kestrel's minimum is 240 B/s after a 5 s grace).
    # None: only body_timeout_s.
    min_upload_bytes_per_s: float | None = 1024.0
    upload_rate_window_s: float = 5.0
    # Each connection (proxy.connection_guard): a request's headers must arrive whole within
    # header_timeout_s (of the connection's start for its first request; 8 KiB of headers at the
    # minimum upload rate take 8 s), and one with no request in progress closes after
    # keep_alive_timeout_s (uvicorn's default; the openai client's httpx pool keeps 5 s too).
    header_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 5.0
    # Per client (its address, proxy.clients): bodies arriving at once, and choices held (of
    # max_num_requests); past either it gets a 429 naming the cap while other clients go on.
    # None: no cap. NOTE: a deployment whose clients all come through one gateway address
    # should raise max_client_requests to max_num_requests.
    max_client_uploads: int | None = 32
    max_client_requests: int | None = 512
    # /health, /metrics and error messages name nodes "prefill0", "decode1", ...; True: by address.
    expose_node_addresses: bool = False

    def __post_init__(self) -> None:
        if not (self.decode_addresses or self.decode_dns or self.nodes_file):
            raise ValueError("no decode node: give --decode, --decode-dns or --nodes-file")
        for address in (*self.prefill_addresses, *self.decode_addresses, *self.prefill_dns, *self.decode_dns):
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"node address must be HOST:PORT, got {address!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.local_prefill_min_wait_s is not None and self.local_prefill_min_wait_s < 0:
            raise ValueError(f"local_prefill_min_wait_s must be >= 0, got {self.local_prefill_min_wait_s}")
        if self.max_attempts < 1 or self.max_migrations < 0:
            raise ValueError(f"max_attempts must be >= 1 and max_migrations >= 0, got {self.max_attempts} and "
                             f"{self.max_migrations}")
        if self.kv_stream_min_tokens is not None and self.kv_stream_min_tokens < 0:
            raise ValueError(f"kv_stream_min_tokens must be >= 0, got {self.kv_stream_min_tokens}")
        if self.local_prefill_penalty < 1:
            raise ValueError(f"local_prefill_penalty must be >= 1, got {self.local_prefill_penalty}")
        self._check_routing()
        for name in ("request_timeout_s", "first_token_timeout_s", "heartbeat_timeout_s", "chat_template_timeout_s",
                     "decode_wait_s",
                     "body_timeout_s", "stall_timeout_s", "drain_timeout_s", "discovery_interval_s",
                     "upload_rate_window_s", "header_timeout_s", "keep_alive_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        self._check_limits()
        self._check_trust()

    def _check_routing(self) -> None:
        if self.routing not in tuple(RoutingPolicy):
            raise ValueError(f"routing must be one of {', '.join(RoutingPolicy)}, got {self.routing!r}")
        for name in ("routing_max_extra_prefill_tokens", "routing_max_extra_decode_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def _check_limits(self) -> None:
        for name in ("max_num_requests", "max_body_bytes", "max_node_waiting", "max_client_uploads",
                     "max_client_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("max_queue_wait_s", "slo_ttft_ms", "min_upload_bytes_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    def _check_trust(self) -> None:
        """Without a cluster secret the nodes stay on this machine (loopback only). The proxy's own
        HTTP port may face anything (a container publishes it): guarding it is the API key's job."""
        if self.cluster_secret is not None:
            if len(self.cluster_secret) < MIN_CLUSTER_SECRET_CHARS:
                raise ValueError(f"cluster_secret must have at least {MIN_CLUSTER_SECRET_CHARS} characters, "
                                 f"got {len(self.cluster_secret)}")
            return
        remote = [a for a in (*self.prefill_addresses, *self.decode_addresses)
                  if not is_loopback_host(a.rpartition(":")[0])]
        if remote:
            raise ValueError(f"node {remote[0]} is not on loopback: set a cluster secret (--cluster-secret or "
                             f"PDSERVE_CLUSTER_SECRET) to reach nodes beyond this machine")


def is_loopback_host(host: str) -> bool:
    """Whether host (a name, an address, or a [bracketed] IPv6 address) is loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
