"""Decode steps on static buffers, one CUDA graph per batch-size bucket.

A pure decode step (no prefill chunk) of n sequences runs the smallest bucket b >= n: the step's
token ids, positions, slot mapping, block tables and sequence lengths are written in place into
buffers sized for the largest bucket, rows n..b are padding, and the graph captured for b
replays the whole forward (every layer, the final norm, the LM head and the greedy argmax). A
padding row writes no KV (slot -1) and attends to nothing (length 0), so it touches no request's
memory. Steps with prompt tokens run elsewhere: as graph pieces (engine.mixed_graphs) or eagerly.

launch() is the same step without waiting for it: its tokens (the greedy argmax, or a sampler's draw
queued after the replay) are copied to the host in the background (PendingTokens), and rows may
take their input token from an earlier launch's tokens on the device, so the engine can queue step
N+1 before it reads step N's tokens (async scheduling).

Without graphs (DecodeGraphs(capture=False), any device) the same buffers and padding run
eagerly: the CPU tests check the bucket, padding and buffer logic against the plain path that way.

A split model (tensor parallelism): rank 0's DecodeGraphs has the worker ranks (TPRanks) build
theirs, warm up and capture in the same order (the warm-ups' collectives pair up), and hands each
step's staged buffers to them before it replays its own; each rank's step is captured as graphs
between its collectives (engine.piecewise). No async launches: the workers do not hold the tokens.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from engine.model import AttentionMetadata, CausalLM
from engine.piecewise import Pieces, capture_pieces
from engine.request import Request

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets: 1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, up to and including
    max_num_seqs (a batch pads to at most 15 rows)."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8)]
    sizes += range(80, max_num_seqs, 16)
    return tuple(sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs}))


def bucket_for(num_seqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket holding num_seqs rows; None when none does (or num_seqs < 1)."""
    if num_seqs < 1:
        return None
    idx = bisect.bisect_left(sizes, num_seqs)
    return sizes[idx] if idx < len(sizes) else None


@dataclass
class DecodeOutputs:
    """One bucket's outputs (the graph's own memory: valid until the next replay)."""

    logits: torch.Tensor  # [bucket, vocab], the model's dtype
    tokens: torch.Tensor  # [bucket] int64, the argmax of each row


# A launched step's tokens from its (logits [rows, vocab], greedy tokens [rows]), on the device.
Draw = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PendingTokens:
    """The tokens of a launched step, on their way to the host."""

    def __init__(self, device_tokens: torch.Tensor, host: torch.Tensor) -> None:
        # A graph's own argmax: valid until the next replay of any bucket (they share one memory pool);
        # a draw's: while referenced
        self.device_tokens = device_tokens
        self._host = host
        self._host.copy_(device_tokens, non_blocking=True)
        self._event = None
        if device_tokens.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        """Until the step has run on the device."""
        if self._event is not None:
            self._event.synchronize()

    def tokens(self) -> list[int]:
        """Wait for the step and return its tokens (the one host sync of a step)."""
        self.wait()
        return self._host.tolist()


@dataclass
class CaptureReport:
    sizes: tuple[int, ...]
    seconds: float
    memory_bytes: int  # device memory the graphs took (0 without graphs)


def capture_buckets(sizes: tuple[int, ...], device: torch.device, run: Callable[[int], object],
                    capture: Callable[[int, object, torch.cuda.Stream], None]) -> CaptureReport:
    """Each bucket, largest first: run(size) eagerly twice (kernels compiled, libraries' workspaces
    allocated before its capture), then capture(size, pool, stream) on one memory pool and one side
    stream for all; the time it took and the device memory it kept."""
    torch.cuda.synchronize(device)
    # NOTE: capturing empties the allocator's cache (torch.cuda.graph), which would count what it
    # held before (the load's temporaries) as freed by the graphs: emptied first, it is not.
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info(device)[0]
    started = time.perf_counter()
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
    for size in reversed(sizes):
        for _ in range(2):
            run(size)
        torch.cuda.synchronize(device)
        capture(size, pool, stream)
    torch.cuda.synchronize(device)
    return CaptureReport(tuple(sizes), time.perf_counter() - started,
                         max(0, free_before - torch.cuda.mem_get_info(device)[0]))


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int, max_model_len: int,
                 sizes: tuple[int, ...], capture: bool, ranks=None) -> None:
        """ranks: rank 0's TPRanks of a split model (each step's staged buffers go to them); None
        on one rank, and on a worker rank's own DecodeGraphs."""
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"capture sizes must be ascending and positive, got {sizes}")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sizes = tuple(sizes)
        self.use_graphs = capture
        self.ranks = ranks
        device = kv_cache.device
        rows = self.sizes[-1]
        self.width = -(-max_model_len // block_size)  # a request's most blocks
        # The device buffers the graphs read: int64 [4, rows] (token ids, positions, slots, and for
        # launch(), the earlier step's row whose token a row takes) copied in whole each step, and
        # int32 [rows + rows * width] (the sequence lengths, then the block tables row by row),
        # updated by a scatter of the entries that changed: a row's table is sent once for its
        # request, then block by block as it grows. The host side: a mirror of the tables, and
        # two sets of pinned staging buffers, one per step in flight (a step's copies may still be
        # queued when the next one is filled).
        pin = device.type == "cuda"
        num_ints = rows * (self.width + 1)
        self._ids = torch.zeros(4, rows, dtype=torch.long, device=device)
        self._ints = torch.zeros(num_ints, dtype=torch.int32, device=device)
        self._update_index = torch.zeros(num_ints, dtype=torch.long, device=device)
        self._update_value = torch.zeros(num_ints, dtype=torch.int32, device=device)
        self._staging = [(torch.zeros(4, rows, dtype=torch.long, pin_memory=pin),
                          torch.zeros(num_ints, dtype=torch.long, pin_memory=pin),
                          torch.zeros(num_ints, dtype=torch.int32, pin_memory=pin)) for _ in range(2)]
        self._next_staging = 0
        self._np_ids = self._staging[0][0].numpy()
        self._np_lens = np.zeros(rows, dtype=np.int32)
        self._row_owner: list[tuple[int, int] | None] = [None] * rows  # (serial, preemptions) on the device
        self._row_blocks = [0] * rows  # how many of its blocks the device has
        self._num_updates = 0
        self._update_np: tuple[np.ndarray, np.ndarray] | None = None
        self._seq_lens = self._ints[:rows]
        self._tables = self._ints[rows:].view(rows, self.width)
        self._no_prefill_tables = torch.zeros(0, self.width, dtype=torch.int32, device=device)
        self._no_prefill_cu = torch.zeros(1, dtype=torch.int32, device=device)
        self._no_prefill_lens = torch.zeros(0, dtype=torch.int32, device=device)
        # Two: the tokens of step N are read while those of step N+1 are copied.
        self._host_tokens = [torch.zeros(rows, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._next_host = 0
        self._graphs: dict[int, torch.cuda.CUDAGraph | Pieces] = {}
        self._outputs: dict[int, DecodeOutputs] = {}
        self.report = CaptureReport(self.sizes, 0.0, 0)
        self._begin_staging()
        self._fill_padding(0, rows)
        self._copy_in(rows)

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def takes(self, decodes: list[Request], num_prefills: int) -> bool:
        return num_prefills == 0 and 0 < len(decodes) <= self.max_size

    def capture(self) -> CaptureReport:
        """Capture every bucket's graph, largest first, on one memory pool (a no-op without
        graphs). Each bucket runs eagerly twice first: kernels are compiled and libraries'
        workspaces allocated outside the capture. A split model's worker ranks do the same."""
        if self.ranks is not None:
            self.ranks.send_graphs(self.sizes, self.use_graphs)
        if not self.use_graphs:
            return self.report
        self.report = capture_buckets(self.sizes, self.kv_cache.device, self._forward, self._capture)
        return self.report

    def _capture(self, size: int, pool, stream) -> None:
        if self.model.tp is not None:
            self._graphs[size], self._outputs[size] = capture_pieces(partial(self._forward, size), self.model.tp,
                                                                     pool, stream)
            return
        graph = torch.cuda.CUDAGraph()
        # NOTE: stream, not torch's default capture stream: that one is made once per process, on
        # the device current then, which is not this engine's where a process runs two GPUs.
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            self._outputs[size] = self._forward(size)
        self._graphs[size] = graph

    def run(self, decodes: list[Request]) -> DecodeOutputs:
        """The step of these decodes (takes() said yes): outputs' first len(decodes) rows are theirs."""
        num = len(decodes)
        size = self._stage(decodes)
        out = self._replay(size)
        return DecodeOutputs(out.logits[:num], out.tokens[:num])

    def launch(self, decodes: list[Request], fed: list[int] | None = None,
               previous: PendingTokens | None = None, draw: Draw | None = None) -> PendingTokens:
        """Queue the step of these decodes and return its tokens, pending. fed: for each row, the
        row of `previous` (the launch just before this one) whose token is its input (its own last
        token is not known yet), or -1 where its input is known; None: every input is known.
        draw: the rows' tokens from (logits, greedy tokens), queued on the device (Sampler.draw);
        None: the greedy tokens."""
        num = len(decodes)
        size = self._stage(decodes, fed)
        if fed is not None:
            rows, inputs = self._ids[3, :num], self._ids[0, :num]
            if min(fed) >= 0:
                inputs.copy_(previous.device_tokens.index_select(0, rows))
            else:  # a row fed -1 (a request that joined since previous) keeps its input, staged from the host
                inputs.copy_(torch.where(rows >= 0, previous.device_tokens.index_select(0, rows.clamp(min=0)), inputs))
        out = self._replay(size)
        tokens = out.tokens[:num] if draw is None else draw(out.logits[:num], out.tokens[:num])
        host = self._host_tokens[self._next_host][:num]
        self._next_host ^= 1
        return PendingTokens(tokens, host)

    def _stage(self, decodes: list[Request], fed: list[int] | None = None) -> int:
        """Fill the buffers for these decodes (fed: launch()'s); returns their bucket."""
        num = len(decodes)
        size = bucket_for(num, self.sizes)
        assert size is not None, f"{num} decodes past the largest bucket {self.max_size}"
        self._begin_staging()
        try:
            self._fill(decodes)
        except BaseException:
            # _fill notes each row's blocks as on the device before _copy_in sends them: resend every table
            self._row_owner = [None] * len(self._row_owner)
            raise
        if fed is not None:
            self._np_ids[3, :num] = fed
        self._fill_padding(num, size)
        ids, index, value = self._copy_in(size)
        if self.ranks is not None:
            self.ranks.send_graph_step(size, ids.numpy(), index.numpy(), value.numpy())
        return size

    def replay_staged(self, size: int, ids: np.ndarray, index: np.ndarray, value: np.ndarray) -> None:
        """A worker rank's step: rank 0's staged buffers (_stage) into this rank's, then its replay."""
        self._load(torch.from_numpy(ids), torch.from_numpy(index), torch.from_numpy(value))
        self._replay(size)

    def _replay(self, size: int) -> DecodeOutputs:
        if not self.use_graphs:
            out = self._forward(size)
        else:
            self._graphs[size].replay()
            out = self._outputs[size]
        return out

    def _begin_staging(self) -> None:
        ids, index, value = self._staging[self._next_staging]
        self._next_staging ^= 1
        self._np_ids = ids.numpy()
        self._update_np = (index.numpy(), value.numpy())
        self._num_updates = 0

    def _fill(self, decodes: list[Request]) -> None:
        ids, lens, bs = self._np_ids, self._np_lens, self.block_size
        for row, request in enumerate(decodes):
            pos = request.num_computed_tokens
            blocks = request.block_ids
            ids[0, row] = max(0, request.token_ids_slice(pos, pos + 1)[0])  # a pending token: fed in launch()
            ids[1, row] = pos
            ids[2, row] = blocks[pos // bs] * bs + pos % bs
            lens[row] = pos + 1
            owner = (request.serial, request.num_preemptions)
            first = self._row_blocks[row] if self._row_owner[row] == owner else 0
            if len(blocks) > first:
                self._add_updates(self.max_size + row * self.width + first, blocks[first:])
                self._row_owner[row], self._row_blocks[row] = owner, len(blocks)

    def _add_updates(self, start: int, values: list[int] | np.ndarray) -> None:
        """Entries start, start + 1, ... of the device's int32 buffer become values."""
        index, value = self._update_np
        k, n = self._num_updates, len(values)
        index[k : k + n] = np.arange(start, start + n)
        value[k : k + n] = values
        self._num_updates = k + n

    def _fill_padding(self, start: int, end: int) -> None:
        """Rows start..end: token 0 at position 0, no KV written (slot -1), length 0."""
        self._np_ids[0:2, start:end] = 0
        self._np_ids[2, start:end] = -1
        self._np_lens[start:end] = 0

    def _copy_in(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The staged step into the device buffers: its ids whole; its lengths and the tables'
        changed entries scattered (returned: what a split model's workers load too). Entries past a
        sequence's blocks are never read."""
        self._add_updates(0, self._np_lens[:size])
        ids, index, value = self._staging[self._next_staging ^ 1]
        staged = ids, index[: self._num_updates], value[: self._num_updates]
        self._load(*staged)
        return staged

    def _load(self, ids: torch.Tensor, index: torch.Tensor, value: torch.Tensor) -> None:
        """Host buffers into the device's: ids whole, value scattered to index."""
        k = index.shape[0]
        self._ids.copy_(ids, non_blocking=True)  # NOTE: whole (8 bytes x 4 x rows): a column slice is strided
        self._update_index[:k].copy_(index, non_blocking=True)
        self._update_value[:k].copy_(value, non_blocking=True)
        self._ints.index_copy_(0, self._update_index[:k], self._update_value[:k])

    def _forward(self, size: int) -> DecodeOutputs | None:
        ids = self._ids
        meta = AttentionMetadata(
            positions=ids[1, :size], slot_mapping=ids[2, :size], num_decode_tokens=size,
            decode_block_tables=self._tables[:size], decode_seq_lens=self._seq_lens[:size],
            prefill_block_tables=self._no_prefill_tables, prefill_cu_query_lens=self._no_prefill_cu,
            prefill_seq_lens=self._no_prefill_lens,
        )
        with torch.inference_mode():
            hidden = self.model.forward(ids[0, :size], meta, self.kv_cache, None)
            logits = self.model.logits(hidden)
            if logits is None:
                return None  # a worker rank's: the logits are gathered on rank 0
            return DecodeOutputs(logits, self.model.ops.argmax(logits))
