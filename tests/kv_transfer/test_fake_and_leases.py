"""The connector contract through FakeConnector alone: what a read reports (success, injected
failure, timeout, layout mismatch, abort mid-transfer, a restarted holder) and what the holder
hears (poll_released). The block accounting around it is the real nodes' and is tested on them
(tests/nodes/test_node_transfers.py). Also LayoutMismatch, LeaseTable and TransferConfig alone."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kv_transfer.base import ReadResult
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
    return FakeConnector(config, cache_for(layout), layout, engine_id, registry, clock)


def make_reader(registry: FakeRegistry, clock: Clock, layout: KVLayout = LAYOUT, **kwargs) -> FakeConnector:
    config = TransferConfig(backend="fake", transfer_timeout_s=5.0)
    return FakeConnector(config, cache_for(layout, float("nan")), layout, "reader", registry, clock, **kwargs)


def start(reader: FakeConnector, request_id: str, holder: FakeConnector, remote_ids: list[int],
          local_ids: list[int]) -> None:
    reader.start_read(request_id, holder.engine_id, holder.agent_address, remote_ids, local_ids)


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
    assert holder.poll_released() == ["a"] and holder.poll_released() == []
    assert reader.num_reads_in_flight == 0


def test_injected_failure_is_reported_once_and_the_holder_is_not_told(world):
    registry, clock, holder = world
    reader = make_reader(registry, clock)
    reader.inject("a", "fail")
    start(reader, "a", holder, [0, 1], [0, 1])
    [result] = reader.poll()
    assert not result.is_ok and "request a" in result.error and "injected" in result.error
    assert reader.poll() == [] and reader.num_reads_in_flight == 0
    assert holder.poll_released() == []  # the caller decides: release_remote
    reader.release_remote("a", holder.engine_id, holder.agent_address)
    assert holder.poll_released() == ["a"]
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
    assert not result.is_ok and "within 5.0 s" in result.error
    assert reader.num_reads_in_flight == 0 and holder.poll_released() == []


def test_layout_mismatch_is_reported_with_both_values(world):
    registry, clock, holder = world
    reader = make_reader(registry, clock, msgspec.structs.replace(LAYOUT, head_dim=8, num_kv_heads=1))
    start(reader, "a", holder, [0], [0])
    [result] = reader.poll()
    assert not result.is_ok and "head_dim: local 8, remote 4" in result.error
    assert "num_kv_heads: local 1, remote 2" in result.error
    assert reader.kv_cache.isnan().all() and holder.poll_released() == []


def test_abort_during_transfer_writes_nothing_and_is_never_reported(world):
    registry, clock, holder = world
    reader = make_reader(registry, clock, num_polls_per_read=3)
    start(reader, "a", holder, [0, 1], [4, 5])
    assert reader.poll() == []  # under way
    reader.abort_read("a")
    assert reader.poll() == [] and reader.poll() == []  # never reported after the abort
    assert reader.kv_cache[[4, 5]].isnan().all() and reader.num_reads_in_flight == 0
    assert holder.poll_released() == []


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
    assert reader.kv_cache.isnan().all() and restarted.poll_released() == []


def test_release_to_a_holder_that_restarted_reaches_nobody(world):
    registry, clock, holder = world
    reader = make_reader(registry, clock)
    address = holder.agent_address
    holder.close()
    restarted = make_holder(registry, clock, engine_id="holder-new", port=int(address.split(":")[1]))
    reader.release_remote("a", holder.engine_id, address)
    assert restarted.poll_released() == []


def test_create_connector_makes_fakes_that_reach_each_other():
    registry = FakeRegistry()
    config = TransferConfig(backend="fake")
    holder = create_connector(config, cache_for(LAYOUT), LAYOUT, "p", fake_registry=registry)
    reader = create_connector(config, cache_for(LAYOUT, 0.0), LAYOUT, "d", fake_registry=registry)
    reader.start_read("a", holder.engine_id, holder.agent_address, [5, 6], [1, 0])
    assert reader.poll() == [ReadResult("a", True)] and holder.poll_released() == ["a"]
    assert torch.equal(reader.kv_cache[[1, 0]], holder.kv_cache[[5, 6]])
    with pytest.raises(ValueError, match="fake_registry"):
        create_connector(config, cache_for(LAYOUT), LAYOUT, "x")


def test_start_read_rejects_unequal_counts_duplicates_and_a_wrong_cache(world):
    registry, clock, holder = world
    reader = make_reader(registry, clock)
    with pytest.raises(ValueError, match="2 remote vs 1 local"):
        start(reader, "a", holder, [0, 1], [0])
    start(reader, "a", holder, [0], [0])
    with pytest.raises(ValueError, match="already has a read"):
        start(reader, "a", holder, [0], [0])
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


@pytest.mark.parametrize(("field", "value"), [("backend", "rdma"), ("side_channel_port", 70000),
                                              ("handshake_timeout_s", 0), ("transfer_timeout_s", -1.0),
                                              ("lease_timeout_s", 0.0), ("host", "")])
def test_transfer_config_names_the_bad_field_and_value(field, value):
    with pytest.raises(ValueError, match=field) as info:
        TransferConfig(**{field: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)
