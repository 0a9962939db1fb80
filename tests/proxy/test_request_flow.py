"""proxy.request_flow.run_request against a NodeClient without sockets: what it sends to the node
when the request ends early."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Iterator

import msgspec

from engine import protocol
from proxy.nodes import NodePool
from proxy.request_flow import run_request
from tests.proxy.test_nodes import _report


class _RecordingSocket:
    """Takes every message, as a connected node's socket does, and keeps them decoded."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, data: bytes, flags: int = 0) -> concurrent.futures.Future:
        self.sent.append(protocol.decode_to_node(data))
        sent: concurrent.futures.Future = concurrent.futures.Future()
        sent.set_result(None)
        return sent


def test_a_request_cancelled_as_its_next_tokens_arrive_is_aborted_on_its_node():
    """The client leaving (its choice task cancelled) in the same loop turn in which the node's
    next tokens are handed over: the cancellation must win and the node get Abort. (On Python
    3.11 asyncio.wait_for returned the tokens instead, and the request streamed on for nobody.)"""

    async def main() -> list:
        pool = NodePool((), ("127.0.0.1:1",), heartbeat_timeout_s=60)
        try:
            [node] = pool.decode
            node.socket = socket = _RecordingSocket()
            node.last_report, node.last_seen = _report(block_size=16, num_free_blocks=100), time.monotonic()

            async def consume() -> None:
                async for _ in run_request(pool, "r1", [1, 2, 3], protocol.SamplingOptions(max_tokens=100), 5.0, 5.0):
                    pass

            task = asyncio.create_task(consume())
            for _ in range(10):  # until the node holds the request
                await asyncio.sleep(0)
            assert [type(m) for m in socket.sent] == [protocol.DecodeRequest]
            node.queues["r1"].put_nowait(protocol.RequestDelta("r1", [protocol.TokenLogprob(7)], 0))
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            else:
                raise AssertionError("the cancelled request went on")
            return socket.sent
        finally:
            pool.context.term()

    sent = asyncio.run(main())
    assert [type(m) for m in sent] == [protocol.DecodeRequest, protocol.Abort]
    assert sent[1].request_ids == ["r1"]


@contextlib.contextmanager
def _streaming_pool(kv_stream_min_tokens: int | None = 0) -> Iterator[NodePool]:
    """One prefill and one decode node behind recording sockets, reporting; its context ended on
    the way out."""
    pool = NodePool(("127.0.0.1:1",), ("127.0.0.1:2",), heartbeat_timeout_s=60,
                    kv_stream_min_tokens=kv_stream_min_tokens)
    for node, role in ((pool.prefill[0], protocol.Role.PREFILL), (pool.decode[0], protocol.Role.DECODE)):
        node.socket = _RecordingSocket()
        node.last_report = msgspec.structs.replace(_report(block_size=16, num_free_blocks=100), role=role)
        node.last_seen = node.progress_changed_at = time.monotonic()
    try:
        yield pool
    finally:
        pool.context.term()


_HANDLE = protocol.KVHandle("p-1", "127.0.0.1:9", [3, 4, 5], 40, 7, 30.0)


def _part(num_blocks: int) -> protocol.KVProgress:
    return protocol.KVProgress("r", msgspec.structs.replace(_HANDLE, block_ids=_HANDLE.block_ids[:num_blocks],
                                                            num_tokens=16 * num_blocks))


def _streamed_request(pool: NodePool, tokens: list[int], max_tokens: int = 3) -> asyncio.Task:
    """Request "r" (a 40-token prompt) run on pool, its tokens appended to tokens as they come."""
    async def consume() -> None:
        async for step in run_request(pool, "r", list(range(1, 41)), protocol.SamplingOptions(max_tokens=max_tokens),
                                      5.0, 5.0):
            tokens.extend(t.token_id for t in step.tokens)

    return asyncio.create_task(consume())


async def _turn() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_a_streamed_prompt_reaches_its_decode_node_chunk_by_chunk_then_with_its_first_token():
    async def main() -> tuple[list, list, list[int]]:
        with _streaming_pool() as pool:
            [prefill], [decode] = pool.prefill, pool.decode
            tokens = []
            task = _streamed_request(pool, tokens, max_tokens=3)
            await _turn()
            assert decode.socket.sent == []  # no decode node before the first chunk's KV
            prefill.queues["r"].put_nowait(_part(1))
            await _turn()
            prefill.queues["r"].put_nowait(_part(2))
            await _turn()
            first = protocol.TokenLogprob(11)
            prefill.queues["r"].put_nowait(protocol.PrefillResult("r", first, 40, _HANDLE))
            await _turn()
            decode.queues["r"].put_nowait(protocol.RequestDelta("r", [protocol.TokenLogprob(12),
                                                                     protocol.TokenLogprob(13)], 1, "length"))
            await asyncio.wait_for(task, 5)
            return prefill.socket.sent, decode.socket.sent, tokens

    to_prefill, to_decode, tokens = asyncio.run(main())
    assert [type(m) for m in to_prefill] == [protocol.PrefillRequest] and to_prefill[0].stream_kv
    start, part, last = to_decode
    assert isinstance(start, protocol.DecodeRequest) and start.first_token is None
    assert start.kv_handle == _part(1).kv_handle and start.prompt_token_ids == list(range(1, 41))
    assert part == _part(2)
    assert last == protocol.KVProgress("r", _HANDLE, protocol.TokenLogprob(11))
    assert tokens == [11, 12, 13]


def test_a_prefill_failing_mid_stream_aborts_the_streamed_pull_too():
    async def main() -> tuple[list, list]:
        with _streaming_pool() as pool:
            [prefill], [decode] = pool.prefill, pool.decode
            task = _streamed_request(pool, [])
            await _turn()
            prefill.queues["r"].put_nowait(_part(1))
            await _turn()
            prefill.queues["r"].put_nowait(protocol.ErrorReply("r", "BadPrompt", "no", is_client_error=True))
            try:
                await asyncio.wait_for(task, 5)
            except Exception as exc:  # noqa: BLE001 - the client's error: the node refused the request
                assert "no" in str(exc)
            return prefill.socket.sent, decode.socket.sent

    to_prefill, to_decode = asyncio.run(main())
    assert [type(m) for m in to_decode] == [protocol.DecodeRequest, protocol.Abort]
    assert to_decode[1].request_ids == ["r"]


def test_with_streaming_off_the_prefill_is_not_asked_to_stream():
    async def main() -> list:
        with _streaming_pool(kv_stream_min_tokens=None) as pool:
            [prefill] = pool.prefill
            task = _streamed_request(pool, [])
            await _turn()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return prefill.socket.sent

    sent = asyncio.run(main())
    assert isinstance(sent[0], protocol.PrefillRequest) and not sent[0].stream_kv


def test_a_client_leaving_mid_stream_aborts_the_prefill_and_the_streamed_pull():
    async def main() -> tuple[list, list]:
        with _streaming_pool() as pool:
            [prefill], [decode] = pool.prefill, pool.decode
            task = _streamed_request(pool, [])
            await _turn()
            prefill.queues["r"].put_nowait(_part(1))
            await _turn()
            task.cancel()  # the client left while the prompt was still prefilled
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return prefill.socket.sent, decode.socket.sent

    to_prefill, to_decode = asyncio.run(main())
    assert [type(m) for m in to_prefill] == [protocol.PrefillRequest, protocol.Abort]
    assert [type(m) for m in to_decode] == [protocol.DecodeRequest, protocol.Abort]


def test_a_decode_node_refusing_the_streamed_pull_gets_the_prompt_the_usual_way_once_prefilled():
    """It answered (full) while the prompt was prefilled: the stream ends, and the prefilled prompt
    goes to a decode node picked then, with its whole handle, instead of failing before its first
    token (and being prefilled again)."""
    async def main() -> tuple[list, list[int]]:
        with _streaming_pool() as pool:
            [prefill], [decode] = pool.prefill, pool.decode
            tokens = []
            task = _streamed_request(pool, tokens, max_tokens=2)
            await _turn()
            prefill.queues["r"].put_nowait(_part(1))
            await _turn()
            decode.queues["r"].put_nowait(protocol.ErrorReply("r", protocol.QUEUE_FULL_ERROR_KIND, "full", False))
            prefill.queues["r"].put_nowait(protocol.PrefillResult("r", protocol.TokenLogprob(11), 40, _HANDLE))
            await _turn()
            decode.queues["r"].put_nowait(protocol.RequestDelta("r", [protocol.TokenLogprob(12)], 1, "length"))
            await asyncio.wait_for(task, 5)
            return decode.socket.sent, tokens

    to_decode, tokens = asyncio.run(main())
    assert [type(m) for m in to_decode] == [protocol.DecodeRequest, protocol.Abort, protocol.DecodeRequest]
    assert to_decode[2].kv_handle == _HANDLE and to_decode[2].first_token == protocol.TokenLogprob(11)
    assert tokens == [11, 12]
