"""The reference backend: every op in plain torch (kernels/reference/ops.py) on any device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.interface import Backend
from kernels.reference import ops


@dataclass(frozen=True)
class TorchLinear:
    """A projection for BLAS: W^T [in, out], contiguous (stored transposed), or a transposed view of
    W [out, in] contiguous (as the checkpoint has it, F.linear's form; and with copy=False)."""

    weight_t: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int


def prepare_torch_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, *, copy: bool = True,
                         transposed: bool = True) -> TorchLinear:
    """weight [out, in] for x @ W^T: with copy, a copy of its own, stored transposed (W^T
    contiguous: MKL's fastest form) or as it is (W contiguous, used through a transposed view:
    cuBLAS's TN GEMM, as F.linear); without copy, a transposed view of weight itself."""
    if weight.dim() != 2 or (bias is not None and bias.shape != weight.shape[:1]):
        bias_shape = None if bias is None else tuple(bias.shape)
        raise ValueError(f"prepare_linear: weight {tuple(weight.shape)}, bias {bias_shape}")
    if not copy:
        weight_t = weight.t()
    elif transposed:
        weight_t = weight.t().contiguous()
    else:
        weight_t = weight.clone(memory_format=torch.contiguous_format).t()  # its own storage: never a view of a shard
    return TorchLinear(weight_t, bias, weight.shape[1], weight.shape[0])


def torch_linear(x: torch.Tensor, w: TorchLinear) -> torch.Tensor:
    if w.bias is None:
        return x @ w.weight_t
    return torch.addmm(w.bias, x, w.weight_t)


class TorchProjections:
    """Projections on BLAS (x @ W^T), for the backends whose matmuls are torch's (reference, Triton).
    store_transposed: the form a weight is kept in (prepare_torch_linear)."""

    store_transposed = True

    def prepare_linear(self, weight, bias=None, *, copy=True, small_batches=True, gate_up=False):
        return prepare_torch_linear(weight, bias, copy=copy, transposed=self.store_transposed)

    def _linear(self, x, w):
        return torch_linear(x, w)


class ReferenceBackend(TorchProjections, Backend):
    name = "reference"

    def _silu_and_mul(self, x):
        return ops.silu_and_mul_ref(x)

    def _rms_norm(self, x, weight, eps):
        return ops.rms_norm_ref(x, weight, eps)

    def _add_rms_norm(self, x, residual, weight, eps):
        return ops.add_rms_norm_ref(x, residual, weight, eps)

    def _rotary_and_write_kv(self, query, key, value, positions, cos_sin_cache, kv_cache_layer, slot_mapping):
        ops.apply_rotary_ref(query, key, positions, cos_sin_cache)
        ops.write_kv_ref(key, value, kv_cache_layer, slot_mapping)

    def _decode_attention(self, query, kv_cache_layer, block_tables, seq_lens, scale):
        return ops.decode_attention_ref(query, kv_cache_layer, block_tables, seq_lens, scale)

    def _prefill_attention(self, query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale,
                           max_query_len):
        return ops.prefill_attention_ref(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale)

    def _argmax(self, x):
        return ops.argmax_ref(x)
