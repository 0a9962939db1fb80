"""A prefill node's leases: the blocks of a finished prompt are freed on the reader's confirmed
read, on abort, and when the lease expires. Real engine, real NIXL connector, real sockets."""

from __future__ import annotations

import time

import pytest
import torch

from engine import protocol
from engine.protocol import Role
from kv_transfer.base import RemoteLease
from kv_transfer.config import TransferConfig
from kv_transfer.factory import create_connector
from kv_transfer.lease import LeaseTable
from node.config import ServerConfig
from node.transfer import connector_for, kv_layout
from prefill_node.server import PrefillNode
from tests.nodes.conftest import DEFAULT_MAX_NUM_SEQS, make_engine, next_message

LEASE_S = 1.0


def test_lease_table_release_expiry_and_double_add():
    now = [100.0]
    table = LeaseTable(5.0, clock=lambda: now[0])
    table.add("a", [1, 2])
    table.add("b", [3])
    with pytest.raises(ValueError, match="already"):
        table.add("a", [9])
    assert table.release("a") == [1, 2] and table.release("a") is None
    now[0] += 4.9
    assert table.pop_expired() == []
    now[0] += 0.2
    assert table.pop_expired() == [("b", [3])] and len(table) == 0


@pytest.fixture
def prefill_node(tiny_model_dir, serve_node):
    engine = make_engine(tiny_model_dir, Role.PREFILL, max_num_seqs=DEFAULT_MAX_NUM_SEQS)
    layout = kv_layout(engine)
    connector = connector_for(engine, TransferConfig(lease_timeout_s=LEASE_S), "prefill-test")
    node, _, socket = serve_node(PrefillNode(engine, ServerConfig("prefill-test"), connector, lease_timeout_s=LEASE_S))
    return node, socket, layout


def prefill(socket, request_id: str, num_tokens: int) -> protocol.PrefillResult:
    options = protocol.SamplingOptions(max_tokens=8, temperature=0.0)
    socket.send(protocol.encode(protocol.PrefillRequest(request_id, list(range(10, 10 + num_tokens)), options)))
    return next_message(socket, protocol.PrefillResult, timeout_s=30)


def wait_free(node, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node.engine.num_free_blocks == node.engine.block_pool.num_blocks and len(node.leases) == 0:
            return True
        time.sleep(0.01)
    return False


def test_confirmed_read_frees_the_lease(prefill_node):
    node, socket, layout = prefill_node
    result = prefill(socket, "r1", 40)
    assert len(result.kv_handle.block_ids) == 3 and len(node.leases) == 1
    shape = (layout.num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    reader = create_connector(TransferConfig(), torch.zeros(shape), layout, "reader")
    try:
        handle = result.kv_handle
        lease = RemoteLease(handle.engine_id, handle.agent_address, handle.block_ids, handle.generation,
                            handle.lease_timeout_s)
        reader.start_read("r1", lease, [5, 6, 7])
        deadline = time.monotonic() + 20
        results = []
        while not results and time.monotonic() < deadline:
            results = reader.poll()
        assert results and results[0].is_ok
        assert wait_free(node, timeout_s=LEASE_S / 2)  # well before expiry: the confirmation did it
        assert node.num_expired_leases == 0
    finally:
        reader.close()


def test_abort_frees_the_lease(prefill_node):
    node, socket, _ = prefill_node
    prefill(socket, "r2", 20)
    assert len(node.leases) == 1
    socket.send(protocol.encode(protocol.Abort(["r2"])))
    assert wait_free(node, timeout_s=LEASE_S / 2)
    assert node.num_expired_leases == 0


def test_unread_lease_expires_and_frees_its_blocks(prefill_node):
    node, socket, _ = prefill_node
    prefill(socket, "r3", 33)
    assert node.engine.num_free_blocks < node.engine.block_pool.num_blocks
    assert wait_free(node, timeout_s=LEASE_S * 3)
    assert node.num_expired_leases == 1
