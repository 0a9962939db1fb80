"""The Triton backend: every op a Triton kernel, projections on cuBLAS (W^T, or W as stored where
PDSERVE_TRITON_WEIGHTS=as-stored), for CUDA GPUs."""

from __future__ import annotations

import os

from kernels.interface import Backend
from kernels.reference.backend import TorchProjections
from kernels.triton import elementwise
from kernels.triton.common import triton
from kernels.triton.decode_attention import decode_attention
from kernels.triton.decode_layers import SmallBatchLayers
from kernels.triton.prefill_attention import prefill_attention
from kernels.triton.small_linear import SMALL_ROWS

FUSED_DECODE_ENV = "PDSERVE_TRITON_FUSED_DECODE"
# The largest decode batch the fused layers take (1 to small_linear.SMALL_ROWS, the default); larger
# batches run the layer loop.
FUSED_MAX_ROWS_ENV = "PDSERVE_TRITON_FUSED_DECODE_MAX_ROWS"
# The form each projection's weight is kept in: "transposed" (W^T, the default) or "as-stored" (W as the
# checkpoint has it, F.linear's form; the fused decode layers then run rotary inside the QKV projection).
WEIGHTS_ENV = "PDSERVE_TRITON_WEIGHTS"
WEIGHT_FORMS = ("transposed", "as-stored")


def available() -> bool:
    return triton is not None


class TritonBackend(TorchProjections, Backend):
    name = "triton"
    graph_capturable = True

    def __init__(self, device: str) -> None:
        if triton is None:
            raise RuntimeError("the triton backend needs the triton package, which is not installed")
        super().__init__(device)
        self.store_transposed = _weight_form() == "transposed"

    def describe(self) -> str:
        form = "" if self.store_transposed else f", weights as stored ({WEIGHTS_ENV}=as-stored)"
        fused = (f", fused small-batch decode up to {_fused_max_rows()} rows ({FUSED_DECODE_ENV}=1)"
                 if _fused_decode_on() else "")
        return super().describe() + form + fused

    def fused_decode(self, layers, shape, cos_sin_cache):
        """Decode batches of at most FUSED_MAX_ROWS_ENV (default small_linear.SMALL_ROWS) sequences on the
        fused layers (kernels/triton/decode_layers.py: five or six launches a layer instead of ten, the
        projections on Triton instead of cuBLAS) where FUSED_DECODE_ENV is 1. Off by default until a GPU
        run shows it faster (gpu_engine's decode_fused phase times it beside the default)."""
        if not _fused_decode_on():
            return None
        return SmallBatchLayers.create(layers, shape, cos_sin_cache, max_rows=_fused_max_rows())

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


def _fused_decode_on() -> bool:
    return os.environ.get(FUSED_DECODE_ENV, "0") == "1"


def _fused_max_rows() -> int:
    value = os.environ.get(FUSED_MAX_ROWS_ENV, str(SMALL_ROWS))
    if not value.isdigit() or not 1 <= int(value) <= SMALL_ROWS:
        raise ValueError(f"{FUSED_MAX_ROWS_ENV} must be a whole number from 1 to {SMALL_ROWS}, got {value!r}")
    return int(value)


def _weight_form() -> str:
    form = os.environ.get(WEIGHTS_ENV, WEIGHT_FORMS[0])
    if form not in WEIGHT_FORMS:
        raise ValueError(f"{WEIGHTS_ENV} must be one of {', '.join(WEIGHT_FORMS)}, got {form!r}")
    return form
