"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flattened varlen batch.

All scheduled tokens of all requests form one [num_tokens, hidden] tensor, decodes first, then
prefill chunks. Every op runs on the engine's compute backend (kernels/interface.py), chosen once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.tp_group import TPGroup
from engine.weights import LayerWeights, ModelWeights
from kernels.interface import Backend, LayerShape
from kernels.reference.ops import rotary_cos_sin_cache


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each sequence attends to, for one step.

    The first num_decode_tokens tokens are decodes (one per sequence); the rest are prefill
    chunks delimited by prefill_cu_query_lens.
    """

    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_cu_query_lens: torch.Tensor  # [num_prefills + 1] int32
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32
    # Each logits row's sequence: its block table and its position + 1 (the last layer attends
    # from those rows alone, see CausalLM._layers).
    logits_block_tables: torch.Tensor | None = None  # [num_logits, max_blocks] int32
    logits_seq_lens: torch.Tensor | None = None  # [num_logits] int32
    # The longest prefill chunk, known on the host (0: not given, the backend reads it if it needs it).
    prefill_max_query_len: int = 0


class CausalLM:
    """config: the model as this rank holds it (tp_shard.local_model_config: its heads and MLP rows);
    tp: its tensor-parallel group, None for a model on one rank."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, backend: Backend,
                 tp: TPGroup | None = None) -> None:
        self.config = config
        self.weights = weights
        self.ops = backend
        self.tp = tp
        self.scale = config.head_dim**-0.5
        self.cos_sin_cache = rotary_cos_sin_cache(
            config.head_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_scaling, torch.float32,
        ).to(device=backend.device, dtype=config.dtype)
        self._q_size = config.num_heads * config.head_dim
        self._kv_size = config.num_kv_heads * config.head_dim
        self.layer_shape = LayerShape(hidden=config.hidden_size, num_heads=config.num_heads,
                                      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                      intermediate=config.intermediate_size, eps=config.rms_norm_eps, scale=self.scale)
        # A backend capability (the whole decode step's layers in one call), or None; it has no place
        # for the ranks' sums.
        self.fused_decode = None if tp else backend.fused_decode(weights.layers, self.layer_shape, self.cos_sin_cache)
        # Set while mixed graphs run a step (engine.mixed_graphs): each layer's attention is theirs,
        # attention_cut(query, kv_cache_layer) -> its output.
        self.attention_cut = None

    @property
    def has_greedy_head(self) -> bool:
        return self.weights.greedy_head is not None

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """Run the batch, writing its K/V into kv_cache; returns the final hidden states (normed,
        the LM head's input) [len(logits_indices), hidden] of the tokens at logits_indices (None:
        of every token, in order; it must be None while attention_cut is set)."""
        assert self.attention_cut is None or logits_indices is None, "mixed graphs run every row"
        hidden = self._embed(input_ids)
        fused = self.fused_decode
        # NOTE: the fused layers give every row: a decode batch samples each of its rows, in order
        if (fused is not None and meta.num_decode_tokens == hidden.shape[0] and fused.takes(hidden, kv_cache)
                and (logits_indices is None or logits_indices.shape[0] == hidden.shape[0])):
            hidden, residual = fused.run(hidden, meta.positions, meta.slot_mapping, meta.decode_block_tables,
                                         meta.decode_seq_lens, kv_cache)
        else:
            hidden, residual = self._layers(hidden, meta, kv_cache, logits_indices)
        return self.ops.add_rms_norm(hidden, residual, self.weights.norm, self.config.rms_norm_eps)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The LM head: [rows, hidden] -> [rows, vocab] in the model's dtype (tensor-parallel:
        gathered on rank 0, None on the other ranks)."""
        logits = self.ops.linear(hidden, self.weights.lm_head)
        return logits if self.tp is None else self.tp.gather_vocab(logits)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.weights.embed_tokens[input_ids]
        return self.tp.embed(self.weights.embed_tokens, input_ids)

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output summed over the ranks (itself on one rank)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of logits(hidden), int64 [rows], from the backend's greedy head (needs
        has_greedy_head): the same token, without the logits."""
        return self.ops.greedy_argmax(hidden, self.weights.greedy_head)

    def _layers(
        self, hidden: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
        logits_indices: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers; returns (hidden, residual) of the rows at logits_indices. Every
        layer writes every token's K/V; the last runs the rest (attention, O, the MLP) on the
        logits rows alone, each attending like a decode of its sequence up to its own position."""
        ops, eps = self.ops, self.config.rms_norm_eps
        last = len(self.weights.layers) - 1
        residual = None
        for layer_idx, layer in enumerate(self.weights.layers):
            kv_layer = kv_cache[:, layer_idx]
            if residual is None:
                normed, residual = ops.rms_norm(hidden, layer.input_norm, eps), hidden
            else:
                normed, residual = ops.add_rms_norm(hidden, residual, layer.input_norm, eps)
            query = self._qkv_to_cache(layer, normed, meta, kv_layer)
            if self.attention_cut is not None:
                attended = self.attention_cut(query, kv_layer)
            elif layer_idx == last and logits_indices is not None:
                attended = self._attend_logits_rows(query, meta, kv_layer, logits_indices)
                residual = residual[logits_indices]
            else:
                attended = self.attend(query, meta, kv_layer)
            hidden = self._reduced(ops.linear(attended.reshape(attended.shape[0], self._q_size), layer.o))
            normed, residual = ops.add_rms_norm(hidden, residual, layer.post_norm, eps)
            hidden = self._reduced(ops.linear(ops.gate_up_silu(normed, layer.gate_up), layer.down))
        return hidden, residual

    def _qkv_to_cache(
        self, layer: LayerWeights, x: torch.Tensor, meta: AttentionMetadata, kv_cache_layer: torch.Tensor,
    ) -> torch.Tensor:
        """Q, K and V of every token, rotated; K and V written to the cache. Returns Q
        [num_tokens, num_heads, head_dim]."""
        num_tokens = x.shape[0]
        cfg = self.config
        qkv = self.ops.linear(x, layer.qkv)
        query, key, value = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
        query = query.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        key = key.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        value = value.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        self.ops.rotary_and_write_kv(query, key, value, meta.positions, self.cos_sin_cache, kv_cache_layer,
                                     meta.slot_mapping)
        return query

    def _attend_logits_rows(self, query: torch.Tensor, meta: AttentionMetadata, kv_cache_layer: torch.Tensor,
                            logits_indices: torch.Tensor) -> torch.Tensor:
        """The last layer's attention output for the logits rows, in their order: each row as a
        decode of its sequence up to its own position (meta's logits_*), or, where the logits
        rows are as many as the tokens, the step's own attention."""
        if meta.logits_seq_lens is None or logits_indices.shape[0] == query.shape[0]:
            return self.attend(query, meta, kv_cache_layer)[logits_indices]
        rows = query[logits_indices]
        if rows.shape[0] == 0:
            return rows
        return self.ops.decode_attention(rows, kv_cache_layer, meta.logits_block_tables, meta.logits_seq_lens,
                                         self.scale)

    def attend(self, query: torch.Tensor, meta: AttentionMetadata, kv_cache_layer: torch.Tensor) -> torch.Tensor:
        """The step's attention for every query row (decodes first, then the prefill chunks)."""
        num_decodes = meta.num_decode_tokens
        parts = []
        if num_decodes:
            parts.append(self.ops.decode_attention(
                query[:num_decodes], kv_cache_layer, meta.decode_block_tables, meta.decode_seq_lens, self.scale,
            ))
        if num_decodes < query.shape[0]:
            parts.append(self.ops.prefill_attention(
                query[num_decodes:], kv_cache_layer, meta.prefill_block_tables,
                meta.prefill_cu_query_lens, meta.prefill_seq_lens, self.scale, meta.prefill_max_query_len or None,
            ))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
