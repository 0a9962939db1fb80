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


def use_triton(tensor: torch.Tensor, force_triton: bool = False) -> bool:
    if triton is None:
        if force_triton:
            raise RuntimeError("force_triton=True but triton is not installed")
        return False
    return force_triton or tensor.is_cuda
