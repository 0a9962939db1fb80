"""The connector contract through FakeConnector, with two toy nodes that allocate and free blocks
as the real ones do: success, injected failure, timeout, layout mismatch, abort mid-transfer,
a restarted holder, lease expiry. Each ends with a leak check. Also LayoutMismatch, LeaseTable
and TransferConfig on their own."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kv_transfer.base import ReadResult
from kv_transfer.cli import create_connector
from kv_transfer.config import TransferConfig
from kv_transfer.errors import LayoutMismatch
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


class ToyHolder:
    """A prefill node's block handling: allocate, lease, free what the connector reports."""

    def __init__(self, registry: FakeRegistry, clock: Clock, layout: KVLayout = LAYOUT) -> None:
        config = TransferConfig(backend="fake", lease_timeout_s=10.0)
        self.connector = FakeConnector(config, cache_for(layout), layout, f"holder-{id(self)}", registry, clock)
        self.free_ids = set(range(layout.num_blocks))
        self.leases = LeaseTable(config.lease_timeout_s, clock)

    def prefill(self, request_id: str, num_blocks: int) -> list[int]:
        block_ids = sorted(self.free_ids)[:num_blocks]
        self.free_ids -= set(block_ids)
        self.leases.add(request_id, block_ids)
        return block_ids

    def step(self) -> None:
        for request_id in self.connector.poll_released():
            self.free_ids |= set(self.leases.release(request_id) or [])
        for _, block_ids in self.leases.pop_expired():
            self.free_ids |= set(block_ids)


class ToyReader:
    """A decode node's block handling: allocate local blocks, pull, free them on failure/abort."""

    def __init__(self, registry: FakeRegistry, clock: Clock, layout: KVLayout = LAYOUT, **kwargs) -> None:
        config = TransferConfig(backend="fake", transfer_timeout_s=5.0)
        self.connector = FakeConnector(config, cache_for(layout, float("nan")), layout, "reader", registry, clock,
                                       **kwargs)
        self.free_ids = set(range(layout.num_blocks))
        self.pulls: dict[str, tuple[ToyHolder, list[int]]] = {}

    def pull(self, request_id: str, holder: ToyHolder, remote_ids: list[int]) -> list[int]:
        local_ids = sorted(self.free_ids, reverse=True)[:len(remote_ids)]  # not the holder's order
        self.free_ids -= set(local_ids)
        self.pulls[request_id] = (holder, local_ids)
        self.connector.start_read(request_id, holder.connector.engine_id, holder.connector.agent_address,
                                  remote_ids, local_ids)
        return local_ids

    def step(self) -> list[ReadResult]:
        results = self.connector.poll()
        for result in results:
            holder, local_ids = self.pulls.pop(result.request_id)
            if not result.is_ok:
                self.free_ids |= set(local_ids)
                self.connector.release_remote(result.request_id, holder.connector.engine_id,
                                              holder.connector.agent_address)
        return results

    def abort(self, request_id: str) -> None:
        holder, local_ids = self.pulls.pop(request_id)
        self.connector.abort_read(request_id)
        self.free_ids |= set(local_ids)
        self.connector.release_remote(request_id, holder.connector.engine_id, holder.connector.agent_address)


@pytest.fixture
def world():
    registry, clock = FakeRegistry(), Clock()
    return registry, clock, ToyHolder(registry, clock)


def assert_holder_has_nothing_leased(holder: ToyHolder) -> None:
    assert len(holder.leases) == 0 and holder.free_ids == set(range(LAYOUT.num_blocks))


def test_read_copies_blocks_and_holder_frees_them(world):
    registry, clock, holder = world
    reader = ToyReader(registry, clock)
    remote_ids = holder.prefill("a", 3)
    local_ids = reader.pull("a", holder, remote_ids)
    assert reader.step() == [ReadResult("a", True)]
    assert torch.equal(reader.connector.kv_cache[local_ids], holder.connector.kv_cache[remote_ids])
    holder.step()
    assert_holder_has_nothing_leased(holder)
    assert reader.free_ids == set(range(LAYOUT.num_blocks)) - set(local_ids)  # kept for decoding


def test_injected_failure_frees_both_sides(world):
    registry, clock, holder = world
    reader = ToyReader(registry, clock)
    reader.connector.inject("a", "fail")
    reader.pull("a", holder, holder.prefill("a", 2))
    [result] = reader.step()
    assert not result.is_ok and "request a" in result.error and "injected" in result.error
    holder.step()
    assert_holder_has_nothing_leased(holder)
    assert reader.free_ids == set(range(LAYOUT.num_blocks)) and reader.connector.num_reads_in_flight == 0


def test_read_that_never_completes_times_out_and_frees_both_sides(world):
    registry, clock, holder = world
    reader = ToyReader(registry, clock)
    reader.connector.inject("a", "hang")
    reader.pull("a", holder, holder.prefill("a", 2))
    clock.now += 4.9
    assert reader.step() == []
    clock.now += 0.2  # past transfer_timeout_s = 5
    [result] = reader.step()
    assert not result.is_ok and "within 5.0 s" in result.error
    holder.step()
    assert_holder_has_nothing_leased(holder)
    assert reader.free_ids == set(range(LAYOUT.num_blocks))


def test_layout_mismatch_is_reported_with_both_values_and_frees_both_sides(world):
    registry, clock, holder = world
    reader = ToyReader(registry, clock, msgspec.structs.replace(LAYOUT, head_dim=8, num_kv_heads=1))
    reader.pull("a", holder, holder.prefill("a", 1))
    [result] = reader.step()
    assert not result.is_ok and "head_dim: local 8, remote 4" in result.error
    assert "num_kv_heads: local 1, remote 2" in result.error
    holder.step()
    assert_holder_has_nothing_leased(holder)


def test_abort_during_transfer_frees_both_sides_and_writes_nothing(world):
    registry, clock, holder = world
    reader = ToyReader(registry, clock, num_polls_per_read=3)
    local_ids = reader.pull("a", holder, holder.prefill("a", 2))
    assert reader.step() == []  # under way
    reader.abort("a")
    assert reader.step() == [] and reader.step() == []  # never reported after the abort
    assert reader.connector.kv_cache[local_ids].isnan().all()
    holder.step()
    assert_holder_has_nothing_leased(holder)
    assert reader.free_ids == set(range(LAYOUT.num_blocks))


def test_restarted_holder_is_not_read_under_its_old_engine_id(world):
    registry, clock, holder = world
    reader = ToyReader(registry, clock)
    address = holder.connector.agent_address
    remote_ids = holder.prefill("a", 2)
    holder.connector.close()  # the prefill node restarts on the same port
    config = TransferConfig(backend="fake", side_channel_port=int(address.split(":")[1]))
    restarted = FakeConnector(config, cache_for(LAYOUT), LAYOUT, "holder-new", registry, clock)
    assert restarted.agent_address == address
    reader.pull("a", holder, remote_ids)
    [result] = reader.step()
    assert not result.is_ok and "'holder-new'" in result.error and holder.connector.engine_id in result.error
    assert reader.free_ids == set(range(LAYOUT.num_blocks))


def test_unread_lease_expires_and_frees_its_blocks(world):
    registry, clock, holder = world
    holder.prefill("a", 4)
    clock.now += 9.9
    holder.step()
    assert len(holder.leases) == 1
    clock.now += 0.2
    holder.step()
    assert_holder_has_nothing_leased(holder)


def test_late_release_after_expiry_frees_nothing_twice(world):
    registry, clock, holder = world
    reader = ToyReader(registry, clock)
    holder.prefill("a", 2)
    clock.now += 11
    holder.step()
    reader.connector.release_remote("a", holder.connector.engine_id, holder.connector.agent_address)
    holder.prefill("b", 2)  # reuses the freed blocks
    holder.step()
    assert len(holder.leases) == 1 and len(holder.free_ids) == LAYOUT.num_blocks - 2


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
    reader = ToyReader(registry, clock).connector
    with pytest.raises(ValueError, match="2 remote vs 1 local"):
        reader.start_read("a", holder.connector.engine_id, holder.connector.agent_address, [0, 1], [0])
    reader.start_read("a", holder.connector.engine_id, holder.connector.agent_address, [0], [0])
    with pytest.raises(ValueError, match="already has a read"):
        reader.start_read("a", holder.connector.engine_id, holder.connector.agent_address, [0], [0])
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
