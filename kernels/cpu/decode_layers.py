"""The CPU backend's fused decode capability: a decode step's decoder layers in one call of the compiled
library (csrc/decode_layers.c), bfloat16 on AMX or AVX512-BF16 builds, float32 on AVX-512 ones. The
same kernels the model's layer loop calls, in its order, so the outputs are the same bits and only
the Python between the ops goes."""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu import ops
from kernels.cpu.linear import Linear, ProjectionKernels
from kernels.cpu.native import struct_type
from kernels.interface import LayerShape


class DecodeLayers:
    """The fused layer loop for one model's prepared layers. Build it with create(): None where the
    build, the dtype, the layers' copies or the sizes do not allow it."""

    def __init__(self, kernels: ProjectionKernels, layers: list, shape: LayerShape, cos_sin_cache: torch.Tensor,
                 linear_kind: int) -> None:
        self._lib = kernels.lib
        self._kernels = kernels
        self.dtype = cos_sin_cache.dtype
        self._shape = shape
        self._cos_sin = cos_sin_cache
        self._linear_kind = linear_kind
        layer_type = struct_type("pds_layer")
        self._layers = (layer_type * len(layers))(*[_layer_struct(layer_type, layer, self.dtype) for layer in layers])
        self._num_layers = len(layers)
        self._weights = layers  # what the layer structures point into
        self._bounds = ops.BoundsMemo()

    @classmethod
    def create(cls, kernels: ProjectionKernels, layers: list, shape: LayerShape,
               cos_sin_cache: torch.Tensor) -> DecodeLayers | None:
        lib = kernels.lib
        if lib is None or not lib.has("decode_layers") or not layers:
            return None
        dtype = cos_sin_cache.dtype
        projections = [p for layer in layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if not all(isinstance(p, Linear) for p in projections):
            return None
        kinds = lib.constants
        if dtype == torch.bfloat16 and all(p.amx is not None for p in projections):
            kind = kinds["PDS_LINEAR_AMX"]
        elif dtype == torch.bfloat16 and all(p.bf16 is not None for p in projections):
            kind = kinds["PDS_LINEAR_BF16_WIDE" if kernels.bf16_widens else "PDS_LINEAR_BF16"]
        elif dtype == torch.float32 and all(p.f32 is not None for p in projections):
            kind = kinds["PDS_LINEAR_F32"]
        else:
            return None
        norms = [n for layer in layers for n in (layer.input_norm, layer.post_norm)]
        if not all(n.dtype == dtype and n.device.type == "cpu" and n.is_contiguous() for n in norms):
            return None
        if cos_sin_cache.device.type != "cpu" or cos_sin_cache.stride(-1) != 1 or shape.num_heads % shape.num_kv_heads:
            return None
        return cls(kernels, layers, shape, cos_sin_cache, kind)

    def takes(self, hidden: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether this decode-only batch can run here."""
        block_size = kv_cache.shape[3]
        return (0 < hidden.shape[0] <= self._kernels.small_batch_rows and hidden.dtype == self.dtype
                and kv_cache.dtype == self.dtype and kv_cache.device.type == "cpu" and kv_cache.stride(-1) == 1
                and bool(self._lib.paged_decode_attention_takes(self._shape.num_heads, self._shape.head_dim,
                                                               block_size, int(self.dtype == torch.bfloat16))))

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor,
            kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the embeddings [rows, hidden] (overwritten); kv_cache: the whole cache [blocks,
        layers, 2, block_size, kv_heads, head_dim]. Returns (the last layer's output, the residual
        stream), as the layer loop leaves them. Raises ValueError for a position, slot, block id or
        length outside what the caches hold."""
        d = self._shape
        rows = hidden.shape[0]
        num_blocks, num_layers, _, block_size = kv_cache.shape[:4]
        if num_layers != self._num_layers:
            raise ValueError(f"decode_layers: a cache of {num_layers} layers for {self._num_layers}")
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        ops.check_bounds(tables, lens, num_blocks, block_size, self._bounds)
        if tables.shape[0] != rows or lens.shape[0] != rows or positions.shape[0] != rows:
            raise ValueError(f"decode_layers: {rows} rows, tables {tuple(tables.shape)}, lens {tuple(lens.shape)}")
        positions = positions.to(torch.int64).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        hidden = hidden.contiguous()
        q_size, kv_size = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        widths = dict(residual=d.hidden, normed=d.hidden, o_out=d.hidden, qkv=q_size + 2 * kv_size, attn=q_size,
                      gate_up=2 * d.intermediate, act=d.intermediate)
        buffers = {name: torch.empty(rows, width, dtype=self.dtype) for name, width in widths.items()}
        stride = kv_cache.stride()
        step = struct_type("pds_step")(
            self.dtype.itemsize, rows, d.hidden, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate,
            d.eps, d.scale, kv_cache.data_ptr(), stride[1], stride[0], stride[2], stride[3], stride[4],
            num_blocks, block_size, positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.stride(0),
            lens.data_ptr(), self._cos_sin.data_ptr(), self._cos_sin.stride(0), self._cos_sin.shape[0],
            hidden.data_ptr(), *[buffers[name].data_ptr() for name in
                                 ("residual", "normed", "qkv", "attn", "o_out", "gate_up", "act")],
        )
        self._lib.decode_layers(self._linear_kind, self._layers, self._num_layers, step)
        return hidden, buffers["residual"]


def _layer_struct(layer_type: type[ctypes.Structure], layer, dtype: torch.dtype) -> ctypes.Structure:
    """The layer's pointers: the bfloat16 kernels' copies (AMX or AVX512-BF16) with the float32
    biases made for them, or the float32 kernel's copies with the biases as loaded."""
    projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
    if dtype == torch.bfloat16:
        weights = [(p.amx if p.amx is not None else p.bf16).data_ptr() for p in projections]
        biases = [p.bias_f32.data_ptr() if p.bias_f32 is not None else None for p in projections]
    else:
        weights = [p.f32.data_ptr() for p in projections]
        biases = [p.bias.data_ptr() if p.bias is not None else None for p in projections]
    return layer_type(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), *weights, *biases)
