"""Every message that crosses a process boundary (proxy <-> nodes), defined once.

msgspec structs encoded as msgpack with a type tag. This module imports no torch, so the proxy
can import it cheaply. Bump PROTOCOL_VERSION on any incompatible change.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 2


class SamplingOptions(msgspec.Struct, frozen=True, omit_defaults=True):
    """Per-request sampling settings as they travel between processes (validated by the proxy,
    validated again by the engine's SamplingParams)."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; N >= 0: the chosen token's plus the top N


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A sampled token, with its log-probability and the top-N alternatives as
    (token_id, logprob) when the request asked for logprobs (logprob None otherwise)."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] = []


class KVHandle(msgspec.Struct, frozen=True):
    """Where a finished prompt's KV blocks live on a prefill node, held there on a lease."""

    engine_id: str
    agent_address: str  # host:port of the prefill node's KV side channel
    block_ids: list[int]
    num_tokens: int


# ---- proxy -> node ----------------------------------------------------------------------------


class PrefillRequest(msgspec.Struct, tag="prefill_request", frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    sent_at: float = 0.0  # time.time() at the proxy, for queueing metrics
    seq: int = 0  # the proxy's count of requests sent to this node; echoed in LoadReport


class DecodeRequest(msgspec.Struct, tag="decode_request", frozen=True):
    """A request for a decode node. With kv_handle set, the prompt's KV is pulled from the
    prefill node and first_token continues it; with kv_handle None, the node prefills locally
    (colocated mode or fallback) and first_token must be None."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    first_token: TokenLogprob | None = None
    kv_handle: KVHandle | None = None
    sent_at: float = 0.0
    seq: int = 0  # as PrefillRequest.seq


class Abort(msgspec.Struct, tag="abort", frozen=True):
    request_ids: list[str]


class ReleaseKV(msgspec.Struct, tag="release_kv", frozen=True):
    """Proxy -> prefill node: free a lease whose request will never be pulled (the decode side
    was never reached). The normal release is the decode side's read-done notice."""

    request_ids: list[str]


# ---- node -> proxy ----------------------------------------------------------------------------


class PrefillResult(msgspec.Struct, tag="prefill_result", frozen=True):
    """The first token of a prompt. finish_reason is set when that token already ends the
    request (max_tokens 1, a stop token): then kv_handle is None and no lease is held."""

    request_id: str
    first_token: TokenLogprob
    num_prompt_tokens: int
    kv_handle: KVHandle | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0


class RequestDelta(msgspec.Struct, frozen=True, array_like=True):
    """New tokens of one request since the last TokenBatch; finish_reason set on the last."""

    request_id: str
    tokens: list[TokenLogprob]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


class TokenBatch(msgspec.Struct, tag="token_batch", frozen=True):
    """One engine step's output for all of its requests that produced tokens."""

    deltas: list[RequestDelta]


class ErrorReply(msgspec.Struct, tag="error", frozen=True):
    """A request failed on a node. is_client_error: the request itself was bad (a 4xx at the
    proxy); otherwise the node failed it (5xx). The node has freed its blocks."""

    request_id: str
    kind: str  # the exception class name
    message: str
    is_client_error: bool = False


class LoadReport(msgspec.Struct, tag="load_report", frozen=True):
    """Periodic load of a node; also its heartbeat. last_request_seq is the seq of the last
    request the node received from the proxy it reports to: the counts here include that
    request and every one before it (one connection delivers in order)."""

    node_id: str
    role: str  # "prefill" | "decode" | "both"
    protocol_version: int
    model_name: str
    max_model_len: int
    num_running: int
    num_waiting: int
    num_queued_prompt_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    num_prefix_cache_hits: int = 0
    num_pending_pulls: int = 0
    num_leases: int = 0
    num_kv_fallbacks: int = 0
    sent_at: float = 0.0
    last_request_seq: int = 0
    prefill_tokens_per_s: float = 0.0  # measured prefill throughput; 0: not measured yet


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """Proxy -> node: ask for a LoadReport now (used at start-up and by /health)."""


ToNode = PrefillRequest | DecodeRequest | Abort | ReleaseKV | Ping
FromNode = PrefillResult | TokenBatch | ErrorReply | LoadReport

_encoder = msgspec.msgpack.Encoder()
_to_node_decoder = msgspec.msgpack.Decoder(ToNode)
_from_node_decoder = msgspec.msgpack.Decoder(FromNode)


def encode(message: ToNode | FromNode) -> bytes:
    return _encoder.encode(message)


def decode_to_node(data: bytes) -> ToNode:
    """Decode a proxy -> node message; raises msgspec.ValidationError/DecodeError if malformed."""
    return _to_node_decoder.decode(data)


def decode_from_node(data: bytes) -> FromNode:
    """Decode a node -> proxy message; raises msgspec.ValidationError/DecodeError if malformed."""
    return _from_node_decoder.decode(data)
