"""RMSNorm, alone and with the residual add fused in: Triton on CUDA, a compiled kernel on the
CPU (float32, bfloat16), the torch reference elsewhere.

The reference follows transformers' LlamaRMSNorm exactly: normalize in float32, cast back to
the input dtype, then scale by the weight.
"""

from __future__ import annotations

import ctypes

import torch

from kernels._cpu import cpu_function, row_kernel_suffix
from kernels._triton import tl, triton, use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, force_triton: bool = False) -> torch.Tensor:
    """x: [num_tokens, hidden], weight: [hidden] -> [num_tokens, hidden] in x.dtype."""
    _check(x, weight)
    if not use_triton(x, force_triton):
        out = _rms_norm_cpu(x, None, weight, eps)
        return rms_norm_ref(x, weight, eps) if out is None else out[0]
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, force_triton: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the inputs are not modified."""
    _check(x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    if not use_triton(x, force_triton):
        out = _rms_norm_cpu(x, residual, weight, eps)
        return add_rms_norm_ref(x, residual, weight, eps) if out is None else out
    return _launch(x, residual, weight, eps)


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_CPU_SIGNATURE = (_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, ctypes.c_float)


def _rms_norm_cpu(x, residual, weight, eps):
    """The compiled CPU kernel (one pass per row) for float32 or bfloat16 CPU rows; None where
    it does not apply (then the reference runs). Returns (out, new_residual)."""
    tensors = (x, weight.view(1, -1)) + ((residual,) if residual is not None else ())
    suffix = row_kernel_suffix(*tensors)
    if suffix is None or not weight.is_contiguous():
        return None
    kernel = cpu_function("elementwise", f"add_rms_norm_{suffix}", _CPU_SIGNATURE)
    if kernel is None:
        return None
    num_rows, hidden = x.shape
    out = torch.empty(num_rows, hidden, dtype=x.dtype)
    new_residual = torch.empty(num_rows, hidden, dtype=x.dtype) if residual is not None else x
    kernel(x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
           residual.stride(0) if residual is not None else 0, weight.data_ptr(), out.data_ptr(), out.stride(0),
           new_residual.data_ptr(), new_residual.stride(0), num_rows, hidden, eps)
    return out, new_residual


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")


def _launch(x, residual, weight, eps):
    x = x.contiguous()
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else out
    if num_tokens:
        residual_in = residual.contiguous() if residual is not None else x
        _rms_norm_kernel[(num_tokens,)](
            x, residual_in, weight, out, new_residual, hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
        )
    return out, new_residual


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, hidden, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < hidden
        x = tl.load(x_ptr + row * hidden + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            # Add in float32 and round once: what torch's half-precision add does.
            residual = tl.load(residual_ptr + row * hidden + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
            tl.store(new_residual_ptr + row * hidden + offs, x, mask=mask)
        xf = x.to(tl.float32)
        variance = tl.sum(xf * xf, axis=0) / hidden
        normed = (xf * tl.rsqrt(variance + eps)).to(x.dtype)
        weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # Multiply in float32 and round once (torch rounds its half-precision product the same way).
        result = (normed.to(tl.float32) * weight).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * hidden + offs, result, mask=mask)
