"""Every message that crosses a process boundary (proxy <-> nodes), defined once (the ranges
both sides check their sampling options against: engine.sampling_rules).

msgspec structs encoded as msgpack with a type tag, each frame opening with the protocol
version (a frame of another version is refused before it is decoded). This module imports no
torch, so the proxy can import it cheaply. Bump PROTOCOL_VERSION on any incompatible change.
Also here: the cluster's CURVE keys, derived from the shared secret (curve_keys).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from dataclasses import dataclass, field

import msgspec

# 5: a version header on every frame, RequestDelta.first_token_idx and kv, KVHandle.generation
# and lease_timeout_s, LoadReport.kv_layout and per-reason fallbacks.
# 6: DecodeRequest.output_token_ids (migration: a node of version 5 would ignore them and restart
# the output), LoadReport.boot_id, progress and is_draining, ErrorReply kind "Draining".
# 7: LoadReport prefix-cache fields (PrefixCacheDigest, hit counters); the Drain admin message;
# ErrorReply kind "QueueFull" and LoadReport.max_num_waiting (a node's bounded waiting queue);
# more 7-era additions are listed where they are defined.
# 8: StructuredKind regex, choice and ebnf (StructuredOutput.regex, choices, grammar): a node of
# version 7 could not decode them.
# 9: KV streaming: PrefillRequest.stream_kv, KVProgress both ways, DecodeRequest with a handle and
# no first token (the prompt's KV still being written).
PROTOCOL_VERSION = 9
_FRAME_MAGIC = b"PD"
_FRAME_HEADER = _FRAME_MAGIC + PROTOCOL_VERSION.to_bytes(2, "big")
# NOTE: the largest proxy -> node message a node takes: a 128k-token prompt is ~640 KB of
# msgpack, a json_schema at most 64 KiB; anything near this bound is not a request.
MAX_MESSAGE_BYTES = 16 << 20

class Role(enum.StrEnum):
    """What a node (and its engine) does. PREFILL: each request stops after its first token and
    its blocks go to a lease. DECODE: pulls prompts' KV from prefill nodes and decodes them
    (prefilling locally when told to or when a pull fails). COLOCATED: prefills and decodes
    everything itself."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class StructuredKind(enum.StrEnum):
    """What grammar a StructuredOutput asks for."""

    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format json_object)
    JSON_SCHEMA = "json_schema"  # JSON matching json_schema, strictly (also tool calls' arguments)
    REGEX = "regex"  # text that regex matches as a whole (xgrammar's syntax, as vLLM's guided_regex)
    CHOICE = "choice"  # exactly one of choices
    EBNF = "ebnf"  # text grammar derives from its rule "root" (GBNF, as vLLM's guided_grammar)


# The field of StructuredOutput each kind sets (JSON_OBJECT sets none).
STRUCTURED_FIELDS = {StructuredKind.JSON_SCHEMA: "json_schema", StructuredKind.REGEX: "regex",
                     StructuredKind.CHOICE: "choices", StructuredKind.EBNF: "grammar"}


class StructuredOutput(msgspec.Struct, frozen=True, omit_defaults=True):
    """A grammar the output must follow: kind, and the one field STRUCTURED_FIELDS names for it
    (json_schema: JSON text of a JSON object). The engine samples only tokens the grammar
    allows; once the grammar is complete only EOS may follow, and the request finishes with
    "stop"."""

    kind: StructuredKind
    json_schema: str | None = None
    regex: str | None = None
    choices: tuple[str, ...] | None = None
    grammar: str | None = None


class SamplingOptions(msgspec.Struct, frozen=True, omit_defaults=True):
    """Per-request sampling settings as they travel between processes. Every default lives here;
    engine.sampling_rules.check_sampling states every range."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; N >= 0: the chosen token's plus the top N
    # token id -> added to its logit before sampling (greedy too); ids must be < the vocab size
    logit_bias: dict[int, float] | None = None
    structured: StructuredOutput | None = None  # None: free text
    # None: none; N >= 0: each prompt token's logprob plus the top N (see PrefillResult)
    prompt_logprobs: int | None = None


# --dtype's names: "auto" (engine.config.resolve_dtype) or one of engine.config.DTYPES. Here, and
# torch-free, for the command lines that list them without importing torch.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def default_of(config_class: type, name: str) -> object:
    """The default of a config dataclass's field, for command lines that show it: the field stays
    the one place a default is written (here because every process may import this module)."""
    for config_field in dataclasses.fields(config_class):
        if config_field.name == name:
            return config_field.default
    raise AttributeError(f"{config_class.__name__} has no field {name!r}")


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that num_tokens tokens fill (the last one partly): ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def prefix_block_hashes(token_ids: list[int], block_size: int, salt: bytes = b"") -> list[int]:
    """The prefix-cache key of every full block of token_ids, in order: hash i covers tokens
    [0, (i + 1) * block_size), chained through hash i - 1, so equal hashes mean equal prefixes.
    salt: anything besides the tokens that changes the blocks' KV (empty for a plain prompt).
    64-bit keys from BLAKE2b (the proxy, prefill and decode nodes compute the same ones)."""
    hashes: list[int] = []
    parent = salt
    for end in range(block_size, len(token_ids) + 1, block_size):
        block = token_ids[end - block_size:end]
        digest = hashlib.blake2b(parent + _token_bytes(block), digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
        parent = digest
    return hashes


def _token_bytes(token_ids: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little", signed=False) for t in token_ids)


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A sampled token, with its log-probability and the top-N alternatives as
    (token_id, logprob) when the request asked for logprobs (logprob None otherwise).
    Untracked by the cyclic collector (gc=False: it refers to nothing that refers back), as
    there is one per token in every step's messages and every choice that keeps its logprobs."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] = []


class KVHandle(msgspec.Struct, frozen=True):
    """Where a finished prompt's KV blocks live on a prefill node, held there on a lease.

    generation names this lease (unique on its holder, never reused): renewals, the reader's
    confirmation after its read and releases all name it, so nothing meant for one lease acts
    on another of the same request id. The holder frees the blocks lease_timeout_s after the
    last renewal; a reader keeps the lease alive while it holds the request."""

    engine_id: str
    agent_address: str  # host:port of the prefill node's KV side channel
    block_ids: list[int]
    num_tokens: int
    generation: int
    lease_timeout_s: float


class KVSource(enum.StrEnum):
    """Where a decode node got a request's prompt KV."""

    PULLED = "pulled"  # read from the prefill node's lease
    FALLBACK = "fallback"  # the pull failed (a transient reason): prefilled on the decode node
    LOCAL = "local"  # no KV handle: prefilled on the decode node (colocated, or by the proxy's choice)


class KVFallbackReason(enum.StrEnum):
    """Why a pull fell back to local prefill: only transient failures do (a layout mismatch or
    a malformed handle fails the request instead)."""

    HANDSHAKE = "handshake"  # the holder's side channel did not answer or refused for a transient reason
    TRANSFER = "transfer"  # the read itself failed (peer died, transport error)
    TIMEOUT = "timeout"  # no completion within the transfer timeout
    LEASE_LOST = "lease_lost"  # the lease ended before the read was confirmed: its blocks may be reused


class KVOutcome(msgspec.Struct, frozen=True, array_like=True):
    """How a decode node came by a request's prompt KV; fallback_reason set for FALLBACK only."""

    source: KVSource
    fallback_reason: KVFallbackReason | None = None

    @property
    def label(self) -> str:
        """"pulled", "local", or "fallback:<reason>" (e.g. for a response header)."""
        if self.fallback_reason is None:
            return self.source.value
        return f"{self.source.value}:{self.fallback_reason.value}"


class KVLayoutInfo(msgspec.Struct, frozen=True):
    """What a prefill and a decode node must share for KV to move between them: fingerprint, a
    short hash of fields (layout fields that must be equal: model, dtype, shape, block size,
    code version), and those fields readably, so a mismatch can be named field by field."""

    fingerprint: str
    fields: dict[str, str]


# ---- proxy -> node ----------------------------------------------------------------------------


class PrefillRequest(msgspec.Struct, tag="prefill_request", frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    sent_at: float = 0.0  # time.time() at the proxy, for queueing metrics
    seq: int = 0  # the proxy's count of requests sent to this node; echoed in LoadReport
    # Stream the KV: while a prompt of several chunks is prefilled, the node leases its blocks
    # from the first chunk on and sends a KVProgress after each chunk that completed blocks.
    stream_kv: bool = False


class DecodeRequest(msgspec.Struct, tag="decode_request", frozen=True):
    """A request for a decode node. With kv_handle set, the prompt's KV is pulled from the
    prefill node and first_token continues it; with kv_handle None, the node prefills locally
    (colocated mode or fallback) and first_token must be None. A kv_handle without a first token
    starts a streamed pull: the handle names the prompt's blocks completed so far (a KVProgress
    handle), and KVProgress messages bring the rest, the last one with the first token."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    first_token: TokenLogprob | None = None
    kv_handle: KVHandle | None = None
    sent_at: float = 0.0
    seq: int = 0  # as PrefillRequest.seq
    # A request migrated from a node that died mid-stream: the tokens already generated (and
    # streamed), recomputed here after the prompt (kv_handle and first_token None); its next
    # token has output index len(output_token_ids), as it would have on the first node.
    output_token_ids: list[int] = []


class Abort(msgspec.Struct, tag="abort", frozen=True):
    request_ids: list[str]


class KVProgress(msgspec.Struct, tag="kv_progress", frozen=True):
    """A streamed prompt's KV so far (PrefillRequest.stream_kv). Prefill node -> proxy, after a
    chunk that completed blocks: kv_handle names the lease (the same generation throughout) and
    its blocks that no later chunk writes, num_tokens the prompt tokens they hold (whole blocks).
    Proxy -> the decode node pulling it: the same; and last, with first_token set, the prefill's
    whole-prompt handle (the PrefillResult's). A handle of another generation than the stream's
    means the stream broke (the prefill restarted): what was read of it is not used."""

    request_id: str
    kv_handle: KVHandle
    first_token: TokenLogprob | None = None


class ReleaseKV(msgspec.Struct, tag="release_kv", frozen=True):
    """Proxy -> prefill node: free a lease whose request will never be pulled (the decode side
    was never reached). The normal release is the decode side's read-done notice."""

    request_ids: list[str]


# ---- node -> proxy ----------------------------------------------------------------------------


class PrefillResult(msgspec.Struct, tag="prefill_result", frozen=True):
    """The first token of a prompt. finish_reason is set when that token already ends the
    request (max_tokens 1, a stop token): then kv_handle is None and no lease is held.

    prompt_logprobs (when the request asked for them): one entry per prompt token, in order;
    entry i holds prompt token i's logprob given tokens < i and the top N there, entry 0 has
    logprob None (nothing precedes it). Values are the model's raw distribution (no bias, no
    grammar, no temperature). Sent once: the decode node never sends them again."""

    request_id: str
    first_token: TokenLogprob
    num_prompt_tokens: int
    kv_handle: KVHandle | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


class RequestDelta(msgspec.Struct, frozen=True, array_like=True):
    """New tokens of one request since the last TokenBatch; finish_reason set on the last.
    first_token_idx is the index of tokens[0] among the request's output tokens (counting a
    first token sampled on a prefill node): each delta continues the last one exactly, so a
    receiver that sees any other index has lost messages and must fail the request.
    prompt_logprobs (as PrefillResult's) come once, on the first delta, and only from a node
    that prefilled a request arriving with no output tokens (colocated, or a DecodeRequest
    without first_token); a request prefilled on a prefill node got them in its PrefillResult.
    kv, on a decode node's first delta of a request, says how it got the prompt's KV."""

    request_id: str
    tokens: list[TokenLogprob]
    first_token_idx: int
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    kv: KVOutcome | None = None


class TokenBatch(msgspec.Struct, tag="token_batch", frozen=True):
    """One engine step's output for all of its requests that produced tokens."""

    deltas: list[RequestDelta]


# ErrorReply.kind of a request refused because its node is draining: retry it on another node.
DRAINING_ERROR_KIND = "Draining"
# ErrorReply.kind of a request refused because its node's waiting queue is at its bound
# (LoadReport.max_num_waiting): retry it on another node; the node itself is fine.
QUEUE_FULL_ERROR_KIND = "QueueFull"
# ErrorReply.kind of a request ended because its node failed as a whole and is stopping (a rank of
# its split model was lost): the request retries, or migrates with its tokens, on another node.
NODE_FAILED_ERROR_KIND = "NodeFailed"
# Refusals that say nothing about the request: the proxy sends it to another node instead.
RETRYABLE_ERROR_KINDS = frozenset({DRAINING_ERROR_KIND, QUEUE_FULL_ERROR_KIND, NODE_FAILED_ERROR_KIND})


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
    role: Role
    protocol_version: int
    model_name: str
    max_model_len: int
    block_size: int
    num_running: int
    num_waiting: int
    num_queued_prompt_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    num_pending_pulls: int = 0
    # Blocks that accepted requests still need for their prompts and do not hold yet (waiting
    # and chunk-prefilling requests, pulls not started): num_free_blocks less these is what a
    # new request would find (a defaulted field: a node that does not send it reports 0).
    num_promised_blocks: int = 0
    num_leases: int = 0
    num_kv_fallbacks: int = 0  # the sum of num_kv_fallbacks_by_reason
    sent_at: float = 0.0
    last_request_seq: int = 0
    prefill_tokens_per_s: float = 0.0  # measured prefill throughput; 0: not measured yet
    # None on a colocated node (it moves no KV); a prefill node pairs only with decode nodes
    # of the same kv_layout.fingerprint.
    kv_layout: KVLayoutInfo | None = None
    num_kv_fallbacks_by_reason: dict[str, int] = {}  # KVFallbackReason value -> pulls that fell back
    num_rejected_messages: int = 0  # malformed, unauthenticated, oversized, wrong-version or unexpected
    num_orphaned_requests: int = 0  # aborted because their proxy vanished (no message within the orphan timeout)
    # Random per process start: a new boot id is a restarted node, which holds none of the
    # requests sent to the old one. "" from a node that does not say.
    boot_id: str = ""
    # The node's loop iterations so far: a node whose progress stands still while it has work
    # is stuck even though its heartbeat thread still reports.
    progress: int = 0
    # Draining (SIGTERM): finishing what it runs, refusing new requests (ErrorReply kind
    # DRAINING_ERROR_KIND): route elsewhere.
    is_draining: bool = False
    # Prefix cache (version 7): the digest when it is due (None: unchanged since the last one
    # sent), and counters since start: prompt tokens looked up, and those found cached.
    prefix_cache: PrefixCacheDigest | None = None
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    # Also version 7, counters since start: prefill tokens this node computed (a preempted
    # request's recompute included; the cached ones it skipped are in num_prefix_hit_tokens);
    # on a decode node, the KV blocks of its handles that it pulled, and those it did not need
    # to (found in its own prefix cache; a full hit's partial last block is computed locally).
    num_computed_prefill_tokens: int = 0
    num_kv_blocks_pulled: int = 0
    num_kv_blocks_skipped: int = 0
    # A decode node's KV blocks taken out of use for good: a transfer into them never stopped.
    num_kv_blocks_lost: int = 0
    # Version 9, KV streaming: prompts a prefill node streamed (leased from their first chunk), and
    # pulls a decode node read in parts while their prompt was prefilled.
    num_kv_streamed: int = 0
    # Version 7: the node refuses new requests (ErrorReply kind QUEUE_FULL_ERROR_KIND) while
    # num_waiting + num_pending_pulls is at this bound; 0: unbounded (or not said).
    max_num_waiting: int = 0
    # The most requests the node runs at once (its max_num_seqs); 0: not said. A proxy that
    # knows it sees a node's slots full before anything queues there.
    max_num_seqs: int = 0
    # The port of the node's health server (/metrics), on the host of its address; 0: none.
    # Proxies re-export its vllm:* series on their own /metrics.
    metrics_port: int = 0


MAX_DIGEST_BLOCKS = 4096  # block hashes a node lists in one PrefixCacheDigest


class PrefixCacheDigest(msgspec.Struct, frozen=True, array_like=True):
    """The prefix-cache blocks a node holds, for cache-aware routing: the prefix_block_hashes
    keys of its cached full blocks, most recently used first, at most MAX_DIGEST_BLOCKS.
    version grows whenever the set changes (a new boot id starts it again), so a receiver
    keeps the newest digest it saw. Sent in a LoadReport when the set changed (at most about
    once a second) and again every few seconds regardless, so a proxy that connects later
    learns it."""

    version: int
    block_hashes: list[int]


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """Proxy -> node: ask for a LoadReport now (used at start-up and by /health)."""


class Drain(msgspec.Struct, tag="drain", frozen=True):
    """Proxy -> node (version 7), an admin call: drain exactly as on SIGTERM. The node refuses
    new requests (ErrorReply kind DRAINING_ERROR_KIND), finishes the running ones, keeps its
    leases until pulled or expired (at most its drain timeout), then exits; its reports say
    is_draining meanwhile. A node that is draining already ignores it."""

    reason: str = ""  # for the node's log


ToNode = PrefillRequest | DecodeRequest | Abort | ReleaseKV | Ping | Drain | KVProgress
FromNode = PrefillResult | TokenBatch | ErrorReply | LoadReport | KVProgress

_encoder = msgspec.msgpack.Encoder()
_to_node_decoder = msgspec.msgpack.Decoder(ToNode)
_from_node_decoder = msgspec.msgpack.Decoder(FromNode)


def encode(message: ToNode | FromNode) -> bytes:
    """One frame: the version header, then the message as msgpack."""
    return _FRAME_HEADER + _encoder.encode(message)


def decode_to_node(data: bytes) -> ToNode:
    """Decode a proxy -> node frame; raises msgspec.DecodeError (ValidationError, a subclass,
    for a well-formed message of the wrong shape) if malformed or of another version."""
    return _decode(_to_node_decoder, data)


def decode_from_node(data: bytes) -> FromNode:
    """Decode a node -> proxy frame; raises msgspec.DecodeError as decode_to_node."""
    return _decode(_from_node_decoder, data)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes):
    payload = _payload(data)
    try:
        return decoder.decode(payload)
    except msgspec.DecodeError:
        raise
    except (ValueError, RecursionError) as exc:  # NOTE: msgspec raises UnicodeDecodeError for bad UTF-8
        raise msgspec.DecodeError(f"malformed message: {type(exc).__name__}: {exc}") from None


def frame_version(data: bytes) -> int | None:
    """The protocol version a frame says it is in; None if it has no version header."""
    if len(data) < len(_FRAME_HEADER) or not data.startswith(_FRAME_MAGIC):
        return None
    return int.from_bytes(data[len(_FRAME_MAGIC):len(_FRAME_HEADER)], "big")


def _payload(data: bytes) -> memoryview:
    if not data.startswith(_FRAME_HEADER):
        version = frame_version(data)
        found = "no version header" if version is None else f"protocol version {version}"
        raise msgspec.DecodeError(f"frame has {found}; this process speaks version {PROTOCOL_VERSION}")
    return memoryview(data)[len(_FRAME_HEADER):]


# ---- the cluster secret -------------------------------------------------------------------------

MIN_CLUSTER_SECRET_CHARS = 16
# NOTE: PBKDF2 so that a weak secret is slow to guess from a captured handshake (~40 ms per
# process start for both key pairs on the dev machine).
_KDF_ITERATIONS = 100_000


@dataclass(frozen=True)
class CurveKeys:
    """The cluster's CURVE key pairs (z85): every node's sockets serve with the server pair,
    every proxy's and node's connecting sockets use the client pair. Never printed."""

    server_public: bytes = field(repr=False)
    server_secret: bytes = field(repr=False)
    client_public: bytes = field(repr=False)
    client_secret: bytes = field(repr=False)


def curve_keys(cluster_secret: str) -> CurveKeys:
    """Derive the cluster's keys from its shared secret (the same in every process). Raises
    ValueError for a secret shorter than MIN_CLUSTER_SECRET_CHARS."""
    if len(cluster_secret) < MIN_CLUSTER_SECRET_CHARS:
        raise ValueError(f"cluster secret must have at least {MIN_CLUSTER_SECRET_CHARS} characters, "
                         f"got {len(cluster_secret)}")
    import zmq  # NOTE: here: readers of the messages alone need no zmq
    from zmq.utils import z85

    def secret_key(role: bytes) -> bytes:
        raw = hashlib.pbkdf2_hmac("sha256", cluster_secret.encode(), b"pdserve-curve-" + role, _KDF_ITERATIONS)
        return z85.encode(raw)

    server_secret, client_secret = secret_key(b"server"), secret_key(b"client")
    return CurveKeys(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)
