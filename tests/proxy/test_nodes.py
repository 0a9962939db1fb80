"""Routing in the proxy's NodePool from the nodes' own LoadReports, without sockets."""

from __future__ import annotations

import concurrent.futures
import time

from engine import protocol
from proxy.node_client import NodeClient
from proxy.nodes import NodePool


class _AcceptingSocket:
    """Takes every message, as a connected node's socket does."""

    def send(self, _data: bytes, flags: int = 0) -> concurrent.futures.Future:
        sent: concurrent.futures.Future = concurrent.futures.Future()
        sent.set_result(None)
        return sent


def _report(block_size: int, num_free_blocks: int, num_promised_blocks: int = 0) -> protocol.LoadReport:
    return protocol.LoadReport(
        node_id="n", role=protocol.Role.DECODE, protocol_version=protocol.PROTOCOL_VERSION, model_name="m",
        max_model_len=256, block_size=block_size, num_running=0, num_waiting=0, num_queued_prompt_tokens=0,
        num_free_blocks=num_free_blocks, num_total_blocks=100, num_promised_blocks=num_promised_blocks)


def _reporting(node: NodeClient, report: protocol.LoadReport) -> None:
    node.socket = _AcceptingSocket()
    node.last_report, node.last_seen = report, time.monotonic()


def test_decode_pick_counts_unreported_prompts_in_each_nodes_own_block_size():
    pool = NodePool((), ("127.0.0.1:1", "127.0.0.1:2"), heartbeat_timeout_s=60)
    try:
        small_blocks, large_blocks = pool.decode
        _reporting(small_blocks, _report(block_size=4, num_free_blocks=10))
        _reporting(large_blocks, _report(block_size=16, num_free_blocks=8))
        assert pool.pick_decode() is small_blocks  # 10 free blocks against 8
        for node in pool.decode:  # 20 prompt tokens each: 5 blocks of 4, 2 blocks of 16
            node.send_request(protocol.DecodeRequest("r", [1] * 20, protocol.SamplingOptions()))
        assert pool.pick_decode() is large_blocks  # 10 - 5 free against 8 - 2
    finally:
        pool.context.term()


def test_decode_pick_counts_blocks_promised_to_accepted_requests_as_taken():
    """A node that acknowledged a prompt but has not scheduled it yet (its blocks are taken per
    prefill chunk) still reports them free; the pick must not pile the next prompts onto it."""
    pool = NodePool((), ("127.0.0.1:1", "127.0.0.1:2"), heartbeat_timeout_s=60)
    try:
        just_handed, decoding = pool.decode
        _reporting(just_handed, _report(block_size=16, num_free_blocks=100, num_promised_blocks=64))
        _reporting(decoding, _report(block_size=16, num_free_blocks=50))  # a long decode holds 50
        assert pool.pick_decode() is decoding  # 100 - 64 = 36 unclaimed against 50
        _reporting(just_handed, _report(block_size=16, num_free_blocks=100))  # it finished
        assert pool.pick_decode() is just_handed
    finally:
        pool.context.term()
