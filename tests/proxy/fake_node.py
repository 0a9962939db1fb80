"""A fake prefill/decode node for proxy tests: the engine.protocol over a ZMQ ROUTER on
127.0.0.1, a deterministic fake model (fake prompt logprobs too, sent once by the node that
prefilled, as a real node), periodic LoadReports, Abort/ReleaseKV bookkeeping, and a die() that
makes it vanish mid-request. Runs in a thread of the test process."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from engine import protocol

_POLL_MS = 5


def next_token(prompt_ids: list[int], output_ids: list[int], vocab_size: int) -> int:
    """The fake model: a function of the prompt and the tokens so far (same colocated or split)."""
    return (sum(prompt_ids) * 31 + len(output_ids) * 17 + (output_ids[-1] if output_ids else 0)) % vocab_size


def fake_prompt_logprobs(prompt_ids: list[int], num_top: int, vocab_size: int) -> list[protocol.TokenLogprob]:
    """The fake model's prompt logprobs: token 0 has none, token i -0.25 * i, top N made up."""
    return [protocol.TokenLogprob(prompt_ids[0])] + [
        protocol.TokenLogprob(t, -0.25 * i, [((t + j + 1) % vocab_size, -0.1 - j) for j in range(num_top)])
        for i, t in enumerate(prompt_ids) if i > 0]


@dataclass
class _Running:
    request_id: str
    identity: bytes
    prompt_ids: list[int]
    sampling: protocol.SamplingOptions
    output_ids: list[int] = field(default_factory=list)
    owes_prompt_logprobs: bool = False  # prefilled here (no first token came with it): sent on the first delta
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache: not reported as queued prefill work


@dataclass
class FakeNodeConfig:
    role: protocol.Role  # PREFILL or DECODE (decode without a KV handle prefills locally)
    vocab_size: int
    eos_token_id: int | None = None
    script: list[int] | None = None  # emit these ids in order (cycling) instead of the fake model
    step_s: float = 0.01  # time per decode step (one token for every running request)
    prefill_s: float = 0.01
    report_interval_s: float = 0.05
    max_model_len: int = 256
    model_name: str = "fake"
    fail_token_id: int | None = None  # a prompt holding this id gets an ErrorReply
    fail_is_client_error: bool = True
    fail_structured: bool = False  # a request with sampling.structured gets a client ErrorReply (a refused schema)
    prefill_tokens_per_s: float = 0.0  # reported as the node's measured prefill rate (0: unmeasured)
    block_size: int = 16
    num_total_blocks: int = 1000
    # At most this many requests decode at once; the rest wait (reported as num_waiting) in
    # arrival order, holding no blocks. None: all at once.
    max_num_seqs: int | None = None
    # The node's waiting-queue bound (reported; past it a request gets ErrorReply QueueFull). 0: none.
    max_num_waiting: int = 0
    # Refuse every request as full without reporting a bound (as when other proxies filled it).
    refuse_as_full: bool = False
    # Keep the block hashes of every prompt taken (no eviction), count lookups and report a
    # PrefixCacheDigest on change and every digest_refresh_s, as a prefix-caching node.
    prefix_caching: bool = False
    digest_refresh_s: float = 1.0


class FakePrefixCache:
    """The fake's prefix cache: every block of every prompt taken, most recently used last, a
    digest version that grows on each change, lookup counters. is_frozen: no more digests (a
    node whose digests lag)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.hashes: dict[int, None] = {}
        self.version = 0
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.is_frozen = False
        self._sent: dict[bytes, tuple[int, float]] = {}  # proxy identity -> (version, when) last sent

    def take(self, token_ids: list[int]) -> int:
        """Look the prompt up and cache its blocks; returns the tokens found cached."""
        hashes = protocol.prefix_block_hashes(token_ids, self.block_size)
        num_cached = next((i for i, h in enumerate(hashes) if h not in self.hashes), len(hashes))
        num_hit = min(num_cached * self.block_size, max(len(token_ids) - 1, 0))
        self.num_query_tokens += len(token_ids)
        self.num_hit_tokens += num_hit
        for block_hash in hashes:
            self.hashes.pop(block_hash, None)
            self.hashes[block_hash] = None
        self.version += 1
        return num_hit

    def digest_for(self, identity: bytes, refresh_s: float) -> protocol.PrefixCacheDigest | None:
        """The digest when this proxy has not seen this version, or refresh_s after it last did."""
        sent_version, sent_at = self._sent.get(identity, (-1, 0.0))
        now = time.monotonic()
        if self.is_frozen or (sent_version == self.version and now - sent_at < refresh_s):
            return None
        self._sent[identity] = (self.version, now)
        block_hashes = list(reversed(self.hashes))[:protocol.MAX_DIGEST_BLOCKS]
        return protocol.PrefixCacheDigest(self.version, block_hashes)


class FakeNode:
    """start() binds and serves; die() stops answering and closes the socket; stop() as die()."""

    def __init__(self, config: FakeNodeConfig) -> None:
        self.config = config
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.received: list[protocol.ToNode] = []  # every message, in order of arrival
        self.leases: dict[str, protocol.KVHandle] = {}
        self._num_leases_made = 0  # a lease's generation: unique on this node
        self._running: dict[str, _Running] = {}
        self._prefills: list[tuple[float, _Running]] = []
        self._lock = threading.Lock()
        self._is_stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"fake-{config.role.value}-{self.port}", daemon=True)
        self._proxies: set[bytes] = set()
        self._last_request_seqs: dict[bytes, int] = {}
        self._num_iterations = 0  # reported as progress: the loop is alive (the proxy's stall check)
        self.boot_id = ""  # reported; restart_cache() sets a new one
        self.prefix_cache = FakePrefixCache(config.block_size)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> FakeNode:
        self._thread.start()
        return self

    def die(self) -> None:
        """Stop at once: no more reports or tokens, socket closed (as a killed process)."""
        self._is_stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._socket.close(linger=0)
        self._context.term()

    stop = die

    def messages(self, kind: type) -> list:
        with self._lock:
            return [m for m in self.received if isinstance(m, kind)]

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.005)
        return predicate()

    def cache_prompt(self, token_ids: list[int]) -> None:
        """Cache a prompt's blocks as if this node had prefilled it (counted as a lookup too)."""
        with self._lock:
            self.prefix_cache.take(token_ids)

    def restart_cache(self, boot_id: str) -> None:
        """Report a new boot id with an empty cache (as a restarted node)."""
        with self._lock:
            self.boot_id = boot_id
            self.prefix_cache = FakePrefixCache(self.config.block_size)

    def num_running(self) -> int:
        with self._lock:
            return len(self._running) + len(self._prefills)

    # ---- the loop -----------------------------------------------------------------------------

    def _serve(self) -> None:
        last_report = 0.0
        last_step = time.monotonic()
        while not self._is_stopping.is_set():
            self._num_iterations += 1
            if self._socket.poll(_POLL_MS):
                self._receive_all()
            now = time.monotonic()
            self._finish_prefills(now)
            if now - last_step >= self.config.step_s:
                last_step = now
                self._step()
            if now - last_report >= self.config.report_interval_s:
                last_report = now
                for identity in list(self._proxies):
                    self._send(identity, self._report(identity))

    def _receive_all(self) -> None:
        while True:
            try:
                identity, payload = self._socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = protocol.decode_to_node(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            self._proxies.add(identity)
            with self._lock:
                self.received.append(message)
                self._dispatch(identity, message)

    def _dispatch(self, identity: bytes, message) -> None:
        if isinstance(message, protocol.Ping):
            self._send(identity, self._report(identity))
        elif isinstance(message, protocol.Abort):
            for request_id in message.request_ids:
                self._running.pop(request_id, None)
                self._prefills = [(t, r) for t, r in self._prefills if r.request_id != request_id]
                self.leases.pop(request_id, None)
        elif isinstance(message, protocol.ReleaseKV):
            for request_id in message.request_ids:
                self.leases.pop(request_id, None)
        elif isinstance(message, (protocol.PrefillRequest, protocol.DecodeRequest)):
            self._last_request_seqs[identity] = message.seq
            self._admit(identity, message)

    def _admit(self, identity: bytes, message) -> None:
        if self._is_queue_full():
            self._send(identity, protocol.ErrorReply(message.request_id, protocol.QUEUE_FULL_ERROR_KIND,
                                                     "fake queue full", is_client_error=False))
            return
        num_cached = 0
        if self.config.prefix_caching and not self._is_failing(message):
            num_cached = self.prefix_cache.take(list(message.prompt_token_ids))
        if self._is_failing(message):
            self._send(identity, protocol.ErrorReply(message.request_id, "ValueError", "fake failure",
                                                     self.config.fail_is_client_error))
        elif isinstance(message, protocol.PrefillRequest):
            running = _Running(message.request_id, identity, list(message.prompt_token_ids), message.sampling,
                               num_cached_tokens=num_cached)
            self._prefills.append((time.monotonic() + self.config.prefill_s, running))
        else:
            self._admit_decode(identity, message)

    def _is_queue_full(self) -> bool:
        bound = self.config.max_num_waiting
        num_waiting = len(self._prefills) + len(self._running) - len(self._decoding())
        return self.config.refuse_as_full or (bound > 0 and num_waiting >= bound)

    def _is_failing(self, message) -> bool:
        if self.config.fail_structured and message.sampling.structured is not None:
            return True
        fail_id = self.config.fail_token_id
        return fail_id is not None and fail_id in message.prompt_token_ids

    def _admit_decode(self, identity: bytes, message: protocol.DecodeRequest) -> None:
        running = _Running(message.request_id, identity, list(message.prompt_token_ids), message.sampling)
        if message.first_token is not None:
            running.output_ids.append(message.first_token.token_id)
        running.output_ids.extend(message.output_token_ids)  # a migrated request continues its output
        running.owes_prompt_logprobs = message.first_token is None and message.sampling.prompt_logprobs is not None
        self._running[message.request_id] = running

    def _finish_prefills(self, now: float) -> None:
        with self._lock:
            ready = [r for t, r in self._prefills if t <= now]
            self._prefills = [(t, r) for t, r in self._prefills if t > now]
            for running in ready:
                token = self._sample(running)
                reason = self._finish_reason(running)
                handle = None
                if reason is None:
                    self._num_leases_made += 1
                    handle = protocol.KVHandle("fake-engine", self.address, [0], len(running.prompt_ids),
                                               generation=self._num_leases_made, lease_timeout_s=30.0)
                    self.leases[running.request_id] = handle
                self._send(running.identity, protocol.PrefillResult(
                    running.request_id, token, len(running.prompt_ids), handle, reason,
                    self._prompt_logprobs(running)))

    def _step(self) -> None:
        with self._lock:
            by_owner: dict[bytes, list[protocol.RequestDelta]] = {}
            for running in self._decoding():
                token = self._sample(running)
                reason = self._finish_reason(running)
                if reason is not None:
                    del self._running[running.request_id]
                prompt_logprobs = self._prompt_logprobs(running) if running.owes_prompt_logprobs else None
                running.owes_prompt_logprobs = False
                delta = protocol.RequestDelta(running.request_id, [token], first_token_idx=len(running.output_ids) - 1,
                                              finish_reason=reason, num_prompt_tokens=len(running.prompt_ids),
                                              prompt_logprobs=prompt_logprobs)
                by_owner.setdefault(running.identity, []).append(delta)
            for identity, deltas in by_owner.items():
                self._send(identity, protocol.TokenBatch(deltas))

    def _decoding(self) -> list[_Running]:
        """The requests that get a token this step (the first max_num_seqs; dicts keep arrival order)."""
        return list(self._running.values())[:self.config.max_num_seqs]

    def _sample(self, running: _Running) -> protocol.TokenLogprob:
        script = self.config.script
        if script:
            token_id = script[len(running.output_ids) % len(script)]
        else:
            token_id = next_token(running.prompt_ids, running.output_ids, self.config.vocab_size)
        running.output_ids.append(token_id)
        num_top = running.sampling.logprobs
        if num_top is None:
            return protocol.TokenLogprob(token_id)
        top = [((token_id + i) % self.config.vocab_size, -0.5 - i) for i in range(num_top)]
        return protocol.TokenLogprob(token_id, -0.5, top)

    def _prompt_logprobs(self, running: _Running) -> list[protocol.TokenLogprob] | None:
        num_top = running.sampling.prompt_logprobs
        return None if num_top is None else fake_prompt_logprobs(running.prompt_ids, num_top, self.config.vocab_size)

    def _finish_reason(self, running: _Running) -> str | None:
        sampling = running.sampling
        num_out = len(running.output_ids)
        last = running.output_ids[-1]
        stops = set(sampling.stop_token_ids)
        if not sampling.ignore_eos and self.config.eos_token_id is not None:
            stops.add(self.config.eos_token_id)
        if num_out >= sampling.min_tokens and last in stops:
            return "stop"
        if num_out >= sampling.max_tokens:
            return "length"
        return None

    def _num_used_blocks(self) -> int:
        """Blocks the running requests' tokens fill, and the leased prompts' (as a real node's pool)."""
        block_size = self.config.block_size
        running = [len(r.prompt_ids) + len(r.output_ids) for r in self._decoding()]
        leased = [handle.num_tokens for handle in self.leases.values()]
        return sum(protocol.num_blocks_for(n, block_size) for n in running + leased)

    def _report(self, identity: bytes) -> protocol.LoadReport:
        queued = sum(len(r.prompt_ids) - r.num_cached_tokens for _, r in self._prefills)
        num_decoding = len(self._decoding())
        return protocol.LoadReport(
            node_id=f"fake-{self.port}", role=self.config.role, protocol_version=protocol.PROTOCOL_VERSION,
            model_name=self.config.model_name, max_model_len=self.config.max_model_len,
            block_size=self.config.block_size, num_running=num_decoding,
            num_waiting=len(self._prefills) + len(self._running) - num_decoding,
            max_num_waiting=self.config.max_num_waiting, max_num_seqs=self.config.max_num_seqs or 0,
            num_queued_prompt_tokens=queued, num_free_blocks=self.config.num_total_blocks - self._num_used_blocks(),
            num_total_blocks=self.config.num_total_blocks, num_leases=len(self.leases),
            num_kv_fallbacks=0, sent_at=time.time(), last_request_seq=self._last_request_seqs.get(identity, 0),
            prefill_tokens_per_s=self.config.prefill_tokens_per_s, progress=self._num_iterations, boot_id=self.boot_id,
            prefix_cache=self.prefix_cache.digest_for(identity, self.config.digest_refresh_s)
            if self.config.prefix_caching else None,
            num_prefix_query_tokens=self.prefix_cache.num_query_tokens,
            num_prefix_hit_tokens=self.prefix_cache.num_hit_tokens,
        )

    def _send(self, identity: bytes, message) -> None:
        with contextlib.suppress(zmq.Again):
            self._socket.send_multipart([identity, protocol.encode(message)], flags=zmq.NOBLOCK)
