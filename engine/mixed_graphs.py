"""Steps with prompt tokens as CUDA graphs between their attentions (piecewise), one set per token bucket.

An eager step launches every kernel from Python (on an H200, ~7 ms of host work a step for a
16-layer model, where a 512-token prefill takes ~2 ms of GPU): a prefill of a few prompts, or a
colocated node's step that mixes new prompts into its decodes, waits on the host. Here a step of n
tokens (decodes and prefill chunks, any mix, n up to the largest bucket) runs the smallest bucket
b >= n: its token ids, positions and slots are written into static buffers (rows n..b-1 are padding:
no KV written, slot -1), and everything but the attention is replayed from CUDA graphs captured at
start-up, one piece per layer's stretch between two attentions. Each piece ends by copying its
rotated queries into one static buffer; each attention runs eagerly between two pieces on the
step's own metadata (its sequences and block tables vary step to step) over the real rows, into a
second static buffer the next piece reads. The two buffers serve every layer and bucket (all runs
in order on one stream), so the graphs keep no per-layer activations alive. Every layer runs all rows (the eager path's
last layer runs the sampled rows alone); the LM head runs eagerly on the rows the step samples.

Without graphs (MixedGraphs(capture=False), any device) the same buffers, padding and attention
run eagerly: the CPU tests check them against the plain path that way. A split model (tensor
parallelism) has no mixed graphs: its collectives cut its steps already (engine.piecewise).
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from engine.decode_graphs import CaptureReport, bucket_for, capture_buckets
from engine.model import AttentionMetadata, CausalLM
from engine.piecewise import Pieces, capture_pieces

logger = logging.getLogger(__name__)


def mixed_sizes(max_tokens: int) -> tuple[int, ...]:
    """The buckets: 32, 64, 128, 256, then steps of 256 up to and including max_tokens (a step of
    n tokens pads to 32 rows at least, to under 2n between 32 and 256, and by at most 255 above)."""
    if max_tokens < 1:
        return ()
    sizes = {s for s in (32, 64, 128, 256, *range(512, max_tokens, 256)) if s < max_tokens}
    return tuple(sorted(sizes | {max_tokens}))


class MixedGraphs:
    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, sizes: tuple[int, ...], capture: bool) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"mixed graph sizes must be ascending and positive, got {sizes}")
        if model.tp is not None:
            raise ValueError("a split model's steps are cut at its collectives: no mixed graphs")
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = tuple(sizes)
        self.use_graphs = capture
        device = kv_cache.device
        rows = self.sizes[-1]
        # int64 [3, rows]: token ids, positions, slots; copied in whole each step from pinned staging
        # (two: one may still be on its way while the next is filled; its event says when it is not)
        pin = device.type == "cuda"
        self._ids = torch.zeros(3, rows, dtype=torch.long, device=device)
        self._staging = [torch.zeros(3, rows, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._staged = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._next_staging = 0
        self._no_tables = torch.zeros(0, 1, dtype=torch.int32, device=device)
        self._no_cu = torch.zeros(1, dtype=torch.int32, device=device)
        self._no_lens = torch.zeros(0, dtype=torch.int32, device=device)
        self._pieces: dict[int, Pieces] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        # The step being run, as the captured attentions read it (not this object: a closure of
        # _pieces holding it would keep the engine's model and cache alive until a cycle collection)
        self._step = _Step(model, rows, device)
        # Set while a bucket is captured (engine.piecewise): cut(run, is_last) ends the graph so far.
        self.cut = None
        self.report = CaptureReport(self.sizes, 0.0, 0)

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def takes(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_size

    def capture(self) -> CaptureReport:
        """Capture every bucket's pieces, largest first, on one memory pool (a no-op without graphs).
        Each bucket runs eagerly twice first (on an empty step: padding rows only), so kernels are
        compiled before the capture. The report's memory is what the capture and those runs kept."""
        if not self.use_graphs:
            return self.report
        self._stage_padding_only()
        self.report = capture_buckets(self.sizes, self.kv_cache.device, self._forward, self._capture)
        return self.report

    def _capture(self, size: int, pool, stream) -> None:
        self._pieces[size], self._outputs[size] = capture_pieces(partial(self._forward, size), self, pool, stream)

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's final hidden states (normed: the LM head's input) [num_tokens, hidden], every
        row: input_ids and meta's positions and slot_mapping on the host (staged here), the rest of
        meta (the attention's: sequences, tables) on the device. Valid until the next step."""
        num = input_ids.shape[0]
        size = bucket_for(num, self.sizes)
        assert size is not None, f"{num} tokens for mixed graphs of at most {self.max_size}"
        which = self._next_staging
        self._next_staging ^= 1
        staging, staged = self._staging[which], self._staged[which]
        if staged is not None:
            staged.synchronize()  # its copy two steps ago is done (nothing else need have waited)
        staging[0, :num] = input_ids
        staging[1, :num] = meta.positions
        staging[2, :num] = meta.slot_mapping
        staging[:2, num:size] = 0
        staging[2, num:size] = -1
        self._ids.copy_(staging, non_blocking=True)  # NOTE: whole (24 bytes a row): a column slice is strided
        if staged is not None:
            staged.record()
        self._step.meta, self._step.num_tokens = meta, num
        try:
            if self.use_graphs:
                self._pieces[size].replay()
                out = self._outputs[size]
            else:
                out = self._forward(size)
        finally:
            self._step.meta = None
        return out[:num]

    def _stage_padding_only(self) -> None:
        """Every row padding (the warm-up and capture runs): no KV written, nothing attended."""
        self._ids.zero_()
        self._ids[2].fill_(-1)
        self._step.meta, self._step.num_tokens = None, 0

    def _forward(self, size: int) -> torch.Tensor:
        ids = self._ids
        meta = AttentionMetadata(
            positions=ids[1, :size], slot_mapping=ids[2, :size], num_decode_tokens=0,
            decode_block_tables=self._no_tables, decode_seq_lens=self._no_lens,
            prefill_block_tables=self._no_tables, prefill_cu_query_lens=self._no_cu,
            prefill_seq_lens=self._no_lens)
        self.model.attention_cut = self._attention_piece
        try:
            with torch.inference_mode():
                return self.model.forward(ids[0, :size], meta, self.kv_cache, None)
        finally:
            self.model.attention_cut = None

    def _attention_piece(self, query: torch.Tensor, kv_cache_layer: torch.Tensor) -> torch.Tensor:
        """A layer's attention output [rows, heads, head_dim] (the shared output buffer's rows):
        computed now, or, while a bucket is captured, at each replay between the pieces around it.
        Padding rows keep whatever is there: every op after it works row by row, and their rows are
        dropped."""
        rows, step = query.shape[0], self._step
        step.query[:rows].copy_(query)  # NOTE: the piece's last op: its qkv output is free after it
        attend = partial(step.attend, kv_cache_layer)
        if self.cut is not None:
            self.cut(attend, False)
        else:
            attend()
        return step.attended[:rows]


class _Step:
    """The step mixed graphs run: its attention metadata and real rows, and what each layer's
    attention reads and writes: the queries of the layer at hand and its output, static buffers of
    rows rows for every layer and bucket."""

    def __init__(self, model: CausalLM, rows: int, device: torch.device) -> None:
        cfg = model.config
        self.model = model
        self.query = torch.zeros((rows, cfg.num_heads, cfg.head_dim), dtype=cfg.dtype, device=device)
        self.attended = torch.zeros_like(self.query)
        self.meta: AttentionMetadata | None = None
        self.num_tokens = 0

    def attend(self, kv_cache_layer: torch.Tensor) -> None:
        num = self.num_tokens
        if num:
            self.attended[:num].copy_(self.model.attend(self.query[:num], self.meta, kv_cache_layer))
