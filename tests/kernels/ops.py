"""The ops as the kernel tests call them: the CPU backend (the compiled kernels of the best level this
machine runs and this install built, the reference for the rest), or with force_triton the Triton
backend's kernels on CPU tensors under TRITON_INTERPRET=1 (tests/kernels/conftest.py sets it)."""

from __future__ import annotations

from kernels.cpu.backend import CpuBackend
from kernels.cpu.native import load
from kernels.reference.ops import (  # noqa: F401 (re-exported for the tests)
    add_rms_norm_ref,
    apply_rotary_ref,
    decode_attention_ref,
    prefill_attention_ref,
    rms_norm_ref,
    rotary_cos_sin_cache,
    silu_and_mul_ref,
    write_kv_ref,
)
from kernels.triton import decode_attention as triton_decode
from kernels.triton import prefill_attention as triton_prefill
from kernels.triton.backend import TritonBackend

CPU = CpuBackend("cpu", load())
TRITON = TritonBackend("cpu")  # interpreted: Triton's kernels on CPU tensors


def _backend(force_triton: bool):
    return TRITON if force_triton else CPU


def silu_and_mul(x, force_triton=False):
    return _backend(force_triton).silu_and_mul(x)


def rms_norm(x, weight, eps, force_triton=False):
    return _backend(force_triton).rms_norm(x, weight, eps)


def add_rms_norm(x, residual, weight, eps, force_triton=False):
    return _backend(force_triton).add_rms_norm(x, residual, weight, eps)


def apply_rotary(query, key, positions, cos_sin_cache, force_triton=False):
    """The backends rotate and write K/V in one op; a scratch one-block cache takes the write."""
    import torch

    num_tokens, num_kv_heads, head_dim = key.shape
    scratch = torch.empty(1, 2, 1, num_kv_heads, head_dim, dtype=key.dtype, device=key.device)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=key.device)
    _backend(force_triton).rotary_and_write_kv(query, key, key, positions, cos_sin_cache, scratch, slots)


def write_kv(key, value, kv_cache_layer, slot_mapping, force_triton=False):
    """The write alone: the rotary half runs on copies that are dropped."""
    import torch

    positions = torch.zeros(key.shape[0], dtype=torch.int64, device=key.device)
    table = torch.zeros(1, key.shape[-1], dtype=key.dtype, device=key.device)
    table[:, : key.shape[-1] // 2] = 1.0  # cos 1, sin 0: the rotation is the identity
    query = key.new_zeros(key.shape[0], 1, key.shape[-1])  # dropped; garbage times sin 0 can make NaN
    _backend(force_triton).rotary_and_write_kv(query, key.clone(), value, positions, table, kv_cache_layer,
                                                slot_mapping)


def decode_attention(query, kv_cache_layer, block_tables, seq_lens, scale, force_triton=False, num_splits=None):
    if force_triton and num_splits is not None:
        TRITON.decode_attention(query[:0], kv_cache_layer, block_tables[:0], seq_lens[:0], scale)  # the checks
        return triton_decode.decode_attention(query, kv_cache_layer, block_tables, seq_lens, scale, num_splits)
    return _backend(force_triton).decode_attention(query, kv_cache_layer, block_tables, seq_lens, scale)


def prefill_attention(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale, force_triton=False,
                      max_query_len=None):
    if force_triton and max_query_len is not None:
        return triton_prefill.prefill_attention(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens, scale,
                                                max_query_len)
    return _backend(force_triton).prefill_attention(query, kv_cache_layer, block_tables, cu_query_lens, seq_lens,
                                                    scale)


def decode_attention_cpu(query, kv_cache_layer, block_tables, seq_lens, scale):
    """The compiled decode attention alone: None where it has no path (then the backend runs the
    reference)."""
    from kernels.cpu import ops as cpu_ops

    return cpu_ops.decode_attention(CPU.lib, query, kv_cache_layer, block_tables, seq_lens, scale, _MEMO)


def _memo():
    from kernels.cpu.ops import BoundsMemo

    return BoundsMemo()


_MEMO = _memo()  # one memo for these tests' calls, as a backend keeps one
