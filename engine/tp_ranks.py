"""A tensor-parallel engine's ranks. Rank 0 is the engine's own process: it schedules, samples and
drives; ranks 1.. are worker processes it starts (spawned), each holding its shard of the weights
and of the KV cache (block ids shared) and running every step rank 0 sends it, as vLLM's executor
and SGLang's TP workers do. Steps go to the workers over a pipe each; the model's sums and the
LM head's gather go over the ranks' process group (gloo on the CPU, NCCL on CUDA)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import pickle
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from engine import tp_shm
from engine.config import EngineConfig
from engine.decode_graphs import DecodeGraphs
from engine.host_memory import keep_freed_memory
from engine.kv_cache import allocate_kv_cache, map_shared_kv_cache, num_cache_blocks
from engine.model import AttentionMetadata, CausalLM
from engine.protocol import Role
from engine.tp_group import COLLECTIVE_TIMEOUT_S, TensorParallelError, TPGroup, make_process_group, ranks_share_gpu
from engine.tp_shard import local_model_config, tp_shard
from engine.tp_shm import ShmChannel, create_channel_file
from engine.weights import load_weights
from kernels.interface import Backend
from kernels.select import select_backend

logger = logging.getLogger(__name__)

# NOTE: a worker's start is a torch import, its weights' read and its cache's allocation.
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0
_STORE_TIMEOUT_S = 60.0
_CONNECT_TIMEOUT_S = 60.0  # a worker's interpreter start and imports, before it connects back
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # where `engine` is importable from
# How often rank 0 looks for lost workers, and a worker for a lost rank 0 (_watch_workers, _watch_parent).
_WATCH_INTERVAL_S = 0.5
# A lost worker that no step of rank 0 ran into (its error breaks the group, and the node stops)
# within this ends a node's process (EngineConfig.lost_rank_ends_process). With gloo a step fails
# at once; NCCL would wait for its watchdog (COLLECTIVE_TIMEOUT_S).
LOST_RANK_GRACE_S = 5.0
# The same while the group starts, from the first collective on (NCCL sets its communicator up there
# and waits for every rank without a timeout), for every engine: rank 0 meets a lost worker within
# a second wherever it waits for the workers, so only a wait it cannot leave lasts this long. It
# covers rank 0 allocating its own cache meanwhile, so a worker's start error is raised, not cut short.
START_LOST_RANK_GRACE_S = 30.0

# A step message: an int64 header, then every int tensor of the step flattened (see _pack_step).
_OP_STEP, _OP_STOP = 1, 2
# The static decode path's (engine.decode_graphs): build it and capture ([op, capture, n, *sizes]),
# and a step of it ([op, size, rows, k, *ids (4 x rows), *index (k), *value (k)]: DecodeGraphs._stage).
_OP_GRAPHS, _OP_GRAPH_STEP = 3, 4
_HEADER = ("op", "num_tokens", "num_decodes", "num_prefills", "table_width", "num_logits", "max_query_len")
_STOP_MESSAGE = np.array([_OP_STOP] + [0] * (len(_HEADER) - 1), dtype=np.int64).tobytes()


@dataclass
class RankModel:
    """One rank's model on its shard, its KV cache and the block count all ranks agreed on."""

    model: CausalLM
    kv_cache: torch.Tensor | None
    num_blocks: int


def rank_device(device: str, rank: int) -> str:
    """Rank's device: on CUDA the rank-th GPU from the engine's (cuda:N + rank), or the engine's
    own where the ranks share it (tp_group.ranks_share_gpu), always with its index; else device."""
    kind = torch.device(device)
    if kind.type != "cuda":
        return device
    return f"cuda:{(kind.index or 0) + (0 if ranks_share_gpu() else rank)}"


def build_rank(config: EngineConfig, backend: Backend, group: TPGroup | None, allocate: bool = True,
               loaded: Callable[[], None] | None = None) -> RankModel:
    """Load this rank's shard (the whole model without a group), call loaded(), agree on the block
    count with the other ranks (the smallest any rank's memory allows) and allocate the cache
    (unless not allocate: then kv_cache is None, for the caller to set; see shares_caches).
    NOTE: loaded is where the ranks meet before their first collective: NCCL sets its communicator
    up there and waits for every rank without a timeout, so a worker that failed to load must be
    known before (rank 0: TPRanks._await("loaded"), then a thread watching for one lost in the
    collective; a worker: it reports "loaded")."""
    shard = group.shard if group is not None else tp_shard(config.model, 0, 1)
    weights = load_weights(config.model, backend, decode_batches=config.role is not Role.PREFILL, shard=shard)
    local = local_model_config(config.model, shard)
    # NOTE: after the weights: a GPU's budget is what is left of the engine's share of it.
    num_blocks = num_cache_blocks(local, config.cache, config.device, shard.size)
    if loaded is not None:
        loaded()
    if group is not None:
        num_blocks = group.min_int(num_blocks)
    model = CausalLM(local, weights, backend, group)
    if not allocate:
        return RankModel(model, None, num_blocks)
    cache = allocate_kv_cache(local, num_blocks, config.cache.block_size, config.device, prefault=config.cache.prefault)
    return RankModel(model, cache, num_blocks)


class TPRanks:
    """Rank 0's hold on its worker ranks. start() brings them up; send_step() hands each the step
    rank 0 is about to run (before rank 0 runs it: the collectives pair up); close() stops them
    (also done when this object is collected or the process exits). A worker that dies ends the
    group: the next send or collective raises TensorParallelError."""

    def __init__(self, processes: list[subprocess.Popen], pipes: list[Connection], store: dist.TCPStore,
                 shared_files: list[str]) -> None:
        self._processes = processes
        self._pipes = pipes
        self._store = store
        self.is_broken = False
        # The workers' caches, allocated here (shares_caches engines): (cache, the model's KV heads it holds)
        self.worker_caches: list[tuple[torch.Tensor, range]] = []
        self._shared_files = shared_files  # removed at the latest when the workers stop
        self._watch_stop = threading.Event()  # set before the workers are stopped
        self.starting = True  # until start() returns (_watch_workers)
        self._finalizer = weakref.finalize(self, _stop_workers, processes, pipes, shared_files, self._watch_stop)

    def watch(self, ends_process: bool) -> None:
        """Watch the workers from a thread of this process: one lost and not met by a step within
        LOST_RANK_GRACE_S is logged; with ends_process, it ends this process (exit 1), its other
        workers killed first. While starting, one lost and not met within START_LOST_RANK_GRACE_S
        ends this process whatever ends_process says: rank 0 is then stuck where nothing else
        would end it."""
        threading.Thread(target=_watch_workers, args=(weakref.ref(self), self._processes, self._watch_stop,
                                                      ends_process), name="tp-watch", daemon=True).start()

    @classmethod
    def start(cls, config: EngineConfig, backend: Backend) -> tuple[TPRanks, RankModel]:
        """Spawn ranks 1..size-1, join them in a group and build rank 0's model beside theirs.
        Raises TensorParallelError naming the rank and its error when a worker fails to start."""
        size = config.tensor_parallel_size
        _check_devices(config.device, size)
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=_STORE_TIMEOUT_S),
                              wait_for_workers=False)
        threads = max(1, torch.get_num_threads() // size)
        torch.set_num_threads(threads)
        if shares_caches(config) and config.device != "cpu" and not ranks_share_gpu():
            for rank in range(1, size):  # NOTE: this process's context on each GPU before the workers size caches
                torch.zeros(1, device=rank_device(config.device, rank))
        channel_file = _channel_file(config)
        processes, pipes = _spawn_workers(config, store.port, threads, channel_file)
        ranks = cls(processes, pipes, store, list(filter(None, [channel_file])))

        def loaded() -> None:
            ranks._await("loaded")
            ranks.watch(config.lost_rank_ends_process)  # NOTE: before the first collective (build_rank)

        try:
            ranks._await("joining")
            alive = lambda: all(p.poll() is None for p in processes)  # noqa: E731 - the channel's check
            channel = _channel(channel_file, 0, size, tp_shm.SLOT_BYTES, alive)
            group = TPGroup(tp_shard(config.model, 0, size), config.model.vocab_size,
                            make_process_group(store, 0, size, config.device), channel)
            built = build_rank(config, backend, group, loaded=loaded)
            if shares_caches(config):
                ranks._await("sized")
                ranks._give_worker_caches(config, built.num_blocks)
            ranks._await("ready")
            ranks._remove_shared_files()
        except TensorParallelError as exc:
            reported = ranks._start_errors()
            ranks.close()
            if reported:
                raise TensorParallelError(f"tensor-parallel {reported}") from exc
            raise
        except BaseException:
            ranks.close()
            raise
        ranks.starting = False
        logger.info("tensor parallel: %d ranks (pids %s), %d threads each", size,
                    ", ".join(str(p.pid) for p in processes), threads)
        return ranks, built

    @contextlib.contextmanager
    def step(self, input_ids: torch.Tensor, meta: AttentionMetadata, logits_indices: torch.Tensor) -> Iterator[None]:
        """Send the step (host tensors) to every worker, then run rank 0's side of it in the block.
        Whatever the block raises becomes a TensorParallelError and breaks the group for good: the
        workers may be waiting in a collective rank 0 left, which no later step can pair with."""
        self.send_step(input_ids, meta, logits_indices)
        with self.guard():
            yield

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Rank 0's side of a step the workers were sent (step(), or send_graph_step by the static
        decode path): whatever the block raises breaks the group, as in step()."""
        try:
            yield
        except TensorParallelError:
            self.is_broken = True
            raise
        except Exception as exc:
            self.is_broken = True
            raise TensorParallelError(f"tensor-parallel rank 0 failed inside a step ({type(exc).__name__}: "
                                      f"{exc}); the group cannot run another") from exc

    def send_step(self, input_ids: torch.Tensor, meta: AttentionMetadata, logits_indices: torch.Tensor) -> None:
        """Hand every worker the step (host tensors) rank 0 runs next. Raises TensorParallelError
        when a worker is gone."""
        self._send(_pack_step(input_ids, meta, logits_indices))

    def send_graphs(self, sizes: tuple[int, ...], capture: bool) -> None:
        """Have every worker build its static decode path for sizes and (capture) capture it, as
        rank 0 does next: their warm-ups' collectives pair up with rank 0's."""
        self._send(np.array([_OP_GRAPHS, int(capture), len(sizes), *sizes], dtype=np.int64).tobytes())

    def send_graph_step(self, size: int, ids: np.ndarray, index: np.ndarray, value: np.ndarray) -> None:
        """Hand every worker the static decode step rank 0 replays next (DecodeGraphs._stage's buffers)."""
        header = np.array([_OP_GRAPH_STEP, size, ids.shape[1], len(index)], dtype=np.int64)
        self._send(np.concatenate([header, ids.reshape(-1), index, value.astype(np.int64)]).tobytes())

    def _send(self, message: bytes) -> None:
        """message to every worker. Raises TensorParallelError when a worker is gone."""
        self._check_alive()
        for rank, pipe in enumerate(self._pipes, start=1):
            try:
                pipe.send_bytes(message)
            except OSError as exc:
                self.is_broken = True
                raise TensorParallelError(f"tensor-parallel rank {rank} is gone ({exc})") from exc

    def close(self) -> None:
        """Stop the workers (bounded: those that do not stop in STOP_TIMEOUT_S are killed)."""
        self._finalizer()

    def _check_alive(self) -> None:
        if self.is_broken:
            raise TensorParallelError("this engine's tensor-parallel group failed earlier; restart the engine")
        for rank, process in enumerate(self._processes, start=1):
            if process.poll() is not None:
                self.is_broken = True
                raise TensorParallelError(f"tensor-parallel rank {rank} (pid {process.pid}) exited "
                                          f"with code {process.returncode}")

    def _give_worker_caches(self, config: EngineConfig, num_blocks: int) -> None:
        """Allocate each worker's cache here, on its device (a shared file on the CPU), and hand it
        the cache to open (_export_cache): this process's one NIXL agent then registers memory it
        allocated itself, which UCX's CUDA transports need (memory opened from another process's
        IPC handle cannot be exported again)."""
        for rank, pipe in enumerate(self._pipes, start=1):
            shard = tp_shard(config.model, rank, config.tensor_parallel_size)
            device = rank_device(config.device, rank)
            path = _shared_path(f"kv-rank{rank}") if device == "cpu" else None
            if path is not None:
                self._shared_files.append(path)
            cache = allocate_kv_cache(local_model_config(config.model, shard), num_blocks, config.cache.block_size,
                                      device, shared_file=path)
            if cache.is_cuda:
                torch.cuda.synchronize(cache.device)  # NOTE: the zeros are written before the worker reads them
            self.worker_caches.append((cache, shard.kv_heads))
            try:
                pipe.send(("cache", _export_cache(cache, path)))
            except OSError as exc:
                raise TensorParallelError(f"tensor-parallel rank {rank} is gone ({exc})") from exc

    def _remove_shared_files(self) -> None:
        """Remove the files made at start (the mappings stay)."""
        _remove_files(self._shared_files)
        self._shared_files.clear()

    def _start_errors(self) -> str:
        """The errors workers reported while starting ("rank N failed to start: ..."), "" if none."""
        errors = []
        for rank, pipe in enumerate(self._pipes, start=1):
            try:
                while pipe.poll(1.0):
                    kind, detail = pipe.recv()
                    if kind == "error":
                        errors.append(f"rank {rank} failed to start: {detail}")
            except (EOFError, OSError):
                continue
        return "; ".join(errors)

    def _await(self, state: str) -> None:
        """Wait for every worker to report state, bounded by START_TIMEOUT_S; raises
        TensorParallelError with a worker's own error or exit."""
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = dict(zip(self._pipes, range(1, len(self._pipes) + 1)))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TensorParallelError(f"tensor-parallel ranks {sorted(pending.values())} not {state} "
                                          f"after {START_TIMEOUT_S:.0f} s")
            for pipe in wait(list(pending), timeout=min(left, 1.0)):
                rank = pending.pop(pipe)
                try:
                    kind, detail = pipe.recv()
                except EOFError:
                    raise TensorParallelError(f"tensor-parallel rank {rank} exited while starting") from None
                if kind != state:
                    raise TensorParallelError(f"tensor-parallel rank {rank} failed to start: {detail}")
            self._check_alive()


def shares_caches(config: EngineConfig) -> bool:
    """Whether rank 0 holds the workers' caches too: for a node that moves KV (prefill and decode
    roles), whose connector reads and writes every rank's cache with one agent. Rank 0 allocates
    them and each worker opens its own (TPRanks._give_worker_caches)."""
    return config.role is not Role.COLOCATED and config.tensor_parallel_size > 1


def _export_cache(cache: torch.Tensor, path: str | None) -> tuple:
    """What a worker opens the cache rank 0 allocated for it from (_import_cache): the file it is
    stored in on the CPU; on a GPU, torch's own reduction of a CUDA tensor (an IPC handle of the
    memory, which the worker maps)."""
    if cache.is_cuda:
        return ("cuda_ipc", reduce_tensor(cache))
    return ("file", path)


def _import_cache(handle: tuple, config: EngineConfig, rank: int, num_blocks: int) -> torch.Tensor:
    """The cache rank 0 allocated for this worker, from _export_cache's handle."""
    kind, value = handle
    if kind == "cuda_ipc":
        rebuild, arguments = value
        return rebuild(*arguments)
    shard = tp_shard(config.model, rank, config.tensor_parallel_size)
    return map_shared_kv_cache(local_model_config(config.model, shard), num_blocks, config.cache.block_size, value)


def _shared_path(name: str) -> str:
    """A fresh path in shared memory (/dev/shm, else the temporary folder) for this process's ranks."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(folder, f"pdserve-tp-{os.getpid()}-{secrets.token_hex(8)}-{name}")


def _channel_file(config: EngineConfig) -> str | None:
    """The ranks' shared-memory channel (engine.tp_shm), made here: CPU ranks only (NCCL has its own)."""
    if config.device != "cpu":
        return None
    path = _shared_path("channel")
    create_channel_file(path, config.tensor_parallel_size, tp_shm.SLOT_BYTES)
    return path


def _channel(path: str | None, rank: int, size: int, slot_bytes: int, peers_alive) -> ShmChannel | None:
    return None if path is None else ShmChannel(path, rank, size, peers_alive, COLLECTIVE_TIMEOUT_S, slot_bytes)


def _remove_files(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _spawn_workers(config: EngineConfig, store_port: int, threads: int,
                   channel_file: str | None) -> tuple[list, list[Connection]]:
    """Start ranks 1..size-1 as `python -m engine.tp_ranks` (a fresh interpreter: nothing of the
    caller's main module runs again, as multiprocessing's spawn would), each connecting back to an
    authenticated listener, and hand each its start arguments."""
    size = config.tensor_parallel_size
    authkey = secrets.token_bytes(32)
    env = dict(os.environ, PDSERVE_TP_AUTHKEY=authkey.hex(),
               PYTHONPATH=os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), os.environ.get("PYTHONPATH")])))
    processes, pipes = [], []
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        listener._listener._socket.settimeout(_CONNECT_TIMEOUT_S)  # noqa: SLF001 - a bounded accept
        host, port = listener.address
        for rank in range(1, size):
            processes.append(subprocess.Popen([sys.executable, "-m", "engine.tp_ranks", f"{host}:{port}", str(rank)],
                                              env=env))
        try:
            for _ in range(1, size):
                pipes.append(listener.accept())
        except OSError as exc:
            codes = [p.poll() for p in processes]
            _stop_workers(processes, pipes, [])
            raise TensorParallelError(f"tensor-parallel workers did not connect back within {_CONNECT_TIMEOUT_S:.0f} s "
                                      f"({exc}; their exit codes so far: {codes})") from exc
        except BaseException:
            _stop_workers(processes, pipes, [])
            raise
    by_rank = {}
    for pipe in pipes:
        rank = pipe.recv()
        by_rank[rank] = pipe
        worker_config = dataclasses.replace(config, device=rank_device(config.device, rank))
        pipe.send((worker_config, store_port, threads, _core_group(rank, size), channel_file, tp_shm.SLOT_BYTES))
    return processes, [by_rank[rank] for rank in range(1, size)]


def _check_devices(device: str, size: int) -> None:
    """Raises ValueError (one line) when the ranks' GPUs are not all visible."""
    kind = torch.device(device)
    needed = (kind.index or 0) + (1 if ranks_share_gpu() else size)
    if kind.type == "cuda" and needed > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {size} from {device} needs {needed} GPUs; "
                         f"{torch.cuda.device_count()} are visible")


def _watch_workers(ranks_ref: weakref.ref, processes: list[subprocess.Popen], stop: threading.Event,
                   ends_process: bool) -> None:
    """TPRanks.watch's thread: until stop (the group closing), look for a worker that exited."""
    lost_at = None
    while not stop.wait(_WATCH_INTERVAL_S):
        lost = [(rank, p) for rank, p in enumerate(processes, start=1) if p.poll() is not None]
        ranks = ranks_ref()  # NOTE: no reference kept across waits: the group can still be collected
        if ranks is None:
            return
        is_broken, starting = ranks.is_broken, ranks.starting
        del ranks
        if not lost or is_broken:
            lost_at = None  # nothing lost, or a step ran into it: the engine ends on that error
            continue
        lost_at = lost_at or time.monotonic()
        grace = START_LOST_RANK_GRACE_S if starting else LOST_RANK_GRACE_S
        if time.monotonic() - lost_at < grace:
            continue
        what = ", ".join(f"rank {rank} (pid {p.pid}) exited with code {p.returncode}" for rank, p in lost)
        if starting:
            logger.critical("tensor-parallel %s while the group was starting, and rank 0 did not get back to it "
                            "within %.0f s (its first collective may be waiting for it): ending this process, "
                            "its other ranks too", what, grace)
        elif not ends_process:  # NOTE: the next step raises (_check_alive); one waiting on it now stays
            logger.error("tensor-parallel %s; this engine cannot run another step", what)
            return
        else:
            logger.critical("tensor-parallel %s, and no step of rank 0 failed on it within %.0f s (a collective "
                            "may be waiting for it): ending this node's process, its other ranks too", what, grace)
        for process in processes:
            with contextlib.suppress(OSError):
                process.kill()
        _end_process(1)


def _watch_parent(parent: int) -> None:
    """A worker's thread: end this process when rank 0's is gone (a step of this one may be waiting in
    a collective for it, which would never return)."""
    while os.getppid() == parent:
        time.sleep(_WATCH_INTERVAL_S)
    _end_process(1)


def _end_process(code: int) -> None:
    """Exit now, without the interpreter's teardown (a process group's may wait on a lost peer)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _stop_workers(processes: list[subprocess.Popen], pipes: list[Connection], shared_files: list[str],
                  watch_stop: threading.Event | None = None) -> None:
    if watch_stop is not None:
        watch_stop.set()  # NOTE: first: the workers' exits below are no loss
    _remove_files(shared_files)
    for pipe in pipes:
        with contextlib.suppress(OSError):  # already gone
            pipe.send_bytes(_STOP_MESSAGE)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for pipe in pipes:
        pipe.close()


def _core_group(rank: int, size: int) -> list[int] | None:
    """The cores rank runs on: its contiguous share of this process's, None when there are fewer
    cores than ranks (then nobody is pinned)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < size:
        return None
    base, extra = divmod(len(cores), size)
    start = rank * base + min(rank, extra)
    return cores[start : start + base + (rank < extra)]


def _pack_step(input_ids: torch.Tensor, meta: AttentionMetadata, logits_indices: torch.Tensor) -> bytes:
    width = meta.decode_block_tables.shape[1]  # the decode and prefill tables are row slices of one table
    header = [_OP_STEP, input_ids.shape[0], meta.num_decode_tokens, meta.prefill_seq_lens.shape[0], width,
              logits_indices.shape[0], meta.prefill_max_query_len]
    parts = [torch.tensor(header, dtype=torch.int64)]
    parts += [t.reshape(-1).to(torch.int64) for t in _step_tensors(input_ids, meta, logits_indices)]
    return torch.cat(parts).numpy().tobytes()


def _step_tensors(input_ids, meta: AttentionMetadata, logits_indices) -> list[torch.Tensor]:
    """The step's tensors in message order (_unpack_step cuts them in this order)."""
    return [input_ids, meta.positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens,
            meta.prefill_block_tables, meta.prefill_cu_query_lens, meta.prefill_seq_lens, logits_indices,
            meta.logits_block_tables, meta.logits_seq_lens]


def _unpack_step(message: bytes, device: str) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor] | None:
    """The step of a message from _pack_step, on device; None for a stop."""
    values = torch.from_numpy(np.frombuffer(message, dtype=np.int64).copy())
    header = dict(zip(_HEADER, values[: len(_HEADER)].tolist()))
    if header["op"] == _OP_STOP:
        return None
    tokens, decodes, prefills = header["num_tokens"], header["num_decodes"], header["num_prefills"]
    width, logits = header["table_width"], header["num_logits"]
    sizes = [tokens, tokens, tokens, decodes * width, decodes, prefills * width, prefills + 1, prefills, logits,
             logits * width, logits]
    cut = values[len(_HEADER):].to(device).split(sizes)
    i32 = torch.int32
    meta = AttentionMetadata(
        positions=cut[1], slot_mapping=cut[2], num_decode_tokens=decodes,
        decode_block_tables=cut[3].reshape(decodes, width).to(i32), decode_seq_lens=cut[4].to(i32),
        prefill_block_tables=cut[5].reshape(prefills, width).to(i32), prefill_cu_query_lens=cut[6].to(i32),
        prefill_seq_lens=cut[7].to(i32), logits_block_tables=cut[9].reshape(logits, width).to(i32),
        logits_seq_lens=cut[10].to(i32), prefill_max_query_len=header["max_query_len"],
    )
    return cut[0], meta, cut[8]


def _worker_main(address: str, rank: int) -> None:
    """A worker rank: connect to rank 0, take its start arguments, join the group, build its shard,
    then run every step rank 0 sends until a stop or rank 0's end (its connection closes). Any
    failure ends the process (the group is broken)."""
    host, port = address.rsplit(":", 1)
    pipe = Client((host, int(port)), authkey=bytes.fromhex(os.environ.pop("PDSERVE_TP_AUTHKEY")))
    pipe.send(rank)
    config, store_port, threads, cores, channel_file, slot_bytes = pipe.recv()
    parent = os.getppid()
    threading.Thread(target=_watch_parent, args=(parent,), name="tp-parent", daemon=True).start()
    # NOTE: rank 0 alone answers signals (a supervisor's SIGTERM to the process group drains the
    # node, which needs its workers until it stops them; a terminal's Ctrl-C reaches them too).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    if cores:
        os.sched_setaffinity(0, cores)
    if config.device == "cpu":
        keep_freed_memory()
    size = config.tensor_parallel_size
    try:
        if torch.device(config.device).type == "cuda":
            torch.cuda.set_device(config.device)
        store = dist.TCPStore("127.0.0.1", store_port, size, False,
                              timeout=datetime.timedelta(seconds=_STORE_TIMEOUT_S))
        pipe.send(("joining", None))
        channel = _channel(channel_file, rank, size, slot_bytes, lambda: os.getppid() == parent)
        group = TPGroup(tp_shard(config.model, rank, size), config.model.vocab_size,
                        make_process_group(store, rank, size, config.device), channel)
        shared = shares_caches(config)
        built = build_rank(config, select_backend(config.device, config.kernel_backend), group, allocate=not shared,
                           loaded=lambda: pipe.send(("loaded", None)))
        if shared:
            pipe.send(("sized", built.num_blocks))
            handle = _cache_handle(pipe)
            if handle is None:
                return  # rank 0 stopped the group while starting
            built.kv_cache = _import_cache(handle, config, rank, built.num_blocks)
    except Exception as exc:  # noqa: BLE001 - process edge: report it to rank 0, then end
        # NOTE: on stderr too: a rank 0 stuck in a collective ends without reading the pipe (_watch_workers)
        sys.stderr.write(f"tensor-parallel rank {rank} failed to start: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    pipe.send(("ready", built.num_blocks))
    _serve(pipe, built, config)


def _cache_handle(pipe: Connection) -> tuple | None:
    """The cache rank 0 sends while starting (_give_worker_caches); None when it sent a stop instead
    or is gone."""
    try:
        message = pipe.recv_bytes()
    except (EOFError, OSError):
        return None
    if message == _STOP_MESSAGE:
        return None
    kind, handle = pickle.loads(message)
    return handle if kind == "cache" else None


def _serve(pipe: Connection, built: RankModel, config: EngineConfig) -> None:
    graphs = None
    while True:
        try:
            message = pipe.recv_bytes()
        except (EOFError, OSError):
            return  # rank 0 is gone
        values = np.frombuffer(message, dtype=np.int64)
        if values[0] == _OP_GRAPHS:
            capture, num_sizes = bool(values[1]), int(values[2])
            graphs = DecodeGraphs(built.model, built.kv_cache, config.cache.block_size, config.model.max_model_len,
                                  tuple(int(s) for s in values[3 : 3 + num_sizes]), capture=capture)
            graphs.capture()
            continue
        if values[0] == _OP_GRAPH_STEP:
            size, rows, k = (int(v) for v in values[1:4])
            ids, rest = values[4 : 4 + 4 * rows].reshape(4, rows).copy(), values[4 + 4 * rows :]
            graphs.replay_staged(size, ids, rest[:k].copy(), rest[k : 2 * k].astype(np.int32))
            continue
        step = _unpack_step(message, config.device)  # NOTE: not inference tensors: kernels memo their versions
        if step is None:
            return
        input_ids, meta, logits_indices = step
        hidden = built.model.forward(input_ids, meta, built.kv_cache, logits_indices)
        built.model.logits(hidden)


if __name__ == "__main__":
    _worker_main(sys.argv[1], int(sys.argv[2]))
