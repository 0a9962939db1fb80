"""The CPU backend: oneDNN projections and the compiled kernels of the best instruction-set level this
CPU runs (kernels/cpu/native.py), the reference for whatever a kernel does not take (another dtype, a
stride, sizes without a path), so an AVX2-only CPU gets the kernels its build has and the reference
for the rest."""

from __future__ import annotations

from kernels.cpu import greedy_head, ops
from kernels.cpu.decode_layers import DecodeLayers
from kernels.cpu.linear import ProjectionKernels
from kernels.cpu.native import NativeLibrary
from kernels.interface import Backend
from kernels.reference import ops as ref


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, device: str = "cpu", lib: NativeLibrary | None = None) -> None:
        super().__init__(device)
        self.lib = lib
        self.projections = ProjectionKernels(lib)
        self._bounds = ops.BoundsMemo()

    def describe(self) -> str:
        if self.lib is None:
            return "cpu (oneDNN and the torch reference: no compiled kernels for this CPU)"
        found = self.projections.capabilities() + [c for c, has in self._capabilities().items() if has]
        return f"cpu ({self.lib.level.name} kernels: {', '.join(found) or 'row ops and decode attention'})"

    def _capabilities(self) -> dict[str, bool]:
        lib = self.lib
        return {"greedy_head": lib is not None and greedy_head.available(self.projections),
                "fused_decode": lib is not None and lib.has("decode_layers")}

    @property
    def capabilities(self) -> frozenset[str]:
        """What this build runs beyond the row ops: the projection kernels, greedy_head, fused_decode."""
        return frozenset(self.projections.capabilities()) | {c for c, has in self._capabilities().items() if has}

    # ---- weights and capabilities ----

    def prepare_linear(self, weight, bias=None, *, copy=True, small_batches=True, gate_up=False):
        return self.projections.prepare(weight, bias, copy=copy, small_batches=small_batches, gate_up=gate_up)

    def prepare_greedy_head(self, weight, head):
        return greedy_head.prepare_greedy_head(self.projections, weight, head)

    def greedy_argmax(self, x, head, candidates=None):
        return greedy_head.greedy_head_argmax(self.projections, x, head, self.argmax, candidates)

    def fused_decode(self, layers, shape, cos_sin_cache):
        return DecodeLayers.create(self.projections, layers, shape, cos_sin_cache)

    # ---- ops ----

    def _linear(self, x, w):
        return self.projections.linear(x, w)

    def _gate_up_silu(self, x, w):
        return self.projections.gate_up_silu(x, w, self._silu_and_mul)

    def _silu_and_mul(self, x):
        out = ops.silu_and_mul(self.lib, x) if self.lib else None
        return ref.silu_and_mul_ref(x) if out is None else out

    def _rms_norm(self, x, weight, eps):
        out = ops.add_rms_norm(self.lib, x, None, weight, eps) if self.lib else None
        return ref.rms_norm_ref(x, weight, eps) if out is None else out[0]

    def _add_rms_norm(self, x, residual, weight, eps):
        out = ops.add_rms_norm(self.lib, x, residual, weight, eps) if self.lib else None
        return ref.add_rms_norm_ref(x, residual, weight, eps) if out is None else out

    def _rotary_and_write_kv(self, query, key, value, positions, cos_sin_cache, kv_cache_layer, slot_mapping):
        if not (self.lib and ops.apply_rotary(self.lib, query, key, positions, cos_sin_cache)):
            ref.apply_rotary_ref(query, key, positions, cos_sin_cache)
        if not (self.lib and ops.write_kv(self.lib, key, value, kv_cache_layer, slot_mapping)):
            ref.write_kv_ref(key, value, kv_cache_layer, slot_mapping)

    def _decode_attention(self, query, kv_cache_layer, block_tables, seq_lens, scale):
        out = None
        if self.lib:
            out = ops.decode_attention(self.lib, query, kv_cache_layer, block_tables, seq_lens, scale, self._bounds)
        if out is None:
            return ref.decode_attention_ref(query, kv_cache_layer, block_tables, seq_lens, scale)
        return out

    def _prefill_attention(self, query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale,
                           max_query_len):
        out = None
        if self.lib:
            out = ops.prefill_attention(self.lib, query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale)
        if out is None:
            return ref.prefill_attention_ref(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale)
        return out

    def _argmax(self, x):
        out = ops.argmax_rows(self.lib, x) if self.lib else None
        return ref.argmax_ref(x) if out is None else out
