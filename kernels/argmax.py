"""Row-wise argmax over the vocabulary (greedy sampling): a compiled C kernel for float32 and
bfloat16 CPU rows (csrc/argmax.c), torch.argmax elsewhere. Same answer as torch.argmax, ties and NaN
included: the first index of the maximum, or of the first NaN."""

from __future__ import annotations

import ctypes

import torch

from kernels._cpu import cpu_function, row_kernel_suffix


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, cols] -> int64 [rows], torch.argmax(x, dim=-1)."""
    if x.dim() != 2:
        raise ValueError(f"argmax_rows: x must be [rows, cols], got {tuple(x.shape)}")
    rows, cols = x.shape
    suffix = row_kernel_suffix(x)
    if cols == 0 or suffix is None:
        return x.argmax(dim=-1)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    kernel = cpu_function("argmax", f"argmax_rows_{suffix}", (ptr, i64, i64, i64, ptr))
    if kernel is None:
        return x.argmax(dim=-1)
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        kernel(x.data_ptr(), x.stride(0), rows, cols, out.data_ptr())
    return out
