"""A decode step's decoder layers in one C call (csrc/decode_layers.c): bfloat16 where the CPU
has AMX or AVX512-BF16, float32 where it has AVX-512 (the projections' small-batch kernels). The kernels the
Python layer loop calls, in its order, on buffers allocated once per step, so the outputs are
the same bits and only the Python between the ops goes.

Measured on a 2-core Xeon (AMX), bfloat16 SmolLM-135M shape, 64 sequences of ~300 tokens: the
ops between the projections and attention took ~9 ms of a ~51 ms step inside the Python loop
(see csrc/decode_layers.c); README "pdserve vs vLLM" has the end-to-end figures.
"""

from __future__ import annotations

import ctypes

import torch

from kernels._cpu import load_library
from kernels.decode_attention import (
    CPU_BF16_HEAD_DIMS,
    CPU_MAX_BLOCK_SIZE,
    CPU_MAX_HEAD_DIM,
    CPU_MAX_HEADS,
    check_bounds,
)
from kernels.linear import AMX_MAX_ROWS, Linear, bf16_kernel_name

_PTR, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _PTR) for name in ("linear", "add_rms_norm", "silu_and_mul", "rotary", "write_kv", "attention")]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _PTR) for name in ("input_norm", "post_norm", "qkv", "o", "gate_up", "down",
                                          "qkv_bias", "o_bias", "gate_up_bias", "down_bias")]


class _Step(ctypes.Structure):
    _fields_ = [
        *[(name, _I64) for name in ("elem_size", "rows", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                    "intermediate")],
        ("eps", _F32), ("scale", _F32),
        ("kv_cache", _PTR),
        *[(name, _I64) for name in ("stride_layer", "stride_block", "stride_kv", "stride_token", "stride_head",
                                    "num_blocks", "block_size")],
        ("positions", _PTR), ("slots", _PTR), ("block_tables", _PTR), ("stride_table", _I64), ("seq_lens", _PTR),
        ("cos_sin", _PTR), ("stride_cs", _I64), ("max_position", _I64),
        *[(name, _PTR) for name in ("hidden_buf", "residual", "normed", "qkv", "attn", "o_out", "gate_up", "act")],
    ]


# Return codes of decode_layers.
_BAD_POSITION, _BAD_SLOT, _NO_ATTENTION_PATH, _NO_MEMORY = 1, 2, 3, 4


def _address(library: str, name: str) -> int | None:
    lib = load_library(library)
    return None if lib is None else ctypes.cast(getattr(lib, name), _PTR).value


class DecodeLayers:
    """The fused layer loop for one model, or unavailable (`available` False: another dtype or
    device, a projection without its small-batch copy, sizes the attention kernel has no path
    for, or a kernel library that did not build); the model then keeps its Python loop."""

    def __init__(self, layers: list, *, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                 hidden: int, eps: float, scale: float, cos_sin_cache: torch.Tensor) -> None:
        self.available = False
        self.dtype = cos_sin_cache.dtype
        projections = [p for layer in layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        norms = [n for layer in layers for n in (layer.input_norm, layer.post_norm)]
        if not layers or not all(isinstance(p, Linear) for p in projections):
            return
        if self.dtype == torch.bfloat16 and all(p.amx is not None for p in projections):
            linear_address, suffix = _address("amx_linear", "amx_linear_bf16"), "bf16"
        elif self.dtype == torch.bfloat16 and all(p.bf16 is not None for p in projections):
            linear_address, suffix = _address("bf16_linear", bf16_kernel_name()), "bf16"
        elif self.dtype == torch.float32 and all(p.f32 is not None for p in projections):
            linear_address, suffix = _address("f32_linear", "f32_linear"), "f32"
        else:
            return
        if not all(n.dtype == self.dtype and n.device.type == "cpu" and n.is_contiguous() for n in norms):
            return
        if cos_sin_cache.device.type != "cpu" or cos_sin_cache.stride(-1) != 1:
            return
        if num_heads > CPU_MAX_HEADS or num_heads % num_kv_heads or head_dim > CPU_MAX_HEAD_DIM:
            return
        if self.dtype == torch.bfloat16 and head_dim not in CPU_BF16_HEAD_DIMS:
            return
        addresses = [linear_address, _address("elementwise", f"add_rms_norm_{suffix}"),
                     _address("elementwise", f"silu_and_mul_{suffix}"), _address("rotary_kv", f"rotary_{suffix}"),
                     _address("rotary_kv", f"write_kv_{suffix}"), _address("paged_attention", "paged_decode_attention")]
        library = load_library("decode_layers")
        if library is None or None in addresses:
            return
        self._run = library.decode_layers
        self._run.argtypes = [ctypes.POINTER(_Kernels), ctypes.POINTER(_Layer), _I64, ctypes.POINTER(_Step)]
        self._run.restype = ctypes.c_int
        self._kernels = _Kernels(*addresses)
        self._layers = (_Layer * len(layers))(*[_layer_struct(layer, suffix) for layer in layers])
        self._num_layers = len(layers)
        self._weights = layers  # what the layer structures point into
        self._dims = dict(hidden=hidden, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          intermediate=intermediate)
        self._eps, self._scale = eps, scale
        self._cos_sin = cos_sin_cache
        self.available = True

    def takes(self, hidden: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether this batch (decode tokens only, the caller's to know) can run here."""
        return (self.available and 0 < hidden.shape[0] <= AMX_MAX_ROWS and hidden.dtype == self.dtype
                and kv_cache.dtype == self.dtype and kv_cache.device.type == "cpu" and kv_cache.stride(-1) == 1
                and kv_cache.shape[3] <= CPU_MAX_BLOCK_SIZE)

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor,
            kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the embeddings [rows, hidden] (overwritten); kv_cache: the whole cache
        [blocks, layers, 2, block_size, kv_heads, head_dim]. Returns (the last layer's output,
        the residual stream), as the Python loop leaves them. Raises ValueError for a position,
        slot, block id or length outside what the caches hold."""
        d = self._dims
        rows = hidden.shape[0]
        num_blocks, _, _, block_size = kv_cache.shape[:4]
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        check_bounds(tables, lens, num_blocks, block_size)
        positions = positions.to(torch.int64).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        hidden = hidden.contiguous()
        q_size, kv_size = d["num_heads"] * d["head_dim"], d["num_kv_heads"] * d["head_dim"]

        def buffer(width: int) -> torch.Tensor:
            return torch.empty(rows, width, dtype=self.dtype)

        residual, normed, o_out = buffer(d["hidden"]), buffer(d["hidden"]), buffer(d["hidden"])
        qkv, attn = buffer(q_size + 2 * kv_size), buffer(q_size)
        gate_up, act = buffer(2 * d["intermediate"]), buffer(d["intermediate"])
        stride = kv_cache.stride()
        step = _Step(
            self.dtype.itemsize, rows, d["hidden"], d["num_heads"], d["num_kv_heads"], d["head_dim"], d["intermediate"],
            self._eps, self._scale, kv_cache.data_ptr(), stride[1], stride[0], stride[2], stride[3], stride[4],
            num_blocks, block_size, positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.stride(0),
            lens.data_ptr(), self._cos_sin.data_ptr(), self._cos_sin.stride(0), self._cos_sin.shape[0],
            hidden.data_ptr(), residual.data_ptr(), normed.data_ptr(), qkv.data_ptr(), attn.data_ptr(),
            o_out.data_ptr(), gate_up.data_ptr(), act.data_ptr(),
        )
        status = self._run(ctypes.byref(self._kernels), self._layers, self._num_layers, ctypes.byref(step))
        if status == _BAD_POSITION:
            raise ValueError(f"apply_rotary: a position outside the cache's {self._cos_sin.shape[0]}")
        if status == _BAD_SLOT:
            raise ValueError(f"write_kv: a slot outside the cache's {num_blocks} x {block_size}")
        if status == _NO_MEMORY:
            raise MemoryError("linear: the AMX kernel could not allocate its buffer")
        if status != 0:
            raise RuntimeError(f"decode_layers: the attention kernel refused checked sizes (status {status})")
        return hidden, residual


def _layer_struct(layer, suffix: str) -> _Layer:
    """The layer's pointers for the bfloat16 (AMX or AVX512-BF16 copies, float32 biases made for
    them) or the float32 kernels (their copies, the biases as loaded)."""
    projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
    if suffix == "bf16":
        weights = [(p.amx if p.amx is not None else p.bf16).data_ptr() for p in projections]
        biases = [p.bias_f32.data_ptr() if p.bias_f32 is not None else None for p in projections]
    else:
        weights = [p.f32.data_ptr() for p in projections]
        biases = [p.bias.data_ptr() if p.bias is not None else None for p in projections]
    return _Layer(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), *weights, *biases)
