"""The life of one request across the nodes (prefill, KV handle, decode; or colocated), as an
async stream of token steps; a request ended early or failed is aborted on every node holding it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine import protocol
from proxy.errors import NodeDied, NodeRejected, NoNodeAvailable
from proxy.nodes import NodeClient, NodePool

logger = logging.getLogger(__name__)


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
    a node's token deltas do not continue each other: messages were lost) or TimeoutError.

    Disaggregated: PrefillRequest to a prefill node -> the first token (yielded at once) and a KV
    handle -> DecodeRequest to a decode node, which pulls the KV -> token batches. Colocated (no
    prefill nodes), or prefilled on the decode node because the prefill pool is backed up (see
    NodePool.pick_local_prefill): one DecodeRequest without a handle. Always leaves no request
    behind on any node: on an early exit the node holding it gets Abort, and a prefill lease the
    decode side never saw gets ReleaseKV."""
    cleanup = _Cleanup(request_id)
    try:
        local, result = await _prefill_or_pick_local(pool, request_id, prompt_ids, sampling, first_token_timeout_s,
                                                     cleanup)
        if result is not None and result.finish_reason is not None:
            cleanup.is_finished = True
            yield Step([result.first_token], result.finish_reason, result.prompt_logprobs)
            return
        first, handle = (result.first_token, result.kv_handle) if result is not None else (None, None)
        decode = local or pool.pick_decode(cleanup.lease_holder)  # NOTE: the holder's KV layout, if any
        if decode is None:
            raise NoNodeAvailable("no healthy decode node" + (f" shares the KV layout of prefill node "
                                                              f"{cleanup.lease_holder.address}"
                                                              if cleanup.lease_holder else ""))
        queue = decode.open(request_id)
        cleanup.holder = decode
        decode.send_request(protocol.DecodeRequest(request_id, prompt_ids, sampling, first, handle, time.time()))
        cleanup.lease_holder = None  # NOTE: the decode node releases the lease from here on, pulled or not
        if first is not None:
            yield Step([first], prompt_logprobs=result.prompt_logprobs)
        async for step in _decode_steps(queue, decode, request_id, first is None, first_token_timeout_s,
                                        token_timeout_s):
            cleanup.is_finished = step.finish_reason is not None
            yield step
    except NodeRejected:
        cleanup.is_finished = True  # the node has dropped the request already
        raise
    finally:
        cleanup.run()


@dataclass
class _Cleanup:
    """What the nodes still hold of one request, released when it ends (run())."""

    request_id: str
    holder: NodeClient | None = None  # the node that must be told to abort
    lease_holder: NodeClient | None = None  # a prefill node holding KV nobody will pull
    is_finished: bool = False

    def run(self) -> None:
        if self.holder is not None:
            self.holder.close(self.request_id)
            if not self.is_finished:
                _send_quietly(self.holder, protocol.Abort([self.request_id]), self.request_id)
        if self.lease_holder is not None:
            _send_quietly(self.lease_holder, protocol.ReleaseKV([self.request_id]), self.request_id)


async def _prefill_or_pick_local(pool: NodePool, request_id: str, prompt_ids: list[int],
                                 sampling: protocol.SamplingOptions, timeout_s: float,
                                 cleanup: _Cleanup) -> tuple[NodeClient | None, protocol.PrefillResult | None]:
    """Prefill on the prefill pool unless a decode node should prefill the prompt itself.
    Returns (that decode node, None), (None, the prefill's result), or (None, None) when
    colocated (no prefill nodes)."""
    if not pool.prefill:
        return None, None
    prefill = pool.pick_prefill()
    if prefill is None:
        raise NoNodeAvailable(pool.no_kv_path() or "no healthy prefill node")
    local = pool.pick_local_prefill(prefill, len(prompt_ids))
    if local is not None:
        return local, None
    cleanup.holder = prefill
    result = await _prefill(prefill, request_id, prompt_ids, sampling, timeout_s)
    cleanup.holder = None  # the prefill is done; from here on the node only holds the lease
    if result.kv_handle is not None:
        cleanup.lease_holder = prefill
    return None, result


async def _decode_steps(queue: asyncio.Queue, decode: NodeClient, request_id: str, is_colocated: bool,
                        first_token_timeout_s: float, token_timeout_s: float) -> AsyncIterator[Step]:
    timeout_s = first_token_timeout_s if is_colocated else token_timeout_s
    next_token_idx = 0 if is_colocated else 1  # NOTE: a prefill node sampled token 0
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


async def _prefill(node: NodeClient, request_id: str, prompt_ids: list[int], sampling: protocol.SamplingOptions,
                   timeout_s: float) -> protocol.PrefillResult:
    queue = node.open(request_id)
    try:
        node.send_request(protocol.PrefillRequest(request_id, prompt_ids, sampling, time.time()))
        message = await _next(queue, timeout_s, node, request_id)
    finally:
        node.close(request_id)
    if isinstance(message, protocol.ErrorReply):
        raise NodeRejected(message)
    return message


async def _next(queue: asyncio.Queue, timeout_s: float, node: NodeClient, request_id: str):
    try:
        message = await asyncio.wait_for(queue.get(), timeout_s)
    except asyncio.TimeoutError as exc:
        raise TimeoutError(f"request {request_id}: no answer from {node.kind} node {node.address} "
                           f"within {timeout_s:.0f} s") from exc
    if isinstance(message, NodeDied):
        raise message
    return message


def _send_quietly(node: NodeClient, message: protocol.Abort | protocol.ReleaseKV, request_id: str) -> None:
    try:
        node.send(message)
    except NodeDied:
        logger.warning("could not send %s for %s to %s: node not accepting", type(message).__name__, request_id,
                       node.address)
