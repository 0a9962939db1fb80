"""The connector contract through FakeConnector alone: what a read reports (success, injected
failure, timeout, layout mismatch, abort mid-transfer, a restarted holder, a lease that ended
before the read was confirmed) and what the holder's lease table sees. The block accounting
around it is the real nodes' and is tested on them (tests/nodes/test_node_transfers.py). Also
LayoutMismatch, LeaseTable (generations, renewal, ending from another thread) and
TransferConfig alone."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kv_transfer.base import FailureCode, ReadResult, RemoteLease
from kv_transfer.config import TransferConfig
from kv_transfer.errors import LayoutMismatch
from kv_transfer.factory import create_connector
from kv_transfer.fake import FakeConnector, FakeRegistry
from kv_transfer.layout import KVLayout, check_compatible
from kv_transfer.lease import LeaseTable

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32", num_blocks=12,
                  model_fingerprint="fp", code_version="1")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def cache_for(layout: KVLayout, fill: float | None = None) -> torch.Tensor:
    shape = (layout.num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return torch.randn(shape) if fill is None else torch.full(shape, fill)


def make_holder(registry: FakeRegistry, clock: Clock, layout: KVLayout = LAYOUT, engine_id: str = "holder",
                port: int = 0) -> FakeConnector:
    config = TransferConfig(backend="fake", side_channel_port=port)
    holder = FakeConnector(config, cache_for(layout), layout, engine_id, registry, clock)
    holder.serve_leases(LeaseTable(60.0, clock))
    return holder


def lease(holder: FakeConnector, request_id: str, block_ids: list[int]) -> RemoteLease:
    """Lease block_ids on holder for request_id (what a prefill node does), as its handle names it."""
    generation = holder.leases.add(request_id, block_ids)
    return RemoteLease(holder.engine_id, holder.agent_address, block_ids, generation, holder.leases.lease_timeout_s)


def ended(holder: FakeConnector) -> list[str]:
    """Request ids whose leases readers ended since the last call (the holder frees their blocks)."""
    return [request_id for request_id, _ in holder.leases.pop_ended()]


def make_reader(registry: FakeRegistry, clock: Clock, layout: KVLayout = LAYOUT, **kwargs) -> FakeConnector:
    config = TransferConfig(backend="fake", transfer_timeout_s=5.0)
    return FakeConnector(config, cache_for(layout, float("nan")), layout, "reader", registry, clock, **kwargs)


def start(reader: FakeConnector, request_id: str, holder: FakeConnector, remote_ids: list[int],
          local_ids: list[int]) -> RemoteLease:
    held = lease(holder, request_id, remote_ids)
    reader.start_read(request_id, held, local_ids)
    return held


@pytest.fixture
def world():
    registry, clock = FakeRegistry(), Clock()
    return registry, clock, make_holder(registry, clock)


def test_read_copies_blocks_into_other_ids_and_tells_the_holder(world):
    registry, clock, holder = world
    reader = make_reader(registry, clock)
    start(reader, "a", holder, [0, 1, 2], [11, 10, 9])  # not the holder's order
    assert reader.poll() == [ReadResult("a", True)]
    assert torch.equal(reader.kv_cache[[11, 10, 9]], holder.kv_cache[[0, 1, 2]])
    assert reader.kv_cache[:9].isnan().all()  # nothing else written
    assert ended(holder) == ["a"] and ended(holder) == [] and len(holder.leases) == 0
    assert reader.num_reads_in_flight == 0


def test_injected_failure_is_reported_once_and_the_holder_is_not_told(world):
    registry, clock, holder = world
    reader = make_reader(registry, clock)
    reader.inject("a", "fail")
    held = start(reader, "a", holder, [0, 1], [0, 1])
    [result] = reader.poll()
    assert not result.is_ok and "request a" in result.error and "injected" in result.error
    assert result.failure is FailureCode.TRANSFER
    assert reader.poll() == [] and reader.num_reads_in_flight == 0
    assert ended(holder) == [] and len(holder.leases) == 1  # the caller decides: release_remote
    reader.release_remote("a", held)
    assert ended(holder) == ["a"]
    assert reader.kv_cache.isnan().all()


def test_read_that_never_completes_times_out(world):
    registry, clock, holder = world
    reader = make_reader(registry, clock)
    reader.inject("a", "hang")
    start(reader, "a", holder, [0, 1], [0, 1])
    clock.now += 4.9
    assert reader.poll() == []
    clock.now += 0.2  # past transfer_timeout_s = 5
    [result] = reader.poll()
    assert not result.is_ok and "within 5.0 s" in result.error and result.failure is FailureCode.TIMEOUT
    assert reader.num_reads_in_flight == 0 and ended(holder) == []


def test_layout_mismatch_is_reported_with_both_values(world):
    registry, clock, holder = world
    reader = make_reader(registry, clock, msgspec.structs.replace(LAYOUT, head_dim=8, num_kv_heads=1))
    start(reader, "a", holder, [0], [0])
    [result] = reader.poll()
    assert not result.is_ok and "head_dim: local 8, remote 4" in result.error
    assert "num_kv_heads: local 1, remote 2" in result.error and result.failure is FailureCode.LAYOUT_MISMATCH
    assert reader.kv_cache.isnan().all() and ended(holder) == []


def test_abort_during_transfer_writes_nothing_and_is_never_reported(world):
    registry, clock, holder = world
    reader = make_reader(registry, clock, num_polls_per_read=3)
    start(reader, "a", holder, [0, 1], [4, 5])
    assert reader.poll() == []  # under way
    reader.abort_read("a")
    assert reader.poll() == [] and reader.poll() == []  # never reported after the abort
    assert reader.kv_cache[[4, 5]].isnan().all() and reader.num_reads_in_flight == 0
    assert ended(holder) == []


def test_restarted_holder_is_not_read_under_its_old_engine_id(world):
    registry, clock, holder = world
    reader = make_reader(registry, clock)
    address = holder.agent_address
    holder.close()  # the prefill node restarts on the same port
    restarted = make_holder(registry, clock, engine_id="holder-new", port=int(address.split(":")[1]))
    assert restarted.agent_address == address
    start(reader, "a", holder, [0, 1], [0, 1])
    [result] = reader.poll()
    assert not result.is_ok and "'holder-new'" in result.error and holder.engine_id in result.error
    assert result.failure is FailureCode.HANDSHAKE
    assert reader.kv_cache.isnan().all() and ended(restarted) == []


def test_release_to_a_holder_that_restarted_reaches_nobody(world):
    registry, clock, holder = world
    reader = make_reader(registry, clock)
    address = holder.agent_address
    holder.close()
    restarted = make_holder(registry, clock, engine_id="holder-new", port=int(address.split(":")[1]))
    restarted.leases.add("a", [0, 1])  # generation 1, as the old holder's lease was
    reader.release_remote("a", RemoteLease(holder.engine_id, address, [0, 1], 1, 60.0))
    assert ended(restarted) == [] and len(restarted.leases) == 1


def test_create_connector_makes_fakes_that_reach_each_other():
    registry = FakeRegistry()
    config = TransferConfig(backend="fake")
    holder = create_connector(config, cache_for(LAYOUT), LAYOUT, "p", fake_registry=registry)
    holder.serve_leases(LeaseTable(60.0))
    reader = create_connector(config, cache_for(LAYOUT, 0.0), LAYOUT, "d", fake_registry=registry)
    reader.start_read("a", lease(holder, "a", [5, 6]), [1, 0])
    assert reader.poll() == [ReadResult("a", True)] and ended(holder) == ["a"]
    assert torch.equal(reader.kv_cache[[1, 0]], holder.kv_cache[[5, 6]])
    with pytest.raises(ValueError, match="fake_registry"):
        create_connector(config, cache_for(LAYOUT), LAYOUT, "x")


def test_start_read_rejects_unequal_counts_duplicates_and_a_wrong_cache(world):
    registry, clock, holder = world
    reader = make_reader(registry, clock)
    with pytest.raises(ValueError, match="2 remote vs 1 local"):
        reader.start_read("a", lease(holder, "a", [0, 1]), [0])
    reader.start_read("b", lease(holder, "b", [0]), [0])
    with pytest.raises(ValueError, match="already has a read"):
        reader.start_read("b", lease(holder, "c", [0]), [0])
    with pytest.raises(ValueError, match="dtype"):
        FakeConnector(TransferConfig(backend="fake"), cache_for(LAYOUT).double(), LAYOUT, "e", registry)


def test_check_compatible_names_every_differing_field_and_ignores_num_blocks():
    other = msgspec.structs.replace(LAYOUT, num_blocks=99)
    check_compatible(LAYOUT, other)
    other = msgspec.structs.replace(other, dtype="bfloat16", model_fingerprint="zz", code_version="2")
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(LAYOUT, other)
    message = str(info.value)
    for expected in ("dtype: local 'float32', remote 'bfloat16'", "model_fingerprint: local 'fp', remote 'zz'",
                     "code_version: local '1', remote '2'"):
        assert expected in message
    assert "num_blocks" not in message


def test_layout_goes_over_the_wire_unchanged():
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(LAYOUT), type=KVLayout) == LAYOUT


def test_lease_table_release_and_expiry():
    clock = Clock()
    leases = LeaseTable(5.0, clock)
    leases.add("a", [1, 2])
    clock.now += 3
    leases.add("b", [3])
    with pytest.raises(ValueError, match="request a"):
        leases.add("a", [4])
    assert leases.release("a") == [1, 2] and leases.release("a") is None
    assert leases.pop_expired(clock.now + 4.9) == []
    assert leases.pop_expired(clock.now + 5.0) == [("b", [3])] and len(leases) == 0


def test_lease_generations_gate_renewal_confirmation_and_release():
    clock = Clock()
    leases = LeaseTable(5.0, clock)
    first = leases.add("a", [1, 2], owner=b"p1")
    assert leases.release("a", owner=b"p2") is None  # another proxy's release changes nothing
    assert leases.release("a", owner=b"p1") == [1, 2]
    second = leases.add("a", [3], owner=b"p1")  # the same request id leased again: a new generation
    assert second != first
    assert not leases.renew("a", first) and not leases.end("a", first)  # meant for the old lease
    assert leases.blocks_of("a", first) is None and leases.blocks_of("a", second) == [3]
    clock.now += 4
    assert leases.renew("a", second)
    clock.now += 4  # 8 s after the start, 4 after the renewal
    assert leases.pop_expired() == []
    assert leases.end("a", second) and not leases.end("a", second)  # ended once, by its reader
    assert leases.pop_ended() == [("a", [3])] and leases.pop_ended() == [] and len(leases) == 0
    leases.add("b", [4], owner=b"p1")
    leases.add("c", [5], owner=b"p2")
    assert leases.release_owned(b"p1") == [("b", [4])] and leases.request_ids() == ["c"]


def test_a_streams_lease_hands_no_block_back_until_it_takes_over_the_finished_prompts():
    """Its blocks are a running request's until grow(owns_blocks=True): ending it any way hands
    none back (they would be freed twice); after the hand-over it ends as any lease."""
    clock = Clock()
    leases = LeaseTable(5.0, clock)
    streams = {rid: leases.add(rid, [1, 2], owner=b"p", owns_blocks=False) for rid in "abcde"}
    assert leases.grow("a", streams["a"], [1, 2, 7]) and leases.blocks_of("a", streams["a"]) == [1, 2, 7]
    with pytest.raises(ValueError, match="request a"):
        leases.grow("a", streams["a"], [2, 1, 7, 8])  # not where the lease's blocks begin
    assert not leases.grow("a", streams["a"] + 100, [1, 2, 7, 8])  # another generation: nothing done
    assert leases.end("a", streams["a"]) and leases.pop_ended() == []  # confirmed, but nothing to free
    assert leases.release("b") == []
    assert leases.release_owned(b"p") == [("c", []), ("d", []), ("e", [])]
    lease = leases.add("f", [4], owns_blocks=False)
    assert leases.grow("f", lease, [4, 5], owns_blocks=True)  # the prompt finished: its blocks are the lease's
    assert leases.end("f", lease) and leases.pop_ended() == [("f", [4, 5])]
    leases.add("g", [6], owns_blocks=False)
    assert leases.pop_expired(clock.now + 5.0) == [("g", [])]


def test_read_whose_lease_ended_first_is_reported_lease_lost_and_its_data_unused(world):
    registry, clock, holder = world
    reader = make_reader(registry, clock, num_polls_per_read=2)
    held = start(reader, "a", holder, [0, 1], [4, 5])
    assert reader.poll() == []  # under way
    assert holder.leases.pop_expired(clock.now + 60.0) == [("a", [0, 1])]  # expired: the holder reuses 0 and 1
    [result] = reader.poll()
    assert not result.is_ok and result.failure is FailureCode.LEASE_LOST and "not confirmed" in result.error
    reader.release_remote("a", held)  # what the node does on failure: a no-op for an ended lease
    assert ended(holder) == [] and reader.num_reads_in_flight == 0


def test_held_lease_is_renewed_until_released(world):
    registry, clock, holder = world
    reader = make_reader(registry, clock)
    held = lease(holder, "a", [0])
    reader.hold("a", held)
    clock.now += 50
    reader.renew_held()  # what the real connector's keeper thread does every lease_timeout_s / 3
    clock.now += 50  # 100 s after the lease began, 50 after the last renewal
    assert holder.leases.pop_expired() == [] and holder.leases.num_renewals == 2
    reader.release_remote("a", held)
    reader.renew_held()
    assert ended(holder) == ["a"] and holder.leases.num_renewals == 2


@pytest.mark.parametrize(("field", "value"), [("backend", "rdma"), ("side_channel_port", 70000),
                                              ("handshake_timeout_s", 0), ("transfer_timeout_s", -1.0),
                                              ("lease_timeout_s", 0.0), ("host", "")])
def test_transfer_config_names_the_bad_field_and_value(field, value):
    with pytest.raises(ValueError, match=field) as info:
        TransferConfig(**{field: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)
