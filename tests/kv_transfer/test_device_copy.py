"""KV reads between two nodes of one host with their caches on GPUs as device copies over CUDA IPC
(kv_transfer.cuda_ipc), and the sockets a read under way wakes the node's loop on (a confirmation's
answer): the copies' plan (runs of consecutive blocks, else a bounded gather and scatter), the
route to a peer's cache (its GPU, another GPU of this host, or UCX) and the probe a peer on another
GPU must pass, on the CPU; the offer in NIXL's handshake (an older reader's format still decodes);
and, on a GPU, a holder process's blocks read by copies, equal, confirmed and released as NIXL's
reads are, also along the other-GPU route (its probe checked); turned off, the same reads go through
UCX."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import torch

from kv_transfer import cuda_ipc
from kv_transfer.config import TransferConfig
from kv_transfer.factory import create_connector
from kv_transfer.messages import CudaIpcCache, NixlAgentInfo, NixlShardInfo
from kv_transfer.nixl_connector import _NixlPeer
from kv_transfer.shards import HeadSegment
from kv_transfer.side_channel_connector import Peer
from tests.kernels.conftest import gpu, requires_cuda
from tests.kv_transfer.helpers import poll_until
from tests.kv_transfer.test_connectors import LAYOUT, holders  # noqa: F401 - holders: a fixture

OFFER = CudaIpcCache(gpu_uuid="GPU-1", handle=b"h", size_bytes=4096, offset_bytes=0, ref_counter_handle=b"r",
                     ref_counter_offset=0, event_handle=None, event_sync_required=False,
                     shape=[48, 3, 2, 16, 2, 16], stride=[3072, 1024, 512, 32, 16, 1], storage_offset=0,
                     dtype="float32")


def test_runs_join_blocks_consecutive_on_both_sides():
    assert cuda_ipc.runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]
    assert cuda_ipc.runs([1, 3, 5], [0, 1, 2]) == [(1, 0, 1), (3, 1, 1), (5, 2, 1)]
    assert cuda_ipc.runs([2, 3], [7, 6]) == [(2, 7, 1), (3, 6, 1)]  # consecutive on one side only
    assert cuda_ipc.runs([], []) == []


@pytest.mark.parametrize("scattered", [False, True])
def test_a_copy_read_puts_each_remote_block_into_its_local_block(scattered, monkeypatch):
    """Few runs: a copy each; many: gathered and scattered through a staging buffer of a few
    blocks (made small here, so that it takes several pieces)."""
    remote = torch.randn(40, 3, 2, 4, 2, 8)
    local = torch.zeros_like(remote)
    monkeypatch.setattr(cuda_ipc, "_STAGING_BYTES", 3 * remote[0].numel() * remote.element_size())
    rng = random.Random(0)
    if scattered:
        remote_ids, local_ids = rng.sample(range(40), 20), rng.sample(range(40), 20)
    else:  # two runs
        remote_ids, local_ids = [*range(5, 15), *range(30, 40)], [*range(10, 20), *range(22, 32)]
    copied = []
    monkeypatch.setattr(cuda_ipc, "_gather_scatter", lambda *a, f=cuda_ipc._gather_scatter: (copied.append(1), f(*a)))
    read = cuda_ipc.CopyRead([(local, remote)], local_ids, remote_ids, streams=None)
    assert read.is_done()
    assert torch.equal(local[local_ids], remote[remote_ids])
    untouched = sorted(set(range(40)) - set(local_ids))
    assert not local[untouched].any()
    assert bool(copied) == scattered and len(cuda_ipc.runs(local_ids, remote_ids)) == (20 if scattered else 2)


def test_the_offer_rides_nixls_handshake_and_an_older_holders_info_decodes_without_it():
    shard = NixlShardInfo(1, 2, 3, 4, 0, 2, 0)
    info = NixlAgentInfo(agent_metadata=b"m", shards=[shard], num_blocks=48, mem_type="VRAM", cuda_ipc=OFFER)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=NixlAgentInfo) == info

    class OlderInfo(msgspec.Struct, tag="nixl_agent_info", frozen=True):
        agent_metadata: bytes
        shards: list[NixlShardInfo]
        num_blocks: int
        mem_type: str

    older = msgspec.msgpack.encode(OlderInfo(b"m", [shard], 48, "VRAM"))
    assert msgspec.msgpack.decode(older, type=NixlAgentInfo).cuda_ipc is None
    # and an older reader, knowing no such field, reads the newer info as before
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=OlderInfo).num_blocks == 48


def test_a_host_memory_cache_is_never_offered_nor_mapped():
    connector = create_connector(TransferConfig(backend="nixl"), torch.zeros(48, 3, 2, 16, 2, 16), LAYOUT, "p")
    try:
        assert connector._offers == [] and connector._probe_offers == []
        info = NixlAgentInfo(agent_metadata=b"m", shards=[NixlShardInfo(1, 2, 3, 4, 0, 2, 0)], num_blocks=48,
                             mem_type="VRAM", cuda_ipc=OFFER)
        assert connector._device_copies(info) is None
        assert cuda_ipc.route(OFFER, torch.zeros(1), "auto") is None
    finally:
        connector.close()


class _GpuCache:
    """A stand-in for a CUDA cache as route() reads one: on GPU "GPU-1", OFFER's shape and dtype."""

    is_cuda = True
    shape = tuple(OFFER.shape)
    dtype = torch.float32
    device = torch.device("cuda", 0)

    @staticmethod
    def element_size() -> int:
        return 4


def test_a_peers_cache_is_copied_from_this_gpu_or_another_of_this_host_as_the_mode_allows(monkeypatch):
    monkeypatch.setattr(cuda_ipc, "gpu_uuid", lambda device: "GPU-1")
    offer = msgspec.structs.replace(OFFER, size_bytes=48 * 3072 * 4, host_id=cuda_ipc.host_id())
    other_gpu = msgspec.structs.replace(offer, gpu_uuid="GPU-2")
    assert cuda_ipc.host_id()  # this host's boot id and PID namespace, on Linux
    for mode, same, peer in (("auto", "same-gpu", "peer-gpu"), ("same-gpu", "same-gpu", None), ("off", None, None)):
        assert cuda_ipc.route(offer, _GpuCache(), mode) == same, mode
        assert cuda_ipc.route(other_gpu, _GpuCache(), mode) == peer, mode
    # another host (or PID namespace), an older holder that names none, another shape or dtype: UCX
    assert cuda_ipc.route(msgspec.structs.replace(other_gpu, host_id="elsewhere"), _GpuCache(), "auto") is None
    assert cuda_ipc.route(msgspec.structs.replace(other_gpu, host_id=""), _GpuCache(), "auto") is None
    assert cuda_ipc.route(msgspec.structs.replace(offer, shape=[48, 3, 2, 16, 2, 8]), _GpuCache(), "auto") is None
    assert cuda_ipc.route(msgspec.structs.replace(offer, dtype="bfloat16"), _GpuCache(), "auto") is None
    assert cuda_ipc.route(OFFER, _GpuCache(), "auto") is None  # its view leaves the memory it shares
    # a rank's cache of other heads than ours (tensor parallelism): copied head by head
    one_head = msgspec.structs.replace(offer, shape=[48, 3, 2, 16, 1, 16], stride=[1536, 512, 256, 16, 16, 1],
                                       size_bytes=48 * 1536 * 4)
    assert cuda_ipc.route(one_head, _GpuCache(), "auto") == "same-gpu"


def test_the_probe_is_the_same_bytes_wherever_made_and_one_byte_off_fails_it():
    pattern = cuda_ipc.probe_pattern(torch.device("cpu"))
    assert pattern.dtype == torch.int32 and pattern.numel() * 4 == 1 << 20
    assert torch.equal(pattern, cuda_ipc.probe_pattern(torch.device("cpu"))) and pattern.unique().numel() > 1000
    cuda_ipc.check_probe(pattern.clone())
    wrong = pattern.clone()
    wrong[12345] ^= 1 << 8
    with pytest.raises(cuda_ipc.ProbeMismatch, match="other bytes"):
        cuda_ipc.check_probe(wrong)
    with pytest.raises(cuda_ipc.ProbeMismatch, match="shape"):
        cuda_ipc.check_probe(pattern[:-1].clone())


class _Mapped:
    """A mapped probe whose whole copy is right but whose rows gathered by a kernel are not (a
    platform where copy engines cross between GPUs and kernels' loads do not)."""

    def __init__(self, pattern: torch.Tensor) -> None:
        self._pattern, self.shape, self.device = pattern, pattern.shape, pattern.device

    def clone(self) -> torch.Tensor:
        return self._pattern.clone()

    def view(self, *shape):
        wrong = self._pattern.clone()
        wrong[-1] += 1
        return wrong.view(*shape)


def test_the_probe_is_also_gathered_by_a_kernel_as_scattered_reads_are():
    with pytest.raises(cuda_ipc.ProbeMismatch, match="other bytes"):
        cuda_ipc.check_probe(_Mapped(cuda_ipc.probe_pattern(torch.device("cpu"))))


PROBE = msgspec.structs.replace(OFFER, handle=b"probe", shape=[cuda_ipc.PROBE_NUMEL], stride=[1], dtype="int32",
                               size_bytes=4 * cuda_ipc.PROBE_NUMEL)


def _opened(probe: torch.Tensor, opened: list):
    """open_cache's stand-in: the probe offer maps probe, the cache offer a small tensor."""
    return lambda offer, device: opened.append(offer.handle) or (probe if offer.handle == b"probe" else torch.zeros(1))


def test_a_peer_on_another_gpu_is_copied_from_only_once_its_probe_reads_back_equal(monkeypatch):
    opened = []
    monkeypatch.setattr(cuda_ipc, "open_cache", _opened(cuda_ipc.probe_pattern(torch.device("cpu")), opened))
    mapped = cuda_ipc.MappedCache(OFFER, torch.device("cpu"), cuda_ipc.PEER_GPU, PROBE)
    mapped.get()
    assert opened == [b"probe", b"h"]
    mapped.release_if_idle(time.monotonic() + cuda_ipc.IDLE_RELEASE_S + 1)
    mapped.get()  # mapped again; the pair of GPUs was checked once
    assert opened == [b"probe", b"h", b"h"]
    wrong = cuda_ipc.probe_pattern(torch.device("cpu"))
    wrong[0] += 1
    monkeypatch.setattr(cuda_ipc, "open_cache", _opened(wrong, opened := []))
    refused = cuda_ipc.MappedCache(OFFER, torch.device("cpu"), cuda_ipc.PEER_GPU, PROBE)
    with pytest.raises(cuda_ipc.ProbeMismatch):
        refused.get()
    assert opened == [b"probe"] and not refused.is_mapped  # the cache itself never mapped


@pytest.mark.parametrize("probe", ["equal", "unequal", "none", "past-its-memory", "on-another-gpu"])
def test_a_connector_takes_a_peer_on_another_gpu_only_with_a_probe_that_passes(probe, monkeypatch):
    """A probe offer whose view leaves the memory it shares, or that is not on the cache's GPU, is no
    probe: never mapped."""
    connector = create_connector(TransferConfig(backend="nixl"), torch.zeros(48, 3, 2, 16, 2, 16), LAYOUT, "p")
    pattern = cuda_ipc.probe_pattern(torch.device("cpu"))
    if probe == "unequal":
        pattern[-1] = 0
    monkeypatch.setattr(cuda_ipc, "open_cache", _opened(pattern, []))
    monkeypatch.setattr(cuda_ipc, "route", lambda offer, cache, mode: cuda_ipc.PEER_GPU)
    try:
        offered = {"none": None, "past-its-memory": msgspec.structs.replace(PROBE, size_bytes=4),
                   "on-another-gpu": msgspec.structs.replace(PROBE, gpu_uuid="GPU-9")}.get(probe, PROBE)
        info = NixlAgentInfo(agent_metadata=b"m", shards=[NixlShardInfo(1, 2, 3, 4, 0, 2, 0)], num_blocks=48,
                             mem_type="VRAM", cuda_ipc=OFFER, cuda_ipc_probe=offered)
        copies = connector._device_copies(info)  # an older holder's info: one cache, one probe
        assert (copies is not None) == (probe == "equal")
        assert copies is None or copies.route == cuda_ipc.PEER_GPU
        assert copies is None or all(mapped.is_mapped for mapped in copies.mapped.values())
    finally:
        connector.close()


def test_a_peers_mapping_is_let_go_when_idle_and_made_again_at_the_next_read(monkeypatch):
    """A holder that went away must not keep its cache mapped (its GPU memory held) here."""
    opened = []
    monkeypatch.setattr(cuda_ipc, "open_cache", lambda offer, device: opened.append(offer) or torch.zeros(1))
    mapped = cuda_ipc.MappedCache(OFFER, torch.device("cpu"), cuda_ipc.SAME_GPU)
    assert not mapped.is_mapped
    first = mapped.get()
    assert mapped.get() is first and len(opened) == 1
    mapped.release_if_idle(time.monotonic() + cuda_ipc.IDLE_RELEASE_S / 2)
    assert mapped.is_mapped
    mapped.release_if_idle(time.monotonic() + cuda_ipc.IDLE_RELEASE_S + 1)
    assert not mapped.is_mapped
    mapped.get()
    assert mapped.is_mapped and len(opened) == 2
    # a connector's poll lets its idle peers' mappings go
    connector = create_connector(TransferConfig(backend="nixl"), torch.zeros(48, 3, 2, 16, 2, 16), LAYOUT, "p")
    try:
        connector._peers["holder"] = Peer("holder", "127.0.0.1:1", LAYOUT, None,
                                          handle=_NixlPeer("holder-agent", None, [], _copies(mapped)))
        mapped._used_at -= cuda_ipc.IDLE_RELEASE_S + 1
        assert connector.poll() == [] and not mapped.is_mapped
    finally:
        connector._peers.clear()
        connector.close()


def _copies(mapped: cuda_ipc.MappedCache) -> cuda_ipc.PeerCopies:
    """One cache of all LAYOUT's heads mapped for one of ours on the CPU."""
    return cuda_ipc.PeerCopies([HeadSegment(0, 0, 0, LAYOUT.num_kv_heads)], {(0, torch.device("cpu")): mapped})


def test_an_offer_whose_view_leaves_its_memory_is_not_taken():
    assert not cuda_ipc.fits(OFFER, 4)  # 48 blocks of 3,072 floats in 4,096 bytes
    big = msgspec.structs.replace(OFFER, size_bytes=48 * 3072 * 4)
    assert cuda_ipc.fits(big, 4) and not cuda_ipc.fits(msgspec.structs.replace(big, storage_offset=1), 4)
    assert not cuda_ipc.fits(msgspec.structs.replace(big, stride=[3072, 1024, 512, 32, 16, -1]), 4)
    assert not cuda_ipc.fits(msgspec.structs.replace(big, shape=[48, 3, 2, 16, 2]), 4)


class _Stream:
    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("failing", ["copy", "stream"])
def test_a_copy_that_cannot_start_leaves_the_read_and_the_peers_next_ones_to_ucx(failing, holders,  # noqa: F811
                                                                                  monkeypatch):
    """CPU stand-ins: the peer taken as on this GPU, its copies failing at once (a staging
    allocation the GPU refused, or the copy stream that could not be made): the read goes through
    UCX, whole and right, and so do the next."""
    from tests.kv_transfer.test_connectors import reader

    holder = holders("nixl", seed=6)
    connector, cache = reader("nixl")
    mapped = cuda_ipc.MappedCache(OFFER, torch.device("cpu"), cuda_ipc.SAME_GPU)
    monkeypatch.setattr(cuda_ipc, "open_cache", lambda offer, device: torch.zeros(1))
    monkeypatch.setattr(connector, "_device_copies", lambda info: _copies(mapped))

    class Refused(cuda_ipc.CopyRead):
        def __init__(self, *args) -> None:
            raise torch.OutOfMemoryError("no room for the staging buffer")

    if failing == "copy":
        monkeypatch.setattr(cuda_ipc, "CopyRead", Refused)
        connector._copy_stream = _Stream()
    else:
        def no_stream(*args, **kwargs):
            raise RuntimeError("CUDA error: out of memory")

        monkeypatch.setattr(torch.cuda, "Stream", no_stream)
    try:
        for request_id, remote, local in (("a", [3, 4], [10, 11]), ("b", [7], [20])):
            connector.start_read(request_id, holder.lease(request_id, remote), local)
            [result] = poll_until(connector, {request_id}, timeout_s=30).values()
            assert result.is_ok, result.error
            assert torch.equal(cache[local], holder.cache[remote])
        [peer] = connector._peers.values()
        assert peer.handle.device_copy is None and connector.num_device_copy_reads == 0
    finally:
        connector.close()


def _read_plans(num_blocks: int, seed: int = 2) -> dict[str, tuple[list[int], list[int]]]:
    """The CUDA test's reads, in order, as (remote ids, local ids): two runs of 8, then six scattered
    reads of 1, 3 or 20 blocks. Each read's local blocks are distinct; reads run one at a time, each
    checked before the next, so one read may write where an earlier one did."""
    rng = random.Random(seed)
    plans = {"contiguous": (list(range(8)), list(range(20, 28)))}
    for i in range(6):
        n = rng.choice([1, 3, 20])
        plans[f"r{i}"] = (rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n))
    return plans


def test_the_cuda_tests_reads_fit_the_cache_and_take_both_kinds_of_copy():
    """Run here, not only on a GPU: the plans must be buildable (they once drew more local blocks
    than the cache has, and the CUDA test failed before its first read)."""
    plans = _read_plans(LAYOUT.num_blocks)
    for remote, local in plans.values():
        assert len(remote) == len(local) == len(set(local))
        assert set(remote) | set(local) <= set(range(LAYOUT.num_blocks))
    kinds = {len(cuda_ipc.runs(local, remote)) > cuda_ipc._MAX_RUN_COPIES for remote, local in plans.values()}
    assert kinds == {False, True}  # copies run by run, and gathered and scattered


@gpu
@requires_cuda
@pytest.mark.parametrize("route", ["same-gpu", "peer-gpu", "off"])
def test_on_cuda_reads_from_this_host_are_device_copies_equal_confirmed_and_released(route, holders,  # noqa: F811
                                                                                     monkeypatch):
    """peer-gpu: the holder's GPU taken for another (this process names its own otherwise), so the
    reads go the way they would from another GPU of this host: its probe checked, its cache mapped."""
    holder = holders("nixl", seed=5, device="cuda")
    shape = (LAYOUT.num_blocks, LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    cache = torch.full(shape, float("nan"), device="cuda")
    if route == "peer-gpu":
        monkeypatch.setattr(cuda_ipc, "gpu_uuid", lambda device: "GPU-of-another-name")
    checked = []
    monkeypatch.setattr(cuda_ipc, "check_probe", lambda remote, f=cuda_ipc.check_probe: (checked.append(1), f(remote)))
    mode = "off" if route == "off" else "auto"
    connector = create_connector(TransferConfig(backend="nixl", device_copy=mode), cache, LAYOUT, "reader")
    try:
        plans = _read_plans(LAYOUT.num_blocks)
        for request_id, (remote, local) in plans.items():
            connector.start_read(request_id, holder.lease(request_id, remote), local)
            [result] = poll_until(connector, {request_id}, timeout_s=30).values()
            assert result.is_ok, result.error
            assert torch.equal(cache[local].cpu(), holder.cache[remote]), request_id
        assert holder.released(len(plans)) == set(plans)
        assert connector.num_device_copy_reads == (0 if route == "off" else len(plans))
        assert connector.transport == cuda_ipc.TRANSPORTS.get(route, connector.transport)
        assert route == "off" or connector.transport.transport == f"cuda_ipc/{route}"
        assert len(checked) == (0 if route == "off" else 1)  # the probe, once, on either route
    finally:
        connector.close()


def test_a_confirmation_awaited_is_a_socket_the_nodes_loop_waits_on():
    """While the holder's answer is awaited, the reader's connector names its socket
    (wake_sockets) and the node's control socket wait ends when it comes, not at its timeout;
    once answered, no socket is named."""
    import threading

    from kv_transfer.base import RemoteLease
    from kv_transfer.messages import ConfirmRead, LeaseRef, ReadConfirmed
    from kv_transfer.side_channel import SideChannelServer
    from kv_transfer.side_channel_connector import Confirmation, PendingRead
    from node.control import ControlSocket

    release = threading.Event()

    def held(message):
        release.wait(10)
        return ReadConfirmed(message.lease, True)

    server = SideChannelServer("127.0.0.1", 0, held)
    control = ControlSocket("127.0.0.1", 0, None)
    connector = create_connector(TransferConfig(backend="nixl"), torch.zeros(48, 3, 2, 16, 2, 16), LAYOUT, "d")
    try:
        ref = LeaseRef("r", 1)
        exchange = connector._requester.start(server.address, ConfirmRead("holder", ref), timeout_s=20.0)
        lease = RemoteLease("holder", server.address, [0], 1, 600.0)
        read = PendingRead("r", lease, [0], confirmation=Confirmation(exchange, "r", server.address, ref))
        connector._reads["r"] = read
        [socket] = connector.wake_sockets()
        assert socket is exchange.socket
        threading.Timer(0.2, release.set).start()
        started = time.monotonic()
        assert control.poll(10_000, connector.wake_sockets()) is False  # the answer ended it, not a frame
        assert time.monotonic() - started < 9.0
        assert read.confirmation.done() and read.confirmation.result() is True
        assert connector.wake_sockets() == []
    finally:
        release.set()
        connector._reads.clear()
        connector.close()
        control.close()
        server.close()


def test_an_unknown_device_copy_mode_is_refused_naming_the_modes():
    with pytest.raises(ValueError, match=r"device_copy must be one of \('auto', 'same-gpu', 'off'\), got 'peer'"):
        TransferConfig(backend="nixl", device_copy="peer")


def test_a_peer_rank_feeding_our_ranks_on_two_devices_is_left_to_ucx():
    """A process maps a peer's handle once (torch keeps one mapping per handle, CUDA opens it once):
    each peer rank's cache is mapped on the one device of our ranks its heads go to, or none is."""
    a, b = torch.device("cuda", 0), torch.device("cuda", 1)
    one_to_two = [HeadSegment(0, 0, 0, 2), HeadSegment(1, 0, 2, 4)]  # 1P + 1D(TP=2)
    assert cuda_ipc.mapping_devices(one_to_two, [a, a]) == {0: a}  # the ranks share a GPU
    assert cuda_ipc.mapping_devices(one_to_two, [a, b]) is None
    equal = [HeadSegment(0, 0, 0, 2), HeadSegment(1, 1, 2, 4)]  # TP=2 on both sides
    assert cuda_ipc.mapping_devices(equal, [a, b]) == {0: a, 1: b}
    two_to_one = [HeadSegment(0, 0, 0, 2), HeadSegment(0, 1, 2, 4)]
    assert cuda_ipc.mapping_devices(two_to_one, [b]) == {0: b, 1: b}
