"""Where Triton plugs in: the dispatch rule shared by every op module.

Triton kernels run on CUDA tensors; everything else takes the torch reference. Tests pass
force_triton=True to run a kernel on CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # NOTE: a CPU-only install may lack triton; the references still work
    triton = None
    tl = None


def cdiv(numerator: int, denominator: int) -> int:
    """Ceil division, for grids and block counts (kernels import nothing of ours, so the engine's
    engine.protocol.num_blocks_for is not reachable here)."""
    return -(-numerator // denominator)


LOG2E = 1.4426950408889634  # attention kernels use exp2: e^x = 2^(x log2 e)


def use_triton(tensor: torch.Tensor, force_triton: bool = False) -> bool:
    """True for CUDA tensors (and for any tensor when force_triton); raises RuntimeError when
    forced without triton installed."""
    if triton is None:
        if force_triton:
            raise RuntimeError("force_triton=True but triton is not installed")
        return False
    return force_triton or tensor.is_cuda


def dot_in_fp32(tensor: torch.Tensor) -> bool:
    """Whether the attention kernels' dot products run in float32: for float32 inputs, and for
    CPU tensors (Triton's interpreter emulates half-precision dots incorrectly); half precision
    on CUDA uses the tensor cores."""
    return tensor.dtype == torch.float32 or not tensor.is_cuda
