"""SiLU-and-mul (the gated MLP's activation): Triton kernel on CUDA, torch reference elsewhere."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kernels._cpu import cpu_function, row_kernel_suffix
from kernels._triton import tl, triton, use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] -> silu(x[:, :I]) * x[:, I:], [num_tokens, intermediate]."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def silu_and_mul(x: torch.Tensor, force_triton: bool = False) -> torch.Tensor:
    if x.dim() != 2 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: x must be [num_tokens, 2 * intermediate], got {tuple(x.shape)}")
    if not use_triton(x, force_triton):
        out = _silu_and_mul_cpu(x)
        return silu_and_mul_ref(x) if out is None else out
    num_tokens, width = x.shape
    half = width // 2
    out = torch.empty(num_tokens, half, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(half))
    grid = (num_tokens, triton.cdiv(half, block))
    _silu_and_mul_kernel[grid](x, out, half, x.stride(0), out.stride(0), BLOCK=block)
    return out


if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, half, stride_x_token, stride_out_token, BLOCK: tl.constexpr):
        token = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < half
        gate = tl.load(x_ptr + token * stride_x_token + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + token * stride_x_token + half + offs, mask=mask, other=0.0).to(tl.float32)
        result = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + token * stride_out_token + offs, result.to(out_ptr.dtype.element_ty), mask=mask)


def _silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor | None:
    """The compiled CPU kernel (one pass) for float32 or bfloat16 CPU rows; None where it does
    not apply."""
    suffix = row_kernel_suffix(x)
    if suffix is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    kernel = cpu_function("elementwise", f"silu_and_mul_{suffix}", (ptr, i64, ptr, i64, i64, i64))
    if kernel is None:
        return None
    num_rows, half = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, half, dtype=x.dtype)
    kernel(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), num_rows, half)
    return out
