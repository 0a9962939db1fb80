"""The Triton backend's fused decode capability: a small decode batch's layers in five launches a layer
(six where the attention splits) instead of the layer loop's ten. The residual add and RMSNorm run
inside the QKV and the gate/up projections, SiLU(gate) * up inside the latter, and rotary with the
KV write inside the QKV projection where the weights are kept as stored (kernels/triton/
small_linear.py; transposed, the loop's rotary kernel runs after it: six launches); the attention is
the loop's own kernel."""

from __future__ import annotations

import torch

from kernels.interface import LayerShape
from kernels.reference.backend import TorchLinear
from kernels.triton.decode_attention import decode_attention
from kernels.triton.elementwise import rotary_and_write_kv
from kernels.triton.small_linear import SMALL_ROWS, qkv_rotary_fits, small_linear, small_qkv_rotary


class SmallBatchLayers:
    """The fused layer loop for one model's prepared layers, for decode batches of at most max_rows
    (at most SMALL_ROWS) sequences. Build it with create(): None where the layers' forms or dtypes do
    not allow it."""

    def __init__(self, layers: list, shape: LayerShape, cos_sin_cache: torch.Tensor,
                 max_rows: int = SMALL_ROWS) -> None:
        self._layers = layers
        self.max_rows = max_rows
        self._shape = shape
        self._cos_sin = cos_sin_cache
        self.dtype = cos_sin_cache.dtype
        self._q_size = shape.num_heads * shape.head_dim
        self._kv_size = shape.num_kv_heads * shape.head_dim
        # rotary and the KV write inside the QKV projection (every layer's weight kept as stored)
        self.rotary_in_qkv = all(qkv_rotary_fits(layer.qkv.weight_t, shape.head_dim) for layer in layers)

    @classmethod
    def create(cls, layers: list, shape: LayerShape, cos_sin_cache: torch.Tensor,
               max_rows: int = SMALL_ROWS) -> SmallBatchLayers | None:
        dtype = cos_sin_cache.dtype
        projections = [p for layer in layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if not layers or not all(_fits(p, dtype) for p in projections):
            return None
        norms = [n for layer in layers for n in (layer.input_norm, layer.post_norm)]
        if not all(n.dtype == dtype and n.is_contiguous() for n in norms) or shape.num_heads % shape.num_kv_heads:
            return None
        return cls(layers, shape, cos_sin_cache, max_rows)

    def takes(self, hidden: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether this decode-only batch can run here."""
        return 0 < hidden.shape[0] <= self.max_rows and hidden.dtype == self.dtype and kv_cache.dtype == self.dtype

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor,
            kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the embeddings [rows, hidden]; kv_cache: the whole cache [blocks, layers, 2,
        block_size, kv_heads, head_dim]. Returns (the last layer's output, the residual stream), as
        the layer loop leaves them."""
        d = self._shape
        rows = hidden.shape[0]
        residual = None
        for layer_idx, layer in enumerate(self._layers):
            kv_layer = kv_cache[:, layer_idx]
            if self.rotary_in_qkv:
                query, residual = small_qkv_rotary(
                    hidden, layer.qkv.weight_t, layer.qkv.bias, residual=residual, norm_weight=layer.input_norm,
                    eps=d.eps, positions=positions, cos_sin_cache=self._cos_sin, kv_cache_layer=kv_layer,
                    slot_mapping=slot_mapping, num_heads=d.num_heads, num_kv_heads=d.num_kv_heads)
            else:
                qkv, residual = small_linear(hidden, layer.qkv.weight_t, layer.qkv.bias, residual=residual,
                                             norm_weight=layer.input_norm, eps=d.eps)
                query, key, value = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
                query = query.reshape(rows, d.num_heads, d.head_dim)
                rotary_and_write_kv(query, key.reshape(rows, d.num_kv_heads, d.head_dim),
                                    value.reshape(rows, d.num_kv_heads, d.head_dim), positions, self._cos_sin,
                                    kv_layer, slot_mapping)
            attended = decode_attention(query, kv_layer, block_tables, seq_lens, d.scale)
            hidden, _ = small_linear(attended.reshape(rows, self._q_size), layer.o.weight_t, layer.o.bias)
            act, residual = small_linear(hidden, layer.gate_up.weight_t, layer.gate_up.bias, residual=residual,
                                         norm_weight=layer.post_norm, eps=d.eps, gated=True)
            hidden, _ = small_linear(act, layer.down.weight_t, layer.down.bias)
        return hidden, residual


def _fits(projection, dtype: torch.dtype) -> bool:
    """A projection small_linear reads: W^T in the model's dtype, contiguous along one dimension."""
    if not isinstance(projection, TorchLinear):
        return False
    weight_t = projection.weight_t
    return (weight_t.dtype == dtype and (weight_t.stride(0) == 1 or weight_t.stride(1) == 1)
            and (projection.bias is None or (projection.bias.dtype == dtype and projection.bias.is_contiguous())))
