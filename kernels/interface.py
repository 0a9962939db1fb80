"""The one interface every compute backend implements (kernels/reference, kernels/cpu, kernels/triton).

A backend prepares each weight once into its own form (prepare_linear) and runs the model's ops on
it. The public methods check shapes and raise ValueError naming the op; the backends implement the
underscored ones. Optional fused work is a capability (greedy_head, fused_decode), never a second
model: a backend without it returns None and the model runs its one layer loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class FusedDecode(Protocol):
    """A whole decode step's layers in one call (a backend capability)."""

    def takes(self, hidden: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether this decode-only batch can run here."""

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor,
            kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual stream), as the layer loop leaves them."""


@dataclass(frozen=True)
class LayerShape:
    """What a fused decode capability needs to know of the model."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


class Backend(ABC):
    """One compute backend for one device; chosen once (kernels/select.py)."""

    name: str = ""
    # Whether a decode step of its ops can be captured in a CUDA graph and replayed: no host syncs,
    # no shapes taken from the data (the Triton backend); else decode graphs run their static
    # buffers eagerly.
    graph_capturable: bool = False

    def __init__(self, device: str) -> None:
        self.device = device

    def describe(self) -> str:
        """One line for the start-up log: the backend and what it runs on."""
        return f"{self.name} on {self.device}"

    # ---- weights -------------------------------------------------------------------------------

    @abstractmethod
    def prepare_linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, copy: bool = True,
                       small_batches: bool = True, gate_up: bool = False) -> Any:
        """weight [out, in] (and bias [out]) in this backend's form for linear(). copy=False (an LM
        head tied to the embedding) may keep a view of weight; small_batches=False (a prefill-only
        engine) skips copies for decode-sized batches; gate_up: a gated MLP's gate rows then its up
        rows, for gate_up_silu()."""

    def prepare_greedy_head(self, weight: torch.Tensor, head: Any) -> Any | None:
        """The greedy-head capability for LM head weight (head: it from prepare_linear): None where
        this backend has none; else greedy_argmax() takes it."""
        return None

    def fused_decode(self, layers: list, shape: LayerShape, cos_sin_cache: torch.Tensor) -> FusedDecode | None:
        """The fused decode-step capability for these prepared layers; None where there is none."""
        return None

    # ---- ops (checked here, run by the backend) -----------------------------------------------------

    def linear(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        """x: [rows, in] -> [rows, out] in x's dtype."""
        if x.dim() != 2 or x.shape[1] != w.in_features:
            raise ValueError(f"linear: x {tuple(x.shape)} for a weight of {w.in_features} inputs")
        return self._linear(x, w)

    def gate_up_silu(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        """silu_and_mul(linear(x, w)) for w prepared with gate_up=True."""
        if x.dim() != 2 or x.shape[1] != w.in_features:
            raise ValueError(f"gate_up_silu: x {tuple(x.shape)} for a weight of {w.in_features} inputs")
        return self._gate_up_silu(x, w)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * intermediate] -> silu(x[:, :I]) * x[:, I:]."""
        if x.dim() != 2 or x.shape[-1] % 2:
            raise ValueError(f"silu_and_mul: x must be [num_tokens, 2 * intermediate], got {tuple(x.shape)}")
        return self._silu_and_mul(x)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [num_tokens, hidden], weight: [hidden] -> [num_tokens, hidden] in x.dtype."""
        _check_norm(x, weight)
        return self._rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual); the inputs are not modified."""
        _check_norm(x, weight)
        if residual.shape != x.shape:
            raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
        return self._add_rms_norm(x, residual, weight, eps)

    def rotary_and_write_kv(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            positions: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache_layer: torch.Tensor,
                            slot_mapping: torch.Tensor) -> None:
        """Rotate query [num_tokens, num_heads, head_dim] and key [num_tokens, num_kv_heads,
        head_dim] in place (neox style; views with a unit last stride are fine), then write key and
        value into kv_cache_layer [num_blocks, 2, block_size, num_kv_heads, head_dim] at
        slot_mapping [num_tokens] (-1 skips a token). Raises ValueError on mismatched shapes."""
        _check_rotary(query, key, positions, cos_sin_cache)
        if (key.shape != value.shape or slot_mapping.shape != key.shape[:1]
                or key.shape[1:] != kv_cache_layer.shape[3:]):
            raise ValueError(f"write_kv: key {tuple(key.shape)}, value {tuple(value.shape)}, slots "
                             f"{tuple(slot_mapping.shape)}, cache {tuple(kv_cache_layer.shape)}")
        self._rotary_and_write_kv(query, key, value, positions, cos_sin_cache, kv_cache_layer, slot_mapping)

    def decode_attention(self, query: torch.Tensor, kv_cache_layer: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """query: [num_seqs, num_heads, head_dim]; kv_cache_layer: [num_blocks, 2, block_size,
        num_kv_heads, head_dim] (strided view); block_tables: [num_seqs, max_blocks] int32; seq_lens:
        [num_seqs] int32 (the query's own K/V already written). Returns [num_seqs, num_heads,
        head_dim]; a sequence of length 0 gets zeros."""
        _check_decode_attention(query, kv_cache_layer, block_tables, seq_lens)
        return self._decode_attention(query, kv_cache_layer, block_tables, seq_lens, scale)

    def prefill_attention(self, query: torch.Tensor, kv_cache_layer: torch.Tensor, block_tables: torch.Tensor,
                          cu_query_lens: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                          max_query_len: int | None = None) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim]; sequence b's queries are
        query[cu_query_lens[b]:cu_query_lens[b+1]] at its last q_len positions of seq_lens[b], each
        attending causally to the cache (the chunk's own K/V already written). max_query_len: the
        longest chunk where the caller knows it (a GPU backend then reads nothing back)."""
        _check_prefill_attention(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens)
        return self._prefill_attention(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale,
                                       max_query_len)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, cols] -> int64 [rows], torch.argmax(x, dim=-1) (ties and NaN alike)."""
        if x.dim() != 2:
            raise ValueError(f"argmax: x must be [rows, cols], got {tuple(x.shape)}")
        return self._argmax(x)

    def greedy_argmax(self, x: torch.Tensor, head: Any) -> torch.Tensor:
        """The argmax of each row's logits through a greedy head from prepare_greedy_head."""
        raise NotImplementedError(f"the {self.name} backend has no greedy head")

    # ---- what a backend implements ----------------------------------------------------------------

    @abstractmethod
    def _linear(self, x, w): ...

    def _gate_up_silu(self, x, w):
        return self._silu_and_mul(self._linear(x, w))

    @abstractmethod
    def _silu_and_mul(self, x): ...

    @abstractmethod
    def _rms_norm(self, x, weight, eps): ...

    @abstractmethod
    def _add_rms_norm(self, x, residual, weight, eps): ...

    @abstractmethod
    def _rotary_and_write_kv(self, query, key, value, positions, cos_sin_cache, kv_cache_layer, slot_mapping): ...

    @abstractmethod
    def _decode_attention(self, query, kv_cache_layer, block_tables, seq_lens, scale): ...

    @abstractmethod
    def _prefill_attention(self, query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale,
                           max_query_len): ...

    @abstractmethod
    def _argmax(self, x): ...


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")


def _check_rotary(query, key, positions, cos_sin_cache) -> None:
    if query.dim() != 3 or key.dim() != 3 or not query.shape[0] == key.shape[0] == positions.shape[0]:
        raise ValueError(
            f"apply_rotary: query {tuple(query.shape)}, key {tuple(key.shape)}, positions {tuple(positions.shape)}")
    if not query.shape[-1] == key.shape[-1] == cos_sin_cache.shape[-1]:
        raise ValueError(
            f"apply_rotary: head_dim {query.shape[-1]}, key {key.shape[-1]}, cache width {cos_sin_cache.shape[-1]}")
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("apply_rotary: query and key need a unit stride in head_dim")


def _check_decode_attention(query, kv_cache_layer, block_tables, seq_lens) -> None:
    if query.dim() != 3 or kv_cache_layer.dim() != 5 or query.shape[-1] != kv_cache_layer.shape[-1]:
        raise ValueError(f"decode_attention: query {tuple(query.shape)}, cache {tuple(kv_cache_layer.shape)}")
    if query.shape[1] % kv_cache_layer.shape[3]:
        raise ValueError(
            f"decode_attention: {query.shape[1]} heads not a multiple of {kv_cache_layer.shape[3]} KV heads")
    if block_tables.shape[0] != query.shape[0] or seq_lens.shape != query.shape[:1]:
        raise ValueError(f"decode_attention: {query.shape[0]} seqs, block tables {tuple(block_tables.shape)}, "
                         f"seq_lens {tuple(seq_lens.shape)}")


def _check_prefill_attention(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens) -> None:
    if query.dim() != 3 or query.shape[-1] != kv_cache_layer.shape[-1] or query.shape[1] % kv_cache_layer.shape[3]:
        raise ValueError(f"prefill_attention: query {tuple(query.shape)}, cache {tuple(kv_cache_layer.shape)}")
    if cu_query_lens.shape[0] != seq_lens.shape[0] + 1 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"prefill_attention: cu_query_lens {tuple(cu_query_lens.shape)}, seq_lens {tuple(seq_lens.shape)}, "
            f"block tables {tuple(block_tables.shape)}")
