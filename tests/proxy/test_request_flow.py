"""proxy.request_flow.run_request against a NodeClient without sockets: what it sends to the node
when the request ends early."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

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
