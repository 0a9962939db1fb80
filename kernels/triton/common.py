"""What the Triton kernels share: the triton import (None on an install without it) and small helpers."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # NOTE: a CPU-only install may lack triton; the other backends still work
    triton = None
    tl = None


def cdiv(numerator: int, denominator: int) -> int:
    """Ceil division, for grids and block counts."""
    return -(-numerator // denominator)


LOG2E = 1.4426950408889634  # attention kernels use exp2: e^x = 2^(x log2 e)


def dot_in_fp32(tensor: torch.Tensor) -> bool:
    """Whether the attention kernels' dot products run in float32: for float32 inputs, and for
    CPU tensors (Triton's interpreter emulates half-precision dots incorrectly); half precision
    on CUDA uses the tensor cores."""
    return tensor.dtype == torch.float32 or not tensor.is_cuda
