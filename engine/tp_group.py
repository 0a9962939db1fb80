"""The collectives of a tensor-parallel step, on one rank: the sum after each row-parallel
projection, the vocabulary-parallel embedding lookup and the LM head's gather to rank 0."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from engine.errors import EngineBroken
from engine.tp_shard import TPShard
from engine.tp_shm import ShmChannel

# NOTE: every rank enters a step's collectives within one layer's compute of each other, so a
# collective waiting this long means a rank is gone or stuck: the step fails (TensorParallelError).
COLLECTIVE_TIMEOUT_S = 120.0
# Set to 1: every rank of a split model on CUDA runs on the engine's own GPU and the ranks' sums go
# over gloo through host memory (slow). NCCL takes one rank per GPU; this lets a machine with one
# GPU run a split model's GPU paths (benchmarks/gpu_checks.sh: the KV of split prefill and decode
# nodes), never a deployment.
SHARE_GPU_VARIABLE = "PDSERVE_TP_SHARE_GPU"


def ranks_share_gpu() -> bool:
    return os.environ.get(SHARE_GPU_VARIABLE) == "1"


class TensorParallelError(EngineBroken):
    """A rank of the engine's tensor-parallel group failed or left: the group, and so the engine,
    cannot run another step."""


def make_process_group(store: dist.Store, rank: int, size: int, device: str):
    """The ranks' group over store (a backend object, its collectives called directly, as the gloo KV
    connector's: no global default group): NCCL for CUDA tensors, gloo for CPU ones."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device).index or 0)  # NCCL works on the current device: the rank's own
        if ranks_share_gpu():
            return dist.ProcessGroupGloo(store, rank, size, timeout)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class TPGroup:
    """One rank's side of its group's collectives (rank 0 drives the engine; every rank runs the
    same step on its shard). Each call blocks until every rank made it; raises
    TensorParallelError when a rank is gone."""

    def __init__(self, shard: TPShard, vocab_size: int, group, channel: ShmChannel | None = None) -> None:
        """channel: the ranks' shared-memory channel on one host (CPU ranks), for the collectives
        that fit its slots; the others, and every collective without one, go over group."""
        self.shard = shard
        self.vocab_size = vocab_size
        self.group = group
        self.channel = channel
        self._is_gloo = isinstance(group, dist.ProcessGroupGloo)
        # Set while a step is captured as CUDA graphs between its collectives (engine.piecewise):
        # cut(run, is_last) ends the graph so far; run() does the collective at each replay.
        self.cut: Callable[[Callable[[], object], bool], None] | None = None

    @property
    def rank(self) -> int:
        return self.shard.rank

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """x summed (or op) over the ranks, in place; returns x."""
        if self.cut is not None:  # NOTE: captured: x is static, summed in place at each replay
            self.cut(lambda: self._all_reduce(x, op), False)
            return x
        return self._all_reduce(x, op)

    def _all_reduce(self, x: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        if not x.numel():
            self._meet(x.device)
            return x
        if self.channel is not None and op == dist.ReduceOp.SUM and self.channel.fits(x):
            return self._through_channel(self.channel.all_reduce, x)
        options = dist.AllreduceOptions()
        options.reduceOp = op
        if x.is_cuda and self._is_gloo:  # NOTE: gloo works on host memory (ranks_share_gpu)
            staged = x.cpu()
            self._wait(self.group.allreduce([staged], options))
            return x.copy_(staged)
        self._wait(self.group.allreduce([x], options))
        return x

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values (what every rank's memory allows)."""
        nccl = getattr(dist, "ProcessGroupNCCL", None)  # NCCL takes CUDA tensors only (the current device's)
        device = "cuda" if nccl is not None and isinstance(self.group, nccl) else "cpu"
        return int(self.all_reduce(torch.tensor([value], dtype=torch.int64, device=device), dist.ReduceOp.MIN).item())

    def embed(self, table: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of token_ids [num_tokens] from the ranks' vocabulary slices (table:
        this rank's rows): each rank gives its own rows, zeros elsewhere, summed (exact)."""
        vocab = self.shard.vocab
        local = token_ids - vocab.start
        is_mine = (local >= 0) & (local < len(vocab))
        rows = table[local.clamp(0, len(vocab) - 1)]
        rows = torch.where(is_mine.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
        return self.all_reduce(rows)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The whole vocabulary's logits [rows, vocab] on rank 0 from each rank's slice [rows,
        len(shard.vocab)]; None on the other ranks."""
        shard = self.shard
        padded = logits
        if logits.shape[1] < shard.vocab_rows:
            padded = torch.nn.functional.pad(logits, (0, shard.vocab_rows - logits.shape[1]))
        padded = padded.contiguous()
        if self.cut is not None:  # NOTE: captured: rank 0's logits land in a static buffer at each replay
            if shard.rank != 0:
                self.cut(lambda: self._gather_vocab(padded), True)
                return None
            out = torch.empty((padded.shape[0], self.vocab_size), dtype=padded.dtype, device=padded.device)
            self.cut(lambda: out.copy_(self._gather_vocab(padded)), False)
            return out
        return self._gather_vocab(padded)

    def _gather_vocab(self, padded: torch.Tensor) -> torch.Tensor | None:
        if not padded.numel():  # a step that samples nothing (a prompt's chunk before its last)
            self._meet(padded.device)
            return padded.new_empty((0, self.vocab_size)) if self.rank == 0 else None
        if self.channel is not None and self.channel.fits(padded):
            gathered = self._through_channel(self.channel.gather, padded)
            return None if gathered is None else gathered[:, : self.vocab_size]
        options = dist.GatherOptions()
        options.rootRank = 0
        if padded.is_cuda and self._is_gloo:  # NOTE: gloo works on host memory (ranks_share_gpu)
            gathered = self._gather(padded.cpu(), options)
            return None if gathered is None else gathered.to(padded.device)
        return self._gather(padded, options)

    def _gather(self, padded: torch.Tensor, options) -> torch.Tensor | None:
        shard = self.shard
        if shard.rank != 0:
            self._wait(self.group.gather([], [padded], options))
            return None
        parts = [torch.empty_like(padded) for _ in range(shard.size)]
        self._wait(self.group.gather([parts], [padded], options))
        # NOTE: only the last rank's slice is short (tp_shard), so the padding all lies past vocab_size.
        return torch.cat(parts, dim=1)[:, : self.vocab_size]

    def _meet(self, device: torch.device) -> None:
        """A collective of nothing, as every rank's rows are none: one element summed instead.
        NOTE: a collective orders each rank's earlier kernels before rank 0 goes on, which
        engine.wait_for_kv_writes relies on (a worker's KV writes done once rank 0's device
        synchronized). NCCL skips an empty collective, and gloo's host copy of an empty GPU tensor
        waits for nothing, so an empty one would order nothing."""
        self._all_reduce(torch.zeros(1, device=device), dist.ReduceOp.SUM)

    def _through_channel(self, collective, x: torch.Tensor):
        try:
            return collective(x)
        except (ChildProcessError, TimeoutError) as exc:
            raise TensorParallelError(f"tensor-parallel rank {self.rank}: {exc}") from exc

    def _wait(self, work) -> None:
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - any failure of a collective breaks the group
            raise TensorParallelError(f"tensor-parallel rank {self.rank}: a collective failed "
                                      f"({type(exc).__name__}: {exc})") from exc
