"""NIXL connector (UCX backend): the reader pulls blocks with one READ per request.

The whole cache is registered once (a node of a split model: every rank's cache, with one agent;
a read then moves each of our ranks' heads from the peer's ranks that hold them,
kv_transfer.shards). A read names its blocks' regions on both sides as one descriptor list each,
built for that read: where both caches are block-major (CUDA) a block is
one region, else (a CPU cache is stored layer-major: engine/kv_cache.py) each block's layer is,
layer by layer; regions adjacent in memory on both sides merge into one descriptor, so a prompt's
blocks handed out in a row on both sides move as one descriptor per layer. Measured on a 2-core
Zen 4 EPYC (benchmarks/kv_transfer.py, small preset in float32, CPU): UCX's time grows with the
descriptors it is given, not the bytes alone: 8,192 tokens into scattered blocks took 125 ms as
one descriptor per block and layer (15,360) and 88 ms between block-major caches (512); into
contiguous blocks, merged to one per layer (30), 75 ms.

The READ carries no notification: the reader's confirmation over the side channel
(SideChannelConnector) ends the lease, so the holder cannot free the blocks between the READ's
completion and that check.

On one host UCX carries a READ out inside the transfer() call that posts it (measured: 148 ms
for 200 MB, then DONE), so poll() returns after the copy. Posting from another thread does
not help: the agent's lock holds check_xfer_state() for the duration.

Progress: NIXL's optional progress thread busy-spins a core per agent, so it stays off. But
UCX on TCP needs the holder to progress while a reader pulls: measured, a holder that did not
call into NIXL for ~3 s (one long model step) failed the reader's READ with
NIXL_ERR_REMOTE_DISCONNECT. So a small thread of ours reads notifications, with the agent in its
thread-safe mode: every _PROGRESS_INTERVAL_S while a transfer may be under way (a lease held for a
reader, a read or a handshake in flight; a new lease or read wakes it at once), every
_IDLE_PROGRESS_INTERVAL_S otherwise, sleeping in between. Every 5 ms throughout, an idle node
measured 2.9-3.3% of a core (3.7% at 2 ms), and in a 1P+1D run each node's thread woke ~3,400
times, each time taking the node's one core from its model step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kv_transfer import cuda_ipc
from kv_transfer.base import FailureCode, ReadResult, RemoteLease, TransferState
from kv_transfer.config import TransferConfig
from kv_transfer.errors import TransferFailed
from kv_transfer.layout import KVLayout
from kv_transfer.lease import LeaseTable
from kv_transfer.messages import Hello, NixlAgentInfo, NixlShardInfo
from kv_transfer.shards import (
    ByteRuns,
    CacheShard,
    HeadSegment,
    ShardRegions,
    as_shards,
    byte_runs,
    check_shards,
    head_ranges,
    head_segments,
    joined_runs,
    plan_read,
    wait_for_writes,
)
from kv_transfer.side_channel_connector import Peer, PendingRead, SideChannelConnector
from kv_transfer.ucx import (
    ProtocolReport,
    Transport,
    allocator_warning,
    apply_settings,
    enable_protocol_report,
    rdma_ports,
    ucx_settings,
)

logger = logging.getLogger(__name__)

_PROGRESS_INTERVAL_S = 0.005
# NOTE: far below the ~3 s without progress that failed a READ over TCP (above).
_IDLE_PROGRESS_INTERVAL_S = 0.1
_ROUTE_WORDS = {cuda_ipc.SAME_GPU: "on this GPU", cuda_ipc.PEER_GPU: "on another GPU of this host"}


def set_ucx_defaults(host: str, on_gpu: bool = False) -> Path | None:
    """Process-wide UCX settings for a node about to create its agent (call before the first
    connector), host being the address it advertises, its KV cache in GPU memory or not
    (kv_transfer.ucx.ucx_settings says which and why). An operator's own UCX_* settings win.
    Returns the log file UCX's protocol report goes to (None: the operator chose UCX's logging)."""
    is_loopback = host.startswith("127.") or host == "localhost"
    chosen = apply_settings(ucx_settings(host, on_gpu, None if is_loopback else interface_of(host),
                                         [] if is_loopback else rdma_ports()))
    logger.info("UCX settings for KV transfer (%s, %s memory): %s", host, "GPU" if on_gpu else "host",
                " ".join(f"UCX_{k}={v}" for k, v in chosen.items()) or "UCX's defaults")
    if (warning := allocator_warning(on_gpu, dict(os.environ))) is not None:
        logger.warning(warning)
    return enable_protocol_report()


def interface_of(address: str) -> str | None:
    """The name of the local network interface holding address (None: no local interface does,
    e.g. an address behind NAT, which UCX cannot advertise: docs/deployment.md)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    return None


class _NixlPeer(NamedTuple):
    """A connected holder: its agent's name here, what it told us, its regions, and its caches mapped
    for device copies where they are on our GPUs or others of this host (kv_transfer.cuda_ipc; None:
    NIXL reads)."""

    agent_name: str
    info: NixlAgentInfo
    remote: list[ShardRegions]
    device_copy: cuda_ipc.PeerCopies | None


class NixlConnector(SideChannelConnector):
    backend = "nixl"
    holder_info_type = NixlAgentInfo  # the reader pulls; the holder needs nothing of it

    def __init__(self, config: TransferConfig, kv_cache: torch.Tensor | list[CacheShard], layout: KVLayout,
                 engine_id: str, ucx_log: Path | None = None) -> None:
        """kv_cache: the engine's cache, or each tensor-parallel rank's (kv_transfer.shards), all
        registered with one agent. ucx_log: the file UCX writes its protocol report to
        (set_ucx_defaults), for the transport of this connector's reads (transport)."""
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        shards = as_shards(kv_cache)
        check_shards(shards, layout)  # before the agent exists, so a refusal leaks nothing
        self._mem_type = "VRAM" if shards[0].cache.is_cuda else "DRAM"
        self._ucx_report = ProtocolReport(ucx_log) if ucx_log is not None else None
        self._report_checked_at = 0.0
        agent_config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                         sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._regions = [ShardRegions.of(shard) for shard in shards]
        whole = [(s.cache.data_ptr(), s.cache.numel() * s.cache.element_size(), s.cache.device.index or 0, "")
                 for s in shards]
        try:
            self._agent = nixl_agent(engine_id, agent_config)
            self._reg = self._agent.register_memory(self._agent.get_reg_descs(whole, self._mem_type))
        except Exception:
            self._check_ucx_report(force=True)  # UCX's reason into the log before the error goes up
            raise
        self.num_descriptors_last_read = 0
        self.num_device_copy_reads = 0  # reads carried out as device copies (kv_transfer.cuda_ipc)
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}  # one per device our ranks' caches are on
        self._copies: list[cuda_ipc.CopyRead] = []  # launched, not seen done: each keeps its mapping open
        self._last_copy_route: str | None = None  # the last read's, where it was copied
        self._idle_checked_at = 0.0
        # NOTE: once, here: never on the side channel. The caches and the probes must outlive every reader's
        # mapping: torch's IPC reference count is set once per export and every reader's release takes one
        # off, so it does not hold the memory for readers (the probes live as long as this connector).
        self._probes, self._offers, self._probe_offers = self._export_for_device_copies(shards, config)
        # request id -> per staged peer rank: (buffer, its segments, its registration, its first head)
        self._staged: dict[str, list[tuple[torch.Tensor, list[HeadSegment], object, int]]] = {}
        super().__init__(config, kv_cache, layout, engine_id)
        self._is_stopping = threading.Event()
        self._wake = threading.Event()  # set: progress now, a transfer may have begun (or stop)
        self._progress = threading.Thread(target=self._progress_loop, name="kv-nixl-progress", daemon=True)
        self._progress.start()

    def start_read(self, request_id: str, lease: RemoteLease, local_block_ids: list[int],
                   confirm: bool = True) -> None:
        super().start_read(request_id, lease, local_block_ids, confirm)
        self._wake.set()

    def serve_leases(self, leases: LeaseTable) -> None:
        super().serve_leases(leases)
        leases.on_add(self._wake.set)

    def may_transfer(self) -> bool:
        """Whether a transfer may be under way: a lease held for a reader (it may be reading), a
        handshake of ours, or a read of ours not yet seen complete (one waiting only for the
        holder's confirmation, a side-channel message, needs no progress)."""
        if self._handshakes or self._draining or (self._leases is not None and len(self._leases)):
            return True  # NOTE: a set-aside READ (SideChannelConnector._set_aside) is still under way
        return any(read.confirmation is None for read in list(self._reads.values()))

    def _progress_loop(self) -> None:
        if self._mem_type == "VRAM":  # UCX's CUDA transports progress here: give the thread the cache's device
            torch.cuda.set_device(self.kv_cache.device)
        while not self._is_stopping.is_set():
            self._wake.wait(_PROGRESS_INTERVAL_S if self.may_transfer() else _IDLE_PROGRESS_INTERVAL_S)
            self._wake.clear()
            if self._is_stopping.is_set():
                return
            try:
                self._agent.get_new_notifs()  # NOTE: for the progress it makes; our READs send no notices
            except Exception as exc:  # noqa: BLE001 - keep progressing; report once per failure
                logger.warning("NIXL progress: %s", exc)
            self._check_ucx_report()  # a holder's UCX warnings too (it sees no read end)

    def _answer_info(self, hello: Hello) -> NixlAgentInfo:
        shards = [NixlShardInfo(r.base_address, r.block_stride, r.layer_stride, r.layer_bytes, r.kv_heads.start,
                                r.kv_heads.stop, r.device_id) for r in self._regions]
        return NixlAgentInfo(agent_metadata=self._agent.get_agent_metadata(), shards=shards,
                             num_blocks=self.layout.num_blocks, mem_type=self._mem_type,
                             cuda_ipc=self._offers[0] if len(self._offers) == 1 else None,
                             cuda_ipc_probe=self._probe_offers[0] if len(self._offers) == 1 else None,
                             cuda_ipc_shards=self._offers, cuda_ipc_probes=self._probe_offers)

    @staticmethod
    def _export_for_device_copies(shards: list[CacheShard], config: TransferConfig) -> tuple[list, list, list]:
        """(the probe tensors, each rank's cache's offer, the probes' offers: one per GPU the caches are
        on) over CUDA IPC for readers on this host; empty lists where the caches are not all on GPUs."""
        if config.device_copy == "off" or not all(shard.cache.is_cuda for shard in shards):
            return [], [], []
        try:
            probes = [cuda_ipc.probe_pattern(device) for device in dict.fromkeys(s.cache.device for s in shards)]
            return (probes, [cuda_ipc.export_cache(shard.cache) for shard in shards],
                    [cuda_ipc.export_cache(probe) for probe in probes])
        except Exception as exc:  # noqa: BLE001 - torch's sharing refused (e.g. its allocator's mode): NIXL reads
            logger.warning("KV cache not offered over CUDA IPC (readers on this host read through UCX): %s", exc)
            return [], [], []

    def _connect_peer(self, peer: Peer) -> None:
        info: NixlAgentInfo = peer.backend_info
        remote = [ShardRegions(s.base_address, s.block_stride, s.layer_stride, s.layer_bytes,
                               range(s.kv_head_start, s.kv_head_stop), s.device_id) for s in info.shards]
        head_bytes = 2 * self.layout.block_size * self.layout.head_dim * self.kv_cache.element_size()
        held = set()
        for r in remote:  # the layouts matched, so a peer whose regions disagree with them lies
            if r.layer_bytes != len(r.kv_heads) * head_bytes or not 0 <= r.kv_heads.start < r.kv_heads.stop <= \
                    self.layout.num_kv_heads:
                raise TransferFailed(f"NIXL peer's rank holding heads {r.kv_heads.start}-{r.kv_heads.stop} has "
                                     f"{r.layer_bytes} bytes a layer, not {len(r.kv_heads) * head_bytes}")
            held.update(r.kv_heads)
        if held != set(range(self.layout.num_kv_heads)):
            raise TransferFailed(f"NIXL peer's ranks hold KV heads {sorted(held)}, not all {self.layout.num_kv_heads}")
        peer.handle = _NixlPeer(self._agent.add_remote_agent(info.agent_metadata), info, remote,
                                self._device_copies(info))

    def _device_copies(self, info: NixlAgentInfo) -> cuda_ipc.PeerCopies | None:
        """The peer's caches mapped here, each on the device of our ranks that take its heads, where
        every such pair is on one GPU or (its probe copied from there equal) on two GPUs of this host,
        the caches alike but for the heads they hold, no peer rank feeds ranks of ours on two devices
        (a process maps a handle once), and copies are allowed (TransferConfig.device_copy); else None
        (NIXL reads)."""
        offers = info.cuda_ipc_shards or ([info.cuda_ipc] if info.cuda_ipc is not None else [])
        if len(offers) != len(info.shards) or any(
                offer.shape[:1] != [info.num_blocks] or offer.shape[4:5] != [s.kv_head_stop - s.kv_head_start]
                for offer, s in zip(offers, info.shards)):
            return None
        probes = info.cuda_ipc_probes or ([info.cuda_ipc_probe] if info.cuda_ipc_probe is not None else [])
        segments = head_segments(head_ranges(self.shards), [(s.kv_head_start, s.kv_head_stop) for s in info.shards])
        devices = cuda_ipc.mapping_devices(segments, [shard.cache.device for shard in self.shards])
        if devices is None:
            return None
        mapped: dict[tuple[int, torch.device], cuda_ipc.MappedCache] = {}
        for segment in segments:
            cache = self.shards[segment.local_rank].cache
            key = (segment.remote_rank, cache.device)
            if key in mapped:
                continue
            offer = offers[segment.remote_rank]
            route = cuda_ipc.route(offer, cache, self.config.device_copy)
            # NOTE: a view past its memory is never mapped: it would read what is not the probe's
            probe = next((p for p in probes if cuda_ipc.is_probe(p, offer)), None)
            if route is None or (route == cuda_ipc.PEER_GPU and probe is None):
                return None
            mapped[key] = cuda_ipc.MappedCache(offer, cache.device, route, probe)
            try:
                mapped[key].get()
            except Exception as exc:  # noqa: BLE001 - the mapping or the probe failed: read through UCX instead
                logger.warning("KV cache of a peer %s not used for device copies over CUDA IPC (reading through "
                               "UCX): %s", _ROUTE_WORDS[route], exc)
                return None
        copies = cuda_ipc.PeerCopies(segments, mapped)
        logger.info("KV reads from a peer %s: device copies over CUDA IPC", _ROUTE_WORDS[copies.route])
        return copies

    def _start_transfer(self, read: PendingRead, peer: Peer) -> None:
        agent_name, info, remote, device_copy = peer.handle
        if device_copy is not None and self._start_copy(read, peer, device_copy):
            return
        self._last_copy_route = None
        runs = self._runs(read, remote)
        lengths = runs.lengths
        try:
            handle = self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(_rows(runs.local_addresses, lengths, runs.local_devices),
                                                   self._mem_type),
                self._agent.get_xfer_descs(_rows(runs.remote_addresses, lengths, runs.remote_devices), info.mem_type),
                agent_name)
            state = _transfer_state(self._agent.transfer(handle))
        except Exception as exc:  # noqa: BLE001 - nixl raises its own types; surface as ours
            self._check_ucx_report(force=True)
            raise TransferFailed(f"NIXL READ could not start: {exc}") from exc
        read.handle = handle
        self.num_descriptors_last_read = len(lengths)
        if state is TransferState.FAILED:
            self._check_ucx_report(force=True)
            raise TransferFailed("NIXL READ failed to post")

    def _start_copy(self, read: PendingRead, peer: Peer, copies: cuda_ipc.PeerCopies) -> bool:
        """Start the read as device copies from the peer's mapped caches, each run of heads into our
        rank holding it; False where they could not start (the peer's reads go through UCX from now on)."""
        where = _ROUTE_WORDS[copies.route]
        info = peer.handle.info
        try:
            pieces = []
            for segment in copies.segments:
                shard = self.shards[segment.local_rank]
                ours, theirs = shard.kv_heads.start, info.shards[segment.remote_rank].kv_head_start
                if shard.cache.is_cuda and shard.cache.device not in self._copy_streams:
                    self._copy_streams[shard.cache.device] = torch.cuda.Stream(shard.cache.device)
                remote = copies.mapped[segment.remote_rank, shard.cache.device].get()
                pieces.append((shard.cache[:, :, :, :, segment.start - ours:segment.stop - ours],
                               remote[:, :, :, :, segment.start - theirs:segment.stop - theirs]))
            # NOTE: after rank 0's device too: a worker rank's writes of a step are ordered only through the
            # collective rank 0 waits on there (engine.wait_for_kv_writes), not on its own device here
            read.handle = cuda_ipc.CopyRead(pieces, read.local_block_ids, read.remote_block_ids, self._copy_streams,
                                            after=self.kv_cache.device)
        except Exception as exc:  # noqa: BLE001 - torch raises its own types: UCX carries this read instead
            try:
                for stream in self._copy_streams.values():
                    stream.synchronize()  # NOTE: no copy it launched may still write the blocks
            except Exception as sync_exc:  # noqa: BLE001 - the device is failing: the read fails as a transfer
                raise TransferFailed(f"device copy from the peer {where} failed: {sync_exc}") from sync_exc
            logger.warning("KV reads from the peer %s at %s go through UCX from now on: a device copy could not "
                           "start: %s", where, peer.address, exc)
            peer.handle = peer.handle._replace(device_copy=None)
            read.handle = None
            return False
        self._copies.append(read.handle)
        self.num_descriptors_last_read = len(cuda_ipc.runs(read.local_block_ids, read.remote_block_ids))
        self.num_device_copy_reads += 1
        self._last_copy_route = copies.route
        return True

    def _runs(self, read: PendingRead, remote: list[ShardRegions]) -> ByteRuns:
        """The read's runs: straight into our ranks holding the heads the peer's rank holds, and
        into a staging buffer (registered for this read) for each peer rank whose heads our ranks
        split otherwise: a part of a rank's heads, straight, would take a run per block, layer, K/V
        and token (kv_transfer/shards.py); whole, it takes a few, then a copy in memory."""
        plan = plan_read(self._regions, remote)
        elem = self.kv_cache.element_size()
        runs = []
        if plan.direct:
            runs.append(byte_runs(self._regions, remote, read.local_block_ids, read.remote_block_ids, self.layout,
                                  elem, plan.direct))
        staged = []
        try:
            for remote_rank, segments in plan.staged.items():
                theirs = remote[remote_rank]
                layout = self.layout
                # NOTE: stored as the peer's rank stores its cache, so its consecutive blocks merge here too
                shape = (len(read.local_block_ids), layout.num_layers, 2, layout.block_size, len(theirs.kv_heads),
                         layout.head_dim)
                buffer = torch.empty(shape, dtype=self.kv_cache.dtype, device=self.kv_cache.device)
                if not theirs.is_block_major(layout.num_layers):
                    buffer = torch.empty((shape[1], shape[0], *shape[2:]), dtype=buffer.dtype,
                                         device=buffer.device).transpose(0, 1)
                region = ShardRegions.of(CacheShard(buffer, theirs.kv_heads))
                descs = [(buffer.data_ptr(), buffer.numel() * elem, region.device_id, "")]
                staged.append((buffer, segments, self._agent.register_memory(
                    self._agent.get_reg_descs(descs, self._mem_type)), theirs.kv_heads.start))
                whole = [HeadSegment(0, 0, theirs.kv_heads.start, theirs.kv_heads.stop)]
                runs.append(byte_runs([region], [theirs], list(range(len(read.local_block_ids))),
                                      read.remote_block_ids, layout, elem, whole))
        finally:
            if staged:
                self._staged[read.request_id] = staged
        return joined_runs(runs)

    def _on_confirmed(self, read: PendingRead) -> None:
        written = set()
        for buffer, segments, _, theirs in self._staged.get(read.request_id, []):
            index = torch.tensor(read.local_block_ids, device=buffer.device)
            for segment in segments:
                shard = self.shards[segment.local_rank]
                ours = shard.kv_heads.start
                shard.cache[index.to(shard.cache.device), :, :, :, segment.start - ours : segment.stop - ours] = \
                    buffer[..., segment.start - theirs : segment.stop - theirs, :].to(shard.cache.device)
                written.add(shard.cache.device)
        wait_for_writes(written)

    def _release_read(self, read: PendingRead) -> None:
        for _, _, registration, _ in self._staged.pop(read.request_id, []):
            try:
                self._agent.deregister_memory(registration)
            except Exception as exc:  # noqa: BLE001 - nixl raises its own types; the buffer goes anyway
                logger.warning("NIXL staging deregistration: %s", exc)

    def _poll_backend(self) -> list[ReadResult]:
        self._copies = [copy for copy in self._copies if not copy.is_done()]
        now = time.monotonic()
        if now - self._idle_checked_at > 1.0:
            self._idle_checked_at = now
            for peer in list(self._peers.values()):
                if peer.handle is not None and peer.handle.device_copy is not None:
                    peer.handle.device_copy.release_if_idle(now)
        results = []
        for read in list(self._reads.values()):
            if read.handle is None:
                continue
            if isinstance(read.handle, cuda_ipc.CopyRead):
                if read.handle.is_done():
                    self._transferred(read)
                continue
            state, detail = self._state(read.handle)
            if state is TransferState.DONE:
                self._agent.release_xfer_handle(read.handle)
                self._transferred(read)
                self._check_ucx_report()
            elif state is TransferState.FAILED:
                self._check_ucx_report(force=True)  # UCX's reason into the log
                results.append(self._fail(read, f"NIXL READ failed: {detail}", FailureCode.TRANSFER))
        return results

    @property
    def is_copying(self) -> bool:
        return any(not copy.is_done() for copy in self._copies)

    @property
    def transport(self) -> Transport | None:
        """How this connector's last read was carried: device copies from a peer on this GPU or
        another of this host (kv_transfer.cuda_ipc), else what UCX reported for its reads (None until
        a read completed, or where the operator set UCX's logging)."""
        if self._last_copy_route is not None:
            return cuda_ipc.TRANSPORTS[self._last_copy_route]
        return self._ucx_report.transport if self._ucx_report is not None else None

    def _check_ucx_report(self, force: bool = False) -> None:
        """Read UCX's report (at most once a second, every 50 ms while the transport is not known
        yet, unless force: after a failure): the transport, once, and its warnings and errors.
        Called from the progress thread and the node's loop."""
        report, now = self._ucx_report, time.monotonic()
        interval = 1.0 if report is not None and report.transport is not None else 0.05
        if report is None or (not force and now - self._report_checked_at < interval):
            return
        self._report_checked_at = now
        known = report.transport
        transport = report.poll()
        if transport is not None and transport != known:
            if transport.is_tcp_fallback and self._mem_type == "VRAM":
                logger.warning("KV reads of GPU memory go through TCP (%s, %s): expect a few GB/s at most; see "
                               "docs/deployment.md (UCX transports)", transport.transport, transport.method)
            else:
                logger.info("KV reads: %s (%s, %s memory)", transport.transport, transport.method, transport.memory)

    def _state(self, handle) -> tuple[TransferState, str]:
        """A transfer handle's state, and NIXL's word for it (its error when it raised)."""
        try:
            nixl_state = self._agent.check_xfer_state(handle)
        except Exception as exc:  # noqa: BLE001 - nixl raises its own types
            return TransferState.FAILED, str(exc)
        return _transfer_state(nixl_state), nixl_state

    def _cancel(self, read: PendingRead) -> bool:
        # NOTE: a READ in flight writes into the local blocks: where the backend refuses to release
        # it because it is being carried out, the read waits (SideChannelConnector._set_aside).
        if isinstance(read.handle, cuda_ipc.CopyRead):
            if not read.handle.is_done():
                return False
            read.handle = None
            return True
        try:
            self._agent.release_xfer_handle(read.handle)
        except Exception as exc:  # noqa: BLE001 - nixl raises its own types
            if self._state(read.handle)[0] is TransferState.IN_PROGRESS:
                return False
            logger.warning("NIXL READ of %s could not be released: %s", read.request_id, exc,
                           extra={"request_id": read.request_id})
        read.handle = None
        return True

    def _forget_peer(self, peer: Peer) -> None:
        agent_name = peer.handle.agent_name  # NOTE: a mapped cache goes with its last reference
        try:
            self._agent.remove_remote_agent(agent_name)
        except Exception as exc:  # noqa: BLE001 - the peer is gone; best effort
            logger.warning("forgetting NIXL peer %s: %s", agent_name, exc)

    def close(self) -> None:
        self._is_stopping.set()
        self._wake.set()
        self._progress.join(timeout=2)
        for stream in self._copy_streams.values():
            try:
                stream.synchronize()  # NOTE: before the mappings the copies read can close
            except Exception as exc:  # noqa: BLE001 - a failing device: the rest of the closing still runs
                logger.warning("waiting for the device copies under way at close: %s", exc)
        super().close()
        try:
            self._agent.deregister_memory(self._reg)
        except Exception as exc:  # noqa: BLE001 - shutting down
            logger.warning("NIXL deregistration: %s", exc)
        if self._ucx_report is not None:
            self._ucx_report.poll()  # UCX's last warnings into the log



def _transfer_state(nixl_state: str) -> TransferState:
    """NIXL's "DONE", "PROC" and "ERR" (anything else counts as failed) as ours: the one place
    that reads NIXL's state strings."""
    if nixl_state == "DONE":
        return TransferState.DONE
    if nixl_state == "PROC":
        return TransferState.IN_PROGRESS
    return TransferState.FAILED


def _rows(addresses: np.ndarray, lengths: np.ndarray, device_ids: np.ndarray) -> np.ndarray:
    """NIXL's descriptor list as an Nx3 array: (address, length, device)."""
    return np.stack([addresses, lengths, device_ids], axis=1)
