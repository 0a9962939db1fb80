"""The life of one request across the nodes (prefill, KV handle, decode; or colocated), as an
async stream of token steps; a request ended early or failed is aborted on every node holding it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine import protocol
from proxy.errors import ApiError, NodeDied, NodeRejected, NoNodeAvailable, rate_limited
from proxy.node_client import MessageQueue, NodeClient
from proxy.nodes import NodePool
from proxy.routing import PromptBlocks

logger = logging.getLogger(__name__)

_DECODE_POLL_S = 0.05  # how often a prompt waiting for a decode node looks again


@dataclass
class Step:
    """Tokens a node produced for the request since the last step; finish_reason set on the last.
    prompt_logprobs (one per prompt token) on the first step, when the request asked for them."""

    tokens: list[protocol.TokenLogprob]
    finish_reason: str | None = None
    prompt_logprobs: list[protocol.TokenLogprob] | None = None
    # How the decode node got the prompt's KV (kv.label: "pulled", "local", "fallback:<reason>"):
    # on the first step from the decode node; None on the others and when the request ended on
    # its prefill node.
    kv: protocol.KVOutcome | None = None



async def run_request(pool: NodePool, request_id: str, prompt_ids: list[int], sampling: protocol.SamplingOptions,
                      first_token_timeout_s: float, token_timeout_s: float) -> AsyncIterator[Step]:
    """Yields the request's tokens; raises NoNodeAvailable, NodeRejected, NodeDied (also when
    a node's token deltas do not continue each other: messages were lost), TimeoutError, or
    ApiError: a 429 with Retry-After when every node that could take it refused it as full
    (its waiting queue at the bound), or what the pool's queues were failed with (the proxy's
    own drain ends open requests so).

    Disaggregated: PrefillRequest to a prefill node -> the first token (yielded at once) and a KV
    handle -> DecodeRequest to a decode node, which pulls the KV -> token batches. Colocated (no
    prefill nodes), prefilled on the decode node because the prefill pool is backed up (see
    NodePool.pick_local_prefill) or because no prefill node takes requests: one DecodeRequest
    without a handle.

    Failures: a node that dies, times out, is draining or refuses the request as full before the
    first token is replaced (another prefill node, else a decode node prefilling itself;
    pool.retry_limits.max_attempts sends in all); once tokens were yielded, the request migrates
    to another decode node with the prompt and the tokens so far (recomputed there; the next
    token keeps its output index, so greedy and seeded output continue unchanged;
    pool.retry_limits.max_migrations at most). The stream the caller sees just continues.
    Always leaves no request behind on any node: on an early exit the node holding it gets
    Abort, and a prefill lease the decode side never saw gets ReleaseKV."""
    run = _Run(pool, request_id, prompt_ids, sampling, first_token_timeout_s, token_timeout_s)
    try:
        while True:
            try:
                async for step in run.attempt():
                    yield step
                return
            except (NodeDied, TimeoutError, NodeRejected) as exc:
                run.recover(exc)
            except NoNodeAvailable:
                if run.num_refused_full:
                    raise run.too_busy() from None
                raise
    finally:
        run.cleanup.run()


@dataclass
class _Cleanup:
    """What the nodes still hold of one request, released when it ends (run())."""

    request_id: str
    holder: NodeClient | None = None  # the node that must be told to abort
    lease_holder: NodeClient | None = None  # a prefill node holding KV nobody will pull
    # The prefill node whose lease the decode node (holder) took over: released by the proxy
    # too if that decode node fails (it may have died before pulling).
    pulled_from: NodeClient | None = None
    # A decode node reading the prompt's KV as it is prefilled (a streamed pull), before it holds
    # the request: told to abort unless the request moved on to it.
    streaming_to: NodeClient | None = None
    is_finished: bool = False

    def run(self) -> None:
        if self.streaming_to is not None:
            self.streaming_to.close(self.request_id)
            _send_quietly(self.streaming_to, protocol.Abort([self.request_id]), self.request_id)
        if self.holder is not None:
            self.holder.close(self.request_id)
            if not self.is_finished:
                _send_quietly(self.holder, protocol.Abort([self.request_id]), self.request_id)
        if self.lease_holder is not None:
            _send_quietly(self.lease_holder, protocol.ReleaseKV([self.request_id]), self.request_id)

    def release_failed(self) -> None:
        """After a failed attempt: abort it where it ran (the node may live on: a timeout), and
        release a lease it may have left; ready for the next attempt."""
        if self.pulled_from is not None:
            self.lease_holder = self.pulled_from
        self.run()
        self.holder = self.lease_holder = self.pulled_from = self.streaming_to = None


@dataclass
class _Run:
    """One request's attempts: what was streamed so far and the nodes that failed it."""

    pool: NodePool
    request_id: str
    prompt_ids: list[int]
    sampling: protocol.SamplingOptions
    first_token_timeout_s: float
    token_timeout_s: float
    cleanup: _Cleanup = field(init=False)
    generated: list[int] = field(default_factory=list)  # token ids yielded so far
    excluded: set[int] = field(default_factory=set)  # id()s of nodes that failed this request
    num_attempts: int = 1
    num_migrations: int = 0
    num_refused_full: int = 0  # refusals by nodes whose waiting queue was at its bound
    prompt: PromptBlocks = field(init=False)  # the prompt's block hashes, for routing (once per request)

    def __post_init__(self) -> None:
        self.cleanup = _Cleanup(self.request_id)
        self.prompt = PromptBlocks(self.prompt_ids)

    def recover(self, exc: Exception) -> None:
        """Get ready for another attempt after exc, or raise it (not retryable, or out of attempts;
        a 429 when the last refusal was a full node's)."""
        if isinstance(exc, NodeRejected) and exc.reply.kind not in protocol.RETRYABLE_ERROR_KINDS:
            self.cleanup.is_finished = True  # the node has dropped the request already
            raise exc
        is_full = isinstance(exc, NodeRejected) and exc.reply.kind == protocol.QUEUE_FULL_ERROR_KIND
        self.num_refused_full += is_full
        failed = self.cleanup.holder
        self.cleanup.release_failed()
        if failed is None:
            raise exc
        self.excluded.add(id(failed))
        limits = self.pool.retry_limits
        if self.generated:
            self.num_migrations += 1
            if self.num_migrations > limits.max_migrations:
                raise self.too_busy() if is_full else exc
        else:
            self.num_attempts += 1
            if self.num_attempts > limits.max_attempts:
                raise self.too_busy() if is_full else exc
        logger.warning("request %s: %s node %s failed (%s) after %d tokens: %s elsewhere", self.request_id,
                       failed.kind, failed.address, exc, len(self.generated),
                       "migrating" if self.generated else "retrying")

    def too_busy(self) -> ApiError:
        """The answer when the nodes that could take the request refused it as full."""
        logger.info("request %s: refused as full by %d node(s), no other node takes it: 429", self.request_id,
                    self.num_refused_full)
        return rate_limited("every node that could serve this request has a full waiting queue; retry later",
                            "nodes_full", 1)

    async def attempt(self) -> AsyncIterator[Step]:
        if self.generated:
            async for step in self._decode_locally(None):
                yield step
            return
        prefill = self._pick_prefill()
        local = self.pool.pick_local_prefill(prefill, self.prompt) if prefill is not None else None
        if prefill is None or local is not None:
            async for step in self._decode_locally(local):
                yield step
            return
        await self._wait_for_decode(prefill)
        async for step in self._disaggregated(prefill):
            yield step

    async def _wait_for_decode(self, prefill: NodeClient) -> None:
        """Return once a decode node can take prefill's KV; raise NoNodeAvailable (naming why)
        after pool.retry_limits.decode_wait_s. NOTE: before the prefill, not after: a prompt
        prefilled for no decode node is work thrown away (a node starting, one failing over)."""
        deadline = time.monotonic() + self.pool.retry_limits.decode_wait_s
        while not self.pool.decode_candidates(prefill, frozenset(self.excluded)):
            if time.monotonic() >= deadline:
                raise NoNodeAvailable(self.pool.why_no_decode(prefill))
            await asyncio.sleep(_DECODE_POLL_S)

    def _pick_prefill(self) -> NodeClient | None:
        """A prefill node for this attempt; None when colocated or when no prefill node takes
        requests but a decode node does (it prefills). Raises NoNodeAvailable."""
        if not self.pool.prefill:
            return None
        prefill = self.pool.pick_prefill(frozenset(self.excluded), self.prompt)
        if prefill is not None:
            return prefill
        mismatch = self.pool.no_kv_path()
        if mismatch is not None or not self.pool.decode_candidates(exclude=frozenset(self.excluded)):
            raise NoNodeAvailable(mismatch or "no healthy prefill node")
        logger.info("request %s: no prefill node takes requests: prefilling on a decode node", self.request_id)
        return None

    async def _disaggregated(self, prefill: NodeClient) -> AsyncIterator[Step]:
        cleanup = self.cleanup
        cleanup.holder = prefill
        min_tokens = self.pool.kv_stream_min_tokens
        stream = _Stream(self, prefill) if min_tokens is not None and len(self.prompt_ids) >= min_tokens else None
        result = await _prefill(prefill, self.request_id, self.prompt, self.sampling, self.first_token_timeout_s,
                                stream)
        cleanup.holder = None  # the prefill is done; from here on the node only holds the lease
        if result.kv_handle is not None:
            cleanup.lease_holder = prefill
        if result.finish_reason is not None:
            cleanup.is_finished = True
            yield self._record(Step([result.first_token], result.finish_reason, result.prompt_logprobs))
            return
        if stream is not None and stream.finish(result):
            decode, queue = stream.decode, stream.queue
            cleanup.holder, cleanup.streaming_to = decode, None
        else:
            decode = self.pool.pick_decode(prefill, frozenset(self.excluded), self.prompt)  # NOTE: the holder's layout
            if decode is None:
                raise NoNodeAvailable(f"no healthy decode node shares the KV layout of prefill node {prefill.address}")
            queue = decode.open(self.request_id)
            cleanup.holder = decode
            decode.send_request(protocol.DecodeRequest(self.request_id, self.prompt_ids, self.sampling,
                                                       result.first_token, result.kv_handle, time.time()), self.prompt)
        # NOTE: the decode node releases the lease from here on, pulled or not (unless it fails)
        cleanup.lease_holder, cleanup.pulled_from = None, cleanup.lease_holder
        yield self._record(Step([result.first_token], prompt_logprobs=result.prompt_logprobs))
        async for step in _decode_steps(queue, decode, self.request_id, 1, self.token_timeout_s,
                                        self.token_timeout_s):
            cleanup.is_finished = step.finish_reason is not None
            yield self._record(step)

    async def _decode_locally(self, decode: NodeClient | None) -> AsyncIterator[Step]:
        """Prefill (the prompt and the tokens so far) and decode on one decode node."""
        decode = decode or self.pool.pick_decode(exclude=frozenset(self.excluded), prompt=self.prompt)
        if decode is None:
            raise NoNodeAvailable("no healthy decode node")
        queue = decode.open(self.request_id)
        self.cleanup.holder = decode
        decode.send_request(protocol.DecodeRequest(self.request_id, self.prompt_ids, self.sampling,
                                                   sent_at=time.time(), output_token_ids=list(self.generated)),
                            self.prompt)
        async for step in _decode_steps(queue, decode, self.request_id, len(self.generated),
                                        self.first_token_timeout_s, self.token_timeout_s):
            self.cleanup.is_finished = step.finish_reason is not None
            yield self._record(step)

    def _record(self, step: Step) -> Step:
        self.generated.extend(token.token_id for token in step.tokens)
        return step


async def _decode_steps(queue: MessageQueue, decode: NodeClient, request_id: str, next_token_idx: int,
                        first_timeout_s: float, token_timeout_s: float) -> AsyncIterator[Step]:
    """The node's deltas from output index next_token_idx on (the tokens before it were
    sampled elsewhere: on a prefill node, or on a node the request migrated from)."""
    timeout_s = first_timeout_s
    while True:
        message = await _next(queue, timeout_s, decode, request_id)
        timeout_s = token_timeout_s
        if isinstance(message, protocol.ErrorReply):
            raise NodeRejected(message)
        if message.first_token_idx != next_token_idx:
            raise NodeDied(f"request {request_id}: {decode.kind} node {decode.address} sent tokens from index "
                           f"{message.first_token_idx}, expected {next_token_idx}: messages were lost")
        next_token_idx += len(message.tokens)
        yield Step(list(message.tokens), message.finish_reason, message.prompt_logprobs, message.kv)
        if message.finish_reason is not None:
            return


class _Stream:
    """A streamed pull (protocol.KVProgress): the decode node picked at the prefill's first
    KVProgress gets the request then, each KVProgress after, and the last one, with the first
    token (finish). A decode node that cannot be reached, died or answered meanwhile (a refusal)
    ends the stream: the prompt's KV then goes the usual way, to a decode node picked once it is
    prefilled, rather than the request failing before its first token (and prefilling again)."""

    def __init__(self, run: _Run, prefill: NodeClient) -> None:
        self.run, self.prefill = run, prefill
        self.decode: NodeClient | None = None
        self.queue: MessageQueue | None = None
        self.is_given_up = False

    def forward(self, message: protocol.KVProgress) -> None:
        if self.is_given_up:
            return
        run = self.run
        try:
            if self.decode is not None:
                self.decode.send(message)
                return
            decode = run.pool.pick_decode(self.prefill, frozenset(run.excluded), run.prompt)
            if decode is None:
                return  # none takes it now: asked again at the next KVProgress
            self.decode, self.queue = decode, decode.open(run.request_id)
            run.cleanup.streaming_to = decode
            decode.send_request(protocol.DecodeRequest(run.request_id, run.prompt_ids, run.sampling,
                                                       kv_handle=message.kv_handle, sent_at=time.time()), run.prompt)
        except NodeDied as exc:
            self._give_up(str(exc), is_dead=True)

    def finish(self, result: protocol.PrefillResult) -> bool:
        """Send the decode node the prompt's last KVProgress; False (the stream given up) when there
        is none, or it died or answered meanwhile (the caller then picks a decode node anew)."""
        if self.decode is None:
            return False
        early = self.queue.ready()
        if early is not None or not self.decode.is_healthy:
            is_dead = not self.decode.is_healthy or isinstance(early, NodeDied)
            self._give_up(f"it answered before the prompt was prefilled: {early!r}" if early is not None
                          else "it is not healthy", is_dead)
            return False
        try:
            self.decode.send(protocol.KVProgress(self.run.request_id, result.kv_handle, result.first_token))
        except NodeDied as exc:
            self._give_up(str(exc), is_dead=True)
            return False
        return True

    def _give_up(self, why: str, is_dead: bool) -> None:
        run = self.run
        logger.warning("request %s: KV stream to decode node %s ended: %s", run.request_id, self.decode.address, why)
        if is_dead:
            run.excluded.add(id(self.decode))
        else:  # a refusal: the node dropped the request already; an Abort changes nothing there
            _send_quietly(self.decode, protocol.Abort([run.request_id]), run.request_id)
        run.cleanup.streaming_to = None
        self.decode.close(run.request_id)
        self.decode = self.queue = None
        self.is_given_up = True


async def _prefill(node: NodeClient, request_id: str, prompt: PromptBlocks, sampling: protocol.SamplingOptions,
                   timeout_s: float, stream: _Stream | None = None) -> protocol.PrefillResult:
    """The prefill node's result; with stream, its KVProgress messages meanwhile are forwarded.
    timeout_s bounds the whole prefill."""
    queue = node.open(request_id)
    deadline = time.monotonic() + timeout_s
    try:
        node.send_request(protocol.PrefillRequest(request_id, prompt.token_ids, sampling, time.time(),
                                                  stream_kv=stream is not None), prompt)
        while True:
            message = await _next(queue, max(0.0, deadline - time.monotonic()), node, request_id, timeout_s)
            if not isinstance(message, protocol.KVProgress):
                break
            if stream is not None:
                stream.forward(message)
    finally:
        node.close(request_id)
    if isinstance(message, protocol.ErrorReply):
        raise NodeRejected(message)
    return message


async def _next(queue: MessageQueue, timeout_s: float, node: NodeClient, request_id: str,
                timeout_s_named: float | None = None):
    """The next message; timeout_s_named: the bound the error names (default timeout_s)."""
    # NOTE: not wait_for: on Python 3.11 wait_for drops a cancellation that lands while the queue
    # hands over a message (returns the message instead), and a request whose client left would
    # then stream on for nobody, never aborted on its node. A cancelled next_within leaves the
    # message in the queue.
    try:
        message = await queue.next_within(timeout_s)
    except TimeoutError as exc:
        bound = timeout_s if timeout_s_named is None else timeout_s_named
        raise TimeoutError(f"request {request_id}: no answer from {node.kind} node {node.address} "
                           f"within {bound:g} s") from exc
    if isinstance(message, Exception):  # NodeDied from the pool's watcher, or the proxy's drain ending it
        raise message
    return message


def _send_quietly(node: NodeClient, message: protocol.Abort | protocol.ReleaseKV, request_id: str) -> None:
    try:
        node.send(message)
    except NodeDied:
        logger.warning("could not send %s for %s to %s: node not accepting", type(message).__name__, request_id,
                       node.address)
