"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flattened varlen batch.

All scheduled tokens of all requests form one [num_tokens, hidden] tensor, decodes first, then
prefill chunks. Every op but the matmuls goes through kernels/ (Triton on CUDA, torch else).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.weights import LayerWeights, ModelWeights
from kernels.decode_attention import decode_attention
from kernels.decode_layers import DecodeLayers
from kernels.greedy_head import greedy_head_argmax
from kernels.linear import linear, linear_silu_and_mul
from kernels.prefill_attention import prefill_attention
from kernels.rms_norm import add_rms_norm, rms_norm
from kernels.rotary import apply_rotary, rotary_cos_sin_cache
from kernels.write_kv import write_kv


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
    # from those rows alone, see CausalLM._last_layer).
    logits_block_tables: torch.Tensor | None = None  # [num_logits, max_blocks] int32
    logits_seq_lens: torch.Tensor | None = None  # [num_logits] int32


class CausalLM:
    def __init__(self, config: ModelConfig, weights: ModelWeights, device: str) -> None:
        self.config = config
        self.weights = weights
        self.scale = config.head_dim**-0.5
        self.cos_sin_cache = rotary_cos_sin_cache(
            config.head_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_scaling, torch.float32,
        ).to(device=device, dtype=config.dtype)
        self._q_size = config.num_heads * config.head_dim
        self._kv_size = config.num_kv_heads * config.head_dim
        # Decode-only steps run their layers in one C call (same kernels, same bits) on CPUs with
        # the small-batch projection kernels (bfloat16 on AMX or AVX512-BF16, float32 on AVX-512);
        # `available` is False elsewhere and every step takes the loop below.
        self.decode_layers = DecodeLayers(
            weights.layers, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, intermediate=config.intermediate_size, hidden=config.hidden_size,
            eps=config.rms_norm_eps, scale=self.scale, cos_sin_cache=self.cos_sin_cache,
        )

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run the batch, writing its K/V into kv_cache; returns the logits [len(logits_indices),
        vocab] for the tokens at logits_indices, in the model's dtype (the sampler widens them
        to float32 where it needs to: a greedy argmax does not)."""
        return linear(self._final_hidden(input_ids, meta, kv_cache, logits_indices), self.weights.lm_head)

    @property
    def has_greedy_head(self) -> bool:
        return self.weights.greedy_head is not None

    @torch.inference_mode()
    def forward_split(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
        logits_indices: torch.Tensor, greedy_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward, for a batch some of whose logits rows (greedy_rows: positions in
        logits_indices, ascending) only take their argmax (plain greedy): returns those rows'
        tokens, int64 [len(greedy_rows)], from the greedy head (the argmax of the logits forward
        would give; see kernels/greedy_head.py), and the logits of the other rows, in their
        order (None when there are none). Needs has_greedy_head."""
        hidden = self._final_hidden(input_ids, meta, kv_cache, logits_indices)
        if greedy_rows.shape[0] == hidden.shape[0]:
            return greedy_head_argmax(hidden, self.weights.greedy_head), None
        keep = torch.ones(hidden.shape[0], dtype=torch.bool)
        keep[greedy_rows] = False
        tokens = greedy_head_argmax(hidden[greedy_rows], self.weights.greedy_head)
        return tokens, linear(hidden[keep], self.weights.lm_head)

    def _final_hidden(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The layers and the final norm: the LM head's input for the rows at logits_indices."""
        hidden = self.weights.embed_tokens[input_ids]
        if meta.num_decode_tokens == hidden.shape[0] and self.decode_layers.takes(hidden, kv_cache):
            hidden, residual = self.decode_layers.run(
                hidden, meta.positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens, kv_cache,
            )
        elif meta.logits_seq_lens is not None and logits_indices.shape[0] < hidden.shape[0]:
            hidden, residual = self._layers(hidden, meta, kv_cache, last_layer_rows=logits_indices)
        else:
            hidden, residual = self._layers(hidden, meta, kv_cache)
            hidden = hidden[logits_indices]
            residual = residual[logits_indices]
        normed, _ = add_rms_norm(hidden, residual, self.weights.norm, self.config.rms_norm_eps)
        return normed

    def _layers(
        self, hidden: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
        last_layer_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers; returns (hidden, residual) of every token, or with
        last_layer_rows (the logits rows, meta's logits_* describing them) of those rows alone,
        in that order: the last layer then runs the rest on those only."""
        residual = None
        last = len(self.weights.layers) - 1
        for layer_idx, layer in enumerate(self.weights.layers):
            if residual is None:
                residual = hidden
                normed = rms_norm(hidden, layer.input_norm, self.config.rms_norm_eps)
            else:
                normed, residual = add_rms_norm(
                    hidden, residual, layer.input_norm, self.config.rms_norm_eps
                )
            if last_layer_rows is not None and layer_idx == last:
                return self._last_layer(layer, normed, residual, meta, kv_cache[:, layer_idx], last_layer_rows)
            hidden = self._attention(layer, normed, meta, kv_cache[:, layer_idx])
            normed, residual = add_rms_norm(hidden, residual, layer.post_norm, self.config.rms_norm_eps)
            hidden = linear(linear_silu_and_mul(normed, layer.gate_up), layer.down)
        return hidden, residual

    def _last_layer(
        self, layer: LayerWeights, x: torch.Tensor, residual: torch.Tensor, meta: AttentionMetadata,
        kv_cache_layer: torch.Tensor, logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer, where only the logits rows' outputs are read: K/V of every token (the
        cache needs them), the rest (attention, O, the MLP) for the logits rows alone. A prefill
        chunk's row attends like a decode of its sequence up to its own position, so the decode
        kernel serves them all. In a step of 2,048-token chunks this skips ~1/30 of `small`'s
        projection work."""
        query = self._qkv_to_cache(layer, x, meta, kv_cache_layer)[logits_indices]
        num_rows = query.shape[0]
        if num_rows:
            out = decode_attention(query, kv_cache_layer, meta.logits_block_tables, meta.logits_seq_lens, self.scale)
        else:
            out = query
        hidden = linear(out.reshape(num_rows, self._q_size), layer.o)
        normed, residual = add_rms_norm(
            hidden, residual[logits_indices], layer.post_norm, self.config.rms_norm_eps
        )
        return linear(linear_silu_and_mul(normed, layer.gate_up), layer.down), residual

    def _qkv_to_cache(
        self, layer: LayerWeights, x: torch.Tensor, meta: AttentionMetadata, kv_cache_layer: torch.Tensor,
    ) -> torch.Tensor:
        """Q, K and V of every token, rotated; K and V written to the cache. Returns Q
        [num_tokens, num_heads, head_dim]."""
        num_tokens = x.shape[0]
        cfg = self.config
        qkv = linear(x, layer.qkv)
        query, key, value = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
        query = query.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        key = key.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        value = value.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        apply_rotary(query, key, meta.positions, self.cos_sin_cache)
        write_kv(key, value, kv_cache_layer, meta.slot_mapping)
        return query

    def _attention(
        self, layer: LayerWeights, x: torch.Tensor, meta: AttentionMetadata,
        kv_cache_layer: torch.Tensor,
    ) -> torch.Tensor:
        query = self._qkv_to_cache(layer, x, meta, kv_cache_layer)
        out = self._paged_attention(query, meta, kv_cache_layer)
        return linear(out.reshape(x.shape[0], self._q_size), layer.o)

    def _paged_attention(
        self, query: torch.Tensor, meta: AttentionMetadata, kv_cache_layer: torch.Tensor
    ) -> torch.Tensor:
        num_decodes = meta.num_decode_tokens
        parts = []
        if num_decodes:
            parts.append(decode_attention(
                query[:num_decodes], kv_cache_layer, meta.decode_block_tables,
                meta.decode_seq_lens, self.scale,
            ))
        if num_decodes < query.shape[0]:
            parts.append(prefill_attention(
                query[num_decodes:], kv_cache_layer, meta.prefill_block_tables,
                meta.prefill_cu_query_lens, meta.prefill_seq_lens, self.scale,
            ))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
