"""Dense projections, y = x @ W^T + b, on weights prepared once when the model loads.

Two CPU paths, picked per call by the number of rows (one core, small preset's shapes, timed
side by side; see the engine's note in engine/weights.py):
- BLAS on W^T stored [in, out], contiguous: the fastest for prefill-sized batches (oneDNN was
  2-6% slower at 512-1,024 rows) and on CUDA (cuBLAS).
- oneDNN on a copy of W prepacked into its blocked layout, for float32 batches of at most
  SMALL_BATCH rows (decode steps, the LM head): 1.04-1.06x BLAS at 32-256 rows, 1.4x at 8 rows,
  1.3-1.5x for the 49,152-row LM head at 8-64 rows.
Keeping both copies costs the projections' memory twice; a weight that only ever sees small
batches (the LM head) keeps only the packed copy, and a prefill-only engine keeps only BLAS's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SMALL_BATCH = 256


@dataclass(frozen=True)
class Linear:
    weight_t: torch.Tensor | None  # [in, out]: contiguous, or a transposed view; None: packed only
    packed: torch.Tensor | None  # oneDNN-prepacked [out, in] (CPU float32 only)
    bias: torch.Tensor | None  # [out]
    in_features: int
    out_features: int


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether weights like this one get a oneDNN-packed copy (CPU float32, oneDNN built in)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def prepare_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, *, small_batch_copy: bool = True,
                   large_batches: bool = True) -> Linear:
    """weight: [out, in]. small_batch_copy: also keep a oneDNN-packed copy for batches of up to
    SMALL_BATCH rows where can_prepack allows. large_batches=False (for a weight that only sees
    small batches) drops the BLAS copy when a packed one exists; W^T then stays a view."""
    if weight.dim() != 2 or (bias is not None and bias.shape != weight.shape[:1]):
        bias_shape = None if bias is None else tuple(bias.shape)
        raise ValueError(f"prepare_linear: weight {tuple(weight.shape)}, bias {bias_shape}")
    packed = None
    if small_batch_copy and can_prepack(weight):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)
    if packed is not None and not large_batches:
        weight_t = None
    elif large_batches:
        weight_t = weight.t().contiguous()
    else:
        weight_t = weight.t()
    return Linear(weight_t, packed, bias, weight.shape[1], weight.shape[0])


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, w: Linear) -> torch.Tensor:
    """x: [rows, in] -> [rows, out] in x's dtype."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"linear: x {tuple(x.shape)} for a weight of {w.in_features} inputs")
    if w.packed is not None and (w.weight_t is None or x.shape[0] <= SMALL_BATCH):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w.packed, w.bias, "none", [], "")
    if w.bias is None:
        return x @ w.weight_t
    return torch.addmm(w.bias, x, w.weight_t)
