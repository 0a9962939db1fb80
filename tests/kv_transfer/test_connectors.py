"""Real connectors between two processes: blocks arrive bit-identical, layouts are checked,
a holder refuses a foreign Hello by code, a dead holder fails reads within the timeout and
leaves nothing allocated on the live side, a read of a lease that ended first is discarded,
and with a cluster secret the side channel answers only its holders (and survives garbage)."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
import torch

from engine.kv_cache import stored_layer_major
from engine.protocol import curve_keys
from kv_transfer import side_channel
from kv_transfer.base import FailureCode, RemoteLease
from kv_transfer.config import TransferConfig
from kv_transfer.errors import HandshakeFailed, LayoutMismatch
from kv_transfer.factory import create_connector
from kv_transfer.handshake import check_reply
from kv_transfer.layout import KVLayout
from kv_transfer.messages import (
    SIDE_CHANNEL_VERSION,
    ConfirmRead,
    GlooStoreInfo,
    HandshakeErrorCode,
    Hello,
    HelloReply,
    LeaseRef,
    ReadConfirmed,
    RenewLeases,
)
from tests.conftest import child_env, dealer
from tests.kv_transfer.helpers import json_line, poll_until

PEER = Path(__file__).with_name("peer.py")
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32", num_blocks=48,
                  model_fingerprint="abc", code_version="1")


class Holder:
    """A peer.py process started on its own (no shared Python parent state), killed by pid."""

    def __init__(self, backend: str, seed: int, layout: KVLayout = LAYOUT, port: int = 0,
                 secret: str | None = None, storage: str = "block",
                 head_ranges: list[tuple[int, int]] | None = None, device: str = "cpu") -> None:
        env = child_env(PEER_STORAGE=storage, PEER_DEVICE=device, PEER_HEAD_RANGES=json.dumps(head_ranges or []))
        layout_json = msgspec.json.encode(layout).decode()
        argv = [sys.executable, str(PEER), backend, str(seed), layout_json, str(port), *([secret] if secret else [])]
        # its tail in the error where the holder ends or stalls; closed by kill()
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, env=env, start_new_session=True)
        hello = self._read_line(timeout_s=60)
        self.address, self.engine_id = hello["address"], hello["engine_id"]
        self._released: set[str] = set()  # seen while waiting for another answer
        shape = (layout.num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.cache = torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    def _read_line(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("{"):
                return json.loads(line)
            if self.proc.poll() is not None:
                raise RuntimeError(f"holder exited with {self.proc.returncode}; its stderr ends:\n{self.stderr_tail()}")
        raise TimeoutError(f"holder did not answer; its stderr ends:\n{self.stderr_tail()}")

    def stderr_tail(self, chars: int = 3000) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-chars:]

    def lease(self, request_id: str, block_ids: list[int]) -> RemoteLease:
        """Hold block_ids for request_id on the holder (as a prefill node does); the handle's lease."""
        self.proc.stdin.write(f"lease {request_id} {json.dumps(block_ids)}\n")
        self.proc.stdin.flush()
        line = self._answer("leased")
        assert line["leased"] == request_id, line
        return RemoteLease(self.engine_id, self.address, block_ids, line["generation"], 600.0)

    def expire(self, request_id: str) -> None:
        """End the lease as its expiry would, and overwrite its blocks as their reuse would."""
        self.proc.stdin.write(f"expire {request_id}\n")
        self.proc.stdin.flush()
        assert self._answer("expired") == {"expired": request_id}

    def _answer(self, key: str) -> dict:
        """The next line with key, keeping the releases printed before it."""
        while True:
            line = self._read_line(timeout_s=10)
            if key in line:
                return line
            self._released.add(line["released"])

    def released(self, count: int, timeout_s: float = 10.0) -> set[str]:
        ids, self._released = self._released, set()
        deadline = time.monotonic() + timeout_s
        while len(ids) < count and time.monotonic() < deadline:
            ids.add(self._read_line(timeout_s=deadline - time.monotonic())["released"])
        return ids

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._stderr.close()


@pytest.fixture
def holders():
    started: list[Holder] = []

    def start(*args, **kwargs) -> Holder:
        holder = Holder(*args, **kwargs)
        started.append(holder)
        return holder

    yield start
    for holder in started:
        holder.kill()


def reader(backend: str, layout: KVLayout = LAYOUT, storage: str = "block", **config):
    """A reader over a NaN-filled cache stored block-major (as CUDA engines store it) or
    layer-major (as CPU engines do: engine/kv_cache.py)."""
    shape = (layout.num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    cache = torch.full(shape, float("nan"), dtype=getattr(torch, layout.dtype))
    if storage == "layer":
        cache = stored_layer_major(cache)
    connector = create_connector(TransferConfig(backend=backend, **config), cache, layout, "reader")
    return connector, cache


def unleased(holder: Holder, block_ids: list[int], generation: int = 999) -> RemoteLease:
    """A lease the holder never made (for reads that fail before the holder is asked)."""
    return RemoteLease(holder.engine_id, holder.address, block_ids, generation, 600.0)


@pytest.mark.parametrize("backend", ["nixl", "gloo"])
@pytest.mark.parametrize(("holder_storage", "reader_storage"),
                         [("block", "block"), ("layer", "layer"), ("layer", "block"), ("block", "layer")])
def test_many_reads_into_non_contiguous_blocks_arrive_bit_identical(backend, holder_storage, reader_storage,
                                                                     holders):
    """Also between caches stored layer-major (CPU engines) and block-major (CUDA ones), either way."""
    holder = holders(backend, seed=1, storage=holder_storage)
    connector, cache = reader(backend, storage=reader_storage)
    assert cache.is_contiguous() == (reader_storage == "block")
    try:
        rng = random.Random(0)
        free = list(range(LAYOUT.num_blocks))
        rng.shuffle(free)
        plans = {}
        for i in range(8):  # 8 requests in flight at once, 1 to 5 blocks each
            n = rng.randint(1, 5)
            remote = rng.sample(range(LAYOUT.num_blocks), n)
            local = [free.pop() for _ in range(n)]
            plans[f"req-{i}"] = (remote, local)
            connector.start_read(f"req-{i}", holder.lease(f"req-{i}", remote), local)
        results = poll_until(connector, set(plans), timeout_s=30)
        assert all(r.is_ok for r in results.values()), [r.error for r in results.values()]
        for request_id, (remote, local) in plans.items():
            assert torch.equal(cache[local], holder.cache[remote]), request_id
        assert holder.released(len(plans)) == set(plans)
    finally:
        connector.close()


@pytest.mark.parametrize("backend", ["nixl", "gloo"])
def test_mismatched_layout_is_refused_naming_both_values(backend, holders):
    holder = holders(backend, seed=2)
    other = msgspec.structs.replace(LAYOUT, block_size=32, dtype="bfloat16")
    connector, _ = reader(backend, layout=other)
    try:
        connector.start_read("r", unleased(holder, [0]), [0])
        [result] = poll_until(connector, {"r"}, timeout_s=10).values()
        assert not result.is_ok and result.failure is FailureCode.LAYOUT_MISMATCH
        assert "block_size: local 16, remote 32" in result.error or "block_size: local 32, remote 16" in result.error
        assert "bfloat16" in result.error and "float32" in result.error
    finally:
        connector.close()


def test_holder_refuses_a_foreign_hello_by_code_and_the_reader_raises_by_code(holders):
    holder = holders("gloo", seed=4)
    valid = Hello(SIDE_CHANNEL_VERSION, "probe-1", LAYOUT, "gloo", GlooStoreInfo("127.0.0.1", 1))
    other_layout = msgspec.structs.replace(LAYOUT, head_dim=32)
    cases = {  # code -> (hello, what its message names); each refused before the holder joins a store
        HandshakeErrorCode.VERSION_MISMATCH: (msgspec.structs.replace(valid, version=SIDE_CHANNEL_VERSION + 1),
                                              f"remote {SIDE_CHANNEL_VERSION + 1}"),
        HandshakeErrorCode.BACKEND_MISMATCH: (msgspec.structs.replace(valid, backend="nixl"), "remote 'nixl'"),
        HandshakeErrorCode.BAD_BACKEND_INFO: (msgspec.structs.replace(valid, backend_info=None), "GlooStoreInfo"),
        HandshakeErrorCode.LAYOUT_MISMATCH: (msgspec.structs.replace(valid, layout=other_layout),
                                             "head_dim: local 16, remote 32"),
    }
    for code, (hello, named) in cases.items():
        reply = side_channel.request(holder.address, hello, timeout_s=5.0)
        assert isinstance(reply, HelloReply) and reply.refusal is not None and reply.refusal.code is code, reply
        assert named in reply.refusal.message and reply.engine_id == holder.engine_id
        expected = LayoutMismatch if code is HandshakeErrorCode.LAYOUT_MISMATCH else HandshakeFailed
        with pytest.raises(expected) as info:
            check_reply(reply, holder.address, LAYOUT, None)
        assert type(info.value) is expected and str(info.value) == reply.refusal.message


@pytest.mark.parametrize("backend", ["nixl", "gloo"])
def test_killed_holder_fails_reads_within_timeout_and_blocks_come_back(backend, holders):
    holder = holders(backend, seed=3)
    warm = holder.lease("warm", [0])
    env = child_env()
    reader_proc = subprocess.Popen(
        [sys.executable, str(PEER.with_name("reader.py")), backend, msgspec.json.encode(LAYOUT).decode(),
         holder.address, holder.engine_id, str(warm.generation)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        start_new_session=True,
    )
    try:
        assert json_line(reader_proc) == {"warm": True}
        holder.kill()
        reader_proc.stdin.write("go\n")
        reader_proc.stdin.flush()
        report = json_line(reader_proc)
        assert report["failed"] == [f"dead-{i}" for i in range(4)], report
        assert report["seconds"] < 3.0 + 2.0  # transfer_timeout_s plus slack
        assert report["still_allocated"] == {} and report["in_flight"] == 0
    finally:
        if reader_proc.poll() is None:
            reader_proc.kill()
        reader_proc.wait()


def test_holder_restarted_on_the_same_port_is_handshaken_again(holders):
    first = holders("nixl", seed=5)
    connector, cache = reader("nixl")
    try:
        connector.start_read("before", first.lease("before", [3]), [4])
        assert poll_until(connector, {"before"}, timeout_s=20)["before"].is_ok
        first.kill()
        port = int(first.address.rsplit(":", 1)[1])
        second = holders("nixl", seed=6, port=port)
        assert second.address == first.address and second.engine_id != first.engine_id
        connector.start_read("after", second.lease("after", [3, 7]), [4, 9])
        result = poll_until(connector, {"after"}, timeout_s=20)["after"]
        assert result.is_ok, result.error
        assert torch.equal(cache[[4, 9]], second.cache[[3, 7]])
        connector.start_read("stale", unleased(first, [3]), [5])  # the old peer was dropped
        result = poll_until(connector, {"stale"}, timeout_s=20)["stale"]
        assert not result.is_ok and "restarted" in result.error and second.engine_id in result.error
    finally:
        connector.close()


@pytest.mark.parametrize("backend", ["nixl", "gloo"])
def test_aborted_reads_never_write_their_blocks_and_holder_is_told(backend, holders):
    # 256 blocks of 768 KiB: a 200 MB read. NOTE: on one host UCX carries a NIXL READ out
    # inside the poll() that posts it, so NIXL reads can be aborted only before that poll
    # (during the handshake); a gloo read is still under way after it.
    layout = msgspec.structs.replace(LAYOUT, num_layers=24, num_kv_heads=8, head_dim=64, num_blocks=256)
    holder = holders(backend, seed=7, layout=layout)
    connector, cache = reader(backend, layout=layout)
    try:
        blocks = list(range(1, 256))
        early = holder.lease("early", blocks)
        connector.start_read("early", early, blocks)
        connector.abort_read("early")  # while the handshake is under way
        connector.start_read("warm", holder.lease("warm", [0]), [0])
        assert poll_until(connector, {"warm"}, timeout_s=20)["warm"].is_ok
        assert cache[blocks].isnan().all()
        big = holder.lease("big", blocks)
        connector.start_read("big", big, blocks)
        finished = connector.poll()
        assert backend == "nixl" or (finished == [] and connector.num_reads_in_flight == 1)
        connector.abort_read("big")
        cache[blocks] = 0.0  # the node reuses the blocks at once
        for request_id, lease in (("early", early), ("big", big)):
            connector.release_remote(request_id, lease)
        assert holder.released(3) == {"warm", "early", "big"}
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # nothing reports an aborted read or writes its blocks later
            assert [r.request_id for r in connector.poll()] == []
        assert (cache[blocks] == 0).all() and connector.num_reads_in_flight == 0
    finally:
        connector.close()


def test_a_nixl_read_whose_transfer_cannot_be_stopped_is_reported_only_once_it_ended(holders, monkeypatch):
    """NIXL refuses to release a READ while it is carried out (on one host UCX finishes it inside
    the call that posts it, so here NIXL is made to say so): an abort answers False and the read
    is reported (ABORTED) only once its transfer ended; a read that timed out meanwhile is
    withheld, and after another transfer_timeout_s reported with blocks_held."""
    from kv_transfer.base import TransferState

    holder = holders("nixl", seed=11)
    connector, _ = reader("nixl", transfer_timeout_s=1.0)
    stuck = {"on": False}
    release, state = connector._agent.release_xfer_handle, connector._state

    def refusing_release(handle):
        if stuck["on"]:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        return release(handle)

    monkeypatch.setattr(connector._agent, "release_xfer_handle", refusing_release)
    monkeypatch.setattr(connector, "_state", lambda h: (TransferState.IN_PROGRESS, "PROC") if stuck["on"] else state(h))

    def posted(request_id: str, blocks: list[int]) -> None:
        connector.start_read(request_id, holder.lease(request_id, blocks), blocks)
        stuck["on"] = True  # the peer is known: the next poll posts the READ
        assert connector.poll() == [] and connector._reads[request_id].handle is not None

    try:
        connector.start_read("warm", holder.lease("warm", [0]), [0])
        assert poll_until(connector, {"warm"}, timeout_s=20)["warm"].is_ok
        posted("a", [1, 2])
        assert connector.abort_read("a") is False and connector.num_reads_in_flight == 1
        assert [connector.poll() for _ in range(3)] == [[], [], []]
        with pytest.raises(ValueError, match="already has a read in flight"):
            connector.start_read("a", holder.lease("a2", [3]), [3])
        stuck["on"] = False
        [aborted] = poll_until(connector, {"a"}, timeout_s=5).values()
        assert aborted.failure is FailureCode.ABORTED and not aborted.blocks_held
        assert connector.num_reads_in_flight == 0

        posted("t", [4, 5])
        time.sleep(1.1)  # past transfer_timeout_s: it fails, but its transfer cannot be stopped
        assert connector.poll() == [] and connector.num_reads_in_flight == 1
        [timed_out] = poll_until(connector, {"t"}, timeout_s=5).values()
        assert timed_out.failure is FailureCode.TIMEOUT and timed_out.blocks_held
        assert connector.num_reads_in_flight == 0
    finally:
        stuck["on"] = False
        connector.close()


@pytest.mark.parametrize("backend", ["nixl", "gloo"])
def test_read_from_an_address_nobody_serves_fails_within_the_handshake_timeout(backend):
    import socket

    with socket.socket() as sock:  # a free port nobody listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    connector, cache = reader(backend, handshake_timeout_s=1.0)
    try:
        started = time.monotonic()
        connector.start_read("r", RemoteLease("nobody-1", address, [0], 1, 600.0), [0])
        result = poll_until(connector, {"r"}, timeout_s=10).get("r")
        assert result is not None and not result.is_ok and "no answer" in result.error and address in result.error
        assert result.failure is FailureCode.HANDSHAKE
        assert time.monotonic() - started < 1.0 + 1.0
        assert connector.num_reads_in_flight == 0 and cache[0].isnan().all()
    finally:
        connector.close()


@pytest.mark.parametrize("backend", ["nixl", "gloo"])
def test_read_of_a_lease_that_ended_first_is_discarded_as_lease_lost(backend, holders):
    holder = holders(backend, seed=8)
    connector, cache = reader(backend)
    try:
        connector.start_read("warm", holder.lease("warm", [0]), [0])
        assert poll_until(connector, {"warm"}, timeout_s=20)["warm"].is_ok
        lease = holder.lease("late", [3, 4])
        holder.expire("late")  # the holder freed the blocks and reused them before the read
        connector.start_read("late", lease, [5, 6])
        result = poll_until(connector, {"late"}, timeout_s=20)["late"]
        assert not result.is_ok and result.failure is FailureCode.LEASE_LOST, result
        # gloo scatters only confirmed reads; NIXL's READ landed, but the node frees those blocks.
        assert backend == "nixl" or cache[[5, 6]].isnan().all()
        connector.start_read("next", holder.lease("next", [7]), [8])  # the peer is still good
        assert poll_until(connector, {"next"}, timeout_s=20)["next"].is_ok
        assert torch.equal(cache[8], holder.cache[7])
    finally:
        connector.close()


def test_with_a_cluster_secret_only_its_holders_get_answers_and_blocks(holders):
    secret = "side-channel-secret-0123456789"
    holder = holders("nixl", seed=9, secret=secret)
    hello = Hello(SIDE_CHANNEL_VERSION, "probe", LAYOUT, "nixl")
    for keys in (None, curve_keys("another-secret-0123456789")):
        with pytest.raises(HandshakeFailed, match="no answer"):
            side_channel.request(holder.address, hello, timeout_s=1.0, keys=keys)
    reply = side_channel.request(holder.address, hello, timeout_s=5.0, keys=curve_keys(secret))
    assert isinstance(reply, HelloReply) and reply.refusal is None and reply.backend_info is not None
    for keys, is_member in ((None, False), (curve_keys(secret), True)):
        connector, cache = reader("nixl", curve_keys=keys, handshake_timeout_s=1.0)
        try:
            request_id = f"member-{is_member}"
            connector.start_read(request_id, holder.lease(request_id, [1, 2]), [3, 4])
            result = poll_until(connector, {request_id}, timeout_s=20)[request_id]
            assert result.is_ok is is_member, result
            assert torch.equal(cache[[3, 4]], holder.cache[[1, 2]]) is is_member
        finally:
            connector.close()


def test_side_channel_survives_garbage_and_answers_after_it(holders):
    holder = holders("nixl", seed=10)
    socket = dealer(holder.address)
    try:
        frame = side_channel.encode
        bad = [b"", b"\xff" * 64, b"KV\x00\x01" + msgspec.msgpack.encode({"x": 1}),  # another version
               frame(HelloReply(SIDE_CHANNEL_VERSION, "x", LAYOUT, "nixl")),  # not for a holder
               frame(RenewLeases("not-this-engine", [LeaseRef("r", 1)])),
               frame(RenewLeases(holder.engine_id, [LeaseRef("unknown", 7)])),
               b"KV" + SIDE_CHANNEL_VERSION.to_bytes(2, "big") + b"\x85\xa3abc"]  # truncated msgpack
        for payload in bad:
            socket.send(payload)
        socket.send_multipart([b"two", b"frames"])
        socket.send(frame(ConfirmRead(holder.engine_id, LeaseRef("unknown", 3))))  # no such lease: not held
        deadline = time.monotonic() + 5
        replies = []
        while time.monotonic() < deadline and not any(isinstance(r, ReadConfirmed) for r in replies):
            if socket.poll(100):
                replies.append(side_channel.decode(socket.recv()))
        assert ReadConfirmed(LeaseRef("unknown", 3), False) in replies
        reply = side_channel.request(holder.address, Hello(SIDE_CHANNEL_VERSION, "probe", LAYOUT, "nixl"), 5.0)
        assert isinstance(reply, HelloReply) and reply.refusal is None and holder.proc.poll() is None
    finally:
        socket.close(linger=0)


def test_a_nixl_reader_asks_for_frequent_progress_only_until_its_read_completes(holders):
    """may_transfer() (the progress thread's pace: kv_transfer.nixl_connector): from start_read until
    the READ is seen done, not while the holder's confirmation is awaited, nor after."""
    holder = holders("nixl", seed=8)
    connector, _ = reader("nixl")
    try:
        assert not connector.may_transfer()
        connector.start_read("r", holder.lease("r", [3, 4]), [5, 6])
        assert connector.may_transfer()
        deadline = time.monotonic() + 30
        results = []
        while connector.may_transfer() and time.monotonic() < deadline:
            results += connector.poll()
            time.sleep(0.001)
        assert not connector.may_transfer()
        results += poll_until(connector, {"r"} - {r.request_id for r in results}, timeout_s=30).values()
        assert [r.is_ok for r in results] == [True]
        assert not connector.may_transfer()
    finally:
        connector.close()


@pytest.mark.parametrize("backend", ["nixl", "gloo"])
def test_parts_of_a_streamed_lease_are_read_unconfirmed_and_its_last_read_confirms_them(backend, holders):
    """A decode node streaming a prompt's KV: each part's read leaves the lease held (the holder
    releases nothing), the last read's confirmation ends it, and every part arrived intact."""
    holder = holders(backend, seed=10)
    connector, cache = reader(backend)
    try:
        lease = holder.lease("s", [3, 8, 5, 1])
        connector.hold("s", lease)
        for remote, local in (([3], [10]), ([8, 5], [11, 12])):
            connector.start_read("s", dataclasses.replace(lease, block_ids=remote), local, confirm=False)
            assert poll_until(connector, {"s"}, timeout_s=20)["s"].is_ok
        connector.start_read("probe", holder.lease("probe", [0]), [0])  # its release comes after any of "s"
        assert poll_until(connector, {"probe"}, timeout_s=20)["probe"].is_ok
        assert holder.released(1) == {"probe"}  # "s" still held: nothing of it confirmed yet
        assert torch.equal(cache[[10, 11, 12]], holder.cache[[3, 8, 5]])
        connector.start_read("s", dataclasses.replace(lease, block_ids=[1]), [13])
        assert poll_until(connector, {"s"}, timeout_s=20)["s"].is_ok
        assert holder.released(1) == {"s"}
        assert torch.equal(cache[[10, 11, 12, 13]], holder.cache[[3, 8, 5, 1]])
        assert connector.num_reads_in_flight == 0
    finally:
        connector.close()


def test_a_streamed_lease_that_ended_after_a_part_was_read_fails_its_last_read_as_lease_lost(holders):
    holder = holders("nixl", seed=11)
    connector, _ = reader("nixl")
    try:
        lease = holder.lease("x", [2, 4])
        connector.hold("x", lease)
        connector.start_read("x", dataclasses.replace(lease, block_ids=[2]), [6], confirm=False)
        assert poll_until(connector, {"x"}, timeout_s=20)["x"].is_ok
        holder.expire("x")  # freed and reused before the prompt finished
        connector.start_read("x", dataclasses.replace(lease, block_ids=[4]), [7])
        result = poll_until(connector, {"x"}, timeout_s=20)["x"]
        assert not result.is_ok and result.failure is FailureCode.LEASE_LOST, result
    finally:
        connector.close()


@pytest.mark.parametrize("backend", ["nixl", "gloo"])
def test_a_connector_lowers_the_thread_switch_interval_for_its_side_channel(backend):
    """Its side channel's thread answers a peer (a confirmation, a renewal) within the interval
    while the node's loop runs Python: 5 ms at the default, 0.5 ms after."""
    from kv_transfer.side_channel_connector import THREAD_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        connector, _ = reader(backend)
        connector.close()
        assert sys.getswitchinterval() == pytest.approx(THREAD_SWITCH_INTERVAL_S) and THREAD_SWITCH_INTERVAL_S < 0.005
        sys.setswitchinterval(0.0001)  # an interval already lower stays
        connector, _ = reader(backend)
        connector.close()
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    finally:
        sys.setswitchinterval(before)
