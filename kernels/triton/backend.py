"""The Triton backend: every op a Triton kernel, projections on cuBLAS (W^T), for CUDA GPUs."""

from __future__ import annotations

from kernels.interface import Backend
from kernels.reference.backend import TorchProjections
from kernels.triton import elementwise
from kernels.triton.common import triton
from kernels.triton.decode_attention import decode_attention
from kernels.triton.prefill_attention import prefill_attention


def available() -> bool:
    return triton is not None


class TritonBackend(TorchProjections, Backend):
    name = "triton"
    graph_capturable = True

    def __init__(self, device: str) -> None:
        if triton is None:
            raise RuntimeError("the triton backend needs the triton package, which is not installed")
        super().__init__(device)

    def _silu_and_mul(self, x):
        return elementwise.silu_and_mul(x)

    def _rms_norm(self, x, weight, eps):
        return elementwise.add_rms_norm(x, None, weight, eps)[0]

    def _add_rms_norm(self, x, residual, weight, eps):
        return elementwise.add_rms_norm(x, residual, weight, eps)

    def _rotary_and_write_kv(self, query, key, value, positions, cos_sin_cache, kv_cache_layer, slot_mapping):
        elementwise.rotary_and_write_kv(query, key, value, positions, cos_sin_cache, kv_cache_layer, slot_mapping)

    def _decode_attention(self, query, kv_cache_layer, block_tables, seq_lens, scale):
        return decode_attention(query, kv_cache_layer, block_tables, seq_lens, scale)

    def _prefill_attention(self, query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale,
                           max_query_len):
        return prefill_attention(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale, max_query_len)

    def _argmax(self, x):
        return x.argmax(dim=-1)
