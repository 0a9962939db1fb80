"""The life of one request across the nodes, as an async stream of token batches.

Disaggregated: PrefillRequest to a prefill node -> the first token (yielded at once) and a KV
handle -> DecodeRequest to a decode node, which pulls the KV -> token batches. Colocated (no
prefill nodes), or prefilled on the decode node because the prefill pool is backed up (see
NodePool.pick_local_prefill): one DecodeRequest without a handle. If the consumer stops early (client gone,
stop string) or anything fails, the node(s) holding the request are told to abort it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine import protocol
from proxy.nodes import NodeClient, NodeDied, NodePool

logger = logging.getLogger(__name__)


class NoNodeAvailable(Exception):
    """No healthy node of a needed kind."""


class NodeRejected(Exception):
    """A node answered with an ErrorReply."""

    def __init__(self, reply: protocol.ErrorReply) -> None:
        super().__init__(reply.message)
        self.reply = reply


@dataclass
class Step:
    tokens: list[protocol.TokenLogprob]
    finish_reason: str | None = None


async def run_request(pool: NodePool, request_id: str, prompt_ids: list[int], sampling: protocol.SamplingOptions,
                      first_token_timeout_s: float, token_timeout_s: float) -> AsyncIterator[Step]:
    """Yields the request's tokens; raises NoNodeAvailable, NodeRejected, NodeDied or
    TimeoutError. Always leaves no request behind on any node: on an early exit the node
    holding it gets Abort, and a prefill lease the decode side never saw gets ReleaseKV."""
    holder: NodeClient | None = None  # the node that must be told to abort
    lease_holder: NodeClient | None = None  # a prefill node holding KV nobody will pull
    finished = False
    try:
        first = handle = local = None
        if pool.prefill:
            prefill = pool.pick_prefill()
            if prefill is None:
                raise NoNodeAvailable("no healthy prefill node")
            local = pool.pick_local_prefill(prefill, len(prompt_ids))
            if local is None:
                holder = prefill
                result = await _prefill(prefill, request_id, prompt_ids, sampling, first_token_timeout_s)
                holder = None  # the prefill is done; from here on the node only holds the lease
                first, handle = result.first_token, result.kv_handle
                if result.finish_reason is not None:
                    finished = True
                    yield Step([first], result.finish_reason)
                    return
                lease_holder = prefill if handle is not None else None
        decode = local or pool.pick_decode()
        if decode is None:
            raise NoNodeAvailable("no healthy decode node")
        queue = decode.open(request_id)
        holder = decode
        decode.send_request(protocol.DecodeRequest(request_id, prompt_ids, sampling, first, handle, time.time()))
        lease_holder = None  # NOTE: the decode node releases the lease from here on, pulled or not
        if first is not None:
            yield Step([first])
        async for step in _decode_steps(queue, decode, request_id, first is None, first_token_timeout_s,
                                        token_timeout_s):
            finished = step.finish_reason is not None
            yield step
    except NodeRejected:
        finished = True  # the node has dropped the request already
        raise
    finally:
        _clean_up(request_id, holder, lease_holder, finished)


async def _decode_steps(queue: asyncio.Queue, decode: NodeClient, request_id: str, is_colocated: bool,
                        first_token_timeout_s: float, token_timeout_s: float) -> AsyncIterator[Step]:
    timeout_s = first_token_timeout_s if is_colocated else token_timeout_s
    while True:
        message = await _next(queue, timeout_s, decode, request_id)
        timeout_s = token_timeout_s
        if isinstance(message, protocol.ErrorReply):
            raise NodeRejected(message)
        yield Step(list(message.tokens), message.finish_reason)
        if message.finish_reason is not None:
            return


def _clean_up(request_id: str, holder: NodeClient | None, lease_holder: NodeClient | None, finished: bool) -> None:
    if holder is not None:
        holder.close(request_id)
        if not finished:
            _send_quietly(holder, protocol.Abort([request_id]), request_id)
    if lease_holder is not None:
        _send_quietly(lease_holder, protocol.ReleaseKV([request_id]), request_id)


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
