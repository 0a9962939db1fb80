"""Greedy LM head: the argmax of x W^T per row, the token the full head's logits give, from an int8
screen with error bounds and the exact logits of the few outputs it cannot rule out (csrc/greedy_head.c
says how, and why the answer is the same). Where the build has AVX512-BF16 and AVX512-VNNI, float32
and bfloat16 heads: the candidates' logits are summed as the head's own kernel sums them
(f32_linear.c; bf16_linear.c), so the token equals the argmax of that kernel's logits bit for bit,
ties included. bfloat16 heads on AMX get none (their logits come from AMX, cheaper than a screen).
benchmarks/kernels.py --cpu measures it against the logits and their argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu.linear import Linear, ProjectionKernels


@dataclass(frozen=True)
class GreedyHead:
    q8: torch.Tensor  # int8 W in panels of 48 outputs x 4 inputs (pack_int8_quads)
    scale: torch.Tensor  # float32 [outputs padded to panels]: s_v = max |w_v| / 127
    qsum: torch.Tensor  # int32: sum_i q_vi
    e_norm: torch.Tensor  # float32: |w_v - s_v q_v|, rounded up
    w_norm: torch.Tensor  # |w_v|, rounded up
    weight: torch.Tensor  # W [n, k] in the head's dtype, contiguous: the candidates' exact logits
    linear: Linear  # the head itself: its own panels (the picked pairs) and the rows the screen leaves

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def panels(self) -> torch.Tensor:
        return _own_panels(self.linear, self.dtype)


def _own_panels(head: Linear, dtype: torch.dtype) -> torch.Tensor | None:
    """The head's small-batch panels in its dtype (linear's bf16 or f32 copy), which the screen
    reads the picked pairs' weights from; None where it has none."""
    return head.bf16 if dtype == torch.bfloat16 else head.f32


def available(kernels: ProjectionKernels) -> bool:
    """Whether this build runs the screen (AVX512-BF16 and AVX512-VNNI, ready on this CPU)."""
    lib = kernels.lib
    return (lib is not None and lib.has("greedy_head_int8") and bool(lib.greedy_head_ready())
            and lib.has("bf16_linear_chunk"))


def _rounded_up(values: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, each at least its float64 value."""
    as_f32 = values.float()
    return torch.where(as_f32.double() < values, torch.nextafter(as_f32, torch.tensor(float("inf"))), as_f32)


def pack_int8_quads(q: torch.Tensor, panel: int) -> torch.Tensor:
    """int8 q [out, in] in the int8 screen's layout: per panel of outputs (out padded with zero
    rows to whole panels) and per 4 inputs (in padded with zero columns to a multiple of 4), the
    panel's outputs x 4 consecutive inputs."""
    out_features, in_features = q.shape
    quads = (in_features + 3) // 4
    padded = torch.zeros(-(-out_features // panel) * panel, 4 * quads, dtype=torch.int8)
    padded[:out_features, :in_features] = q
    return padded.view(-1, panel, quads, 4).permute(0, 2, 1, 3).contiguous()


# NOTE: bfloat16 heads of fewer outputs keep the logits path: the screen's costs per row do not
# shrink with the vocabulary, and such heads are cheap (benchmarks/kernels.py --cpu, greedy_head).
BF16_MIN_VOCAB = 8192


def prepare_greedy_head(kernels: ProjectionKernels, weight: torch.Tensor, head: Linear) -> GreedyHead | None:
    """weight: an LM head [vocab, hidden] on the CPU, float32 or bfloat16; head: it prepared with
    prepare_linear. None where the kernel is unavailable, hidden is odd or over 65,536, the head
    has no panels of the small-batch kernel for its dtype (bfloat16: a CPU with AMX; a prefill-only
    engine's), a bfloat16 head has fewer than BF16_MIN_VOCAB outputs, or W holds an inf or NaN."""
    if (weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2
            or weight.shape[1] % 2 or weight.shape[1] > 65536 or weight.numel() >= 1 << 31):
        return None
    n = weight.shape[0]
    if (_own_panels(head, weight.dtype) is None or not available(kernels)
            or (weight.dtype == torch.bfloat16 and n < BF16_MIN_VOCAB) or not bool(torch.isfinite(weight).all())):
        return None
    w = weight.double()
    scale = (weight.float().abs().amax(dim=1) / 127).float()
    s = scale.double()[:, None]
    q = torch.where(s > 0, torch.round(w / torch.where(s > 0, s, 1.0)), 0.0).clamp(-127, 127)
    padded = -(-n // kernels.panel) * kernels.panel

    def per_output(t: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        out = torch.zeros(padded, dtype=dtype)
        out[:n] = t
        return out

    return GreedyHead(
        q8=pack_int8_quads(q.to(torch.int8), kernels.panel), scale=per_output(scale),
        qsum=per_output(q.sum(dim=1), torch.int32),
        e_norm=per_output(_rounded_up((w - s * q).norm(dim=1) * (1 + 1e-12))),
        w_norm=per_output(_rounded_up(w.norm(dim=1) * (1 + 1e-12))), weight=weight.contiguous(), linear=head,
    )


def greedy_head_argmax(kernels: ProjectionKernels, x: torch.Tensor, head: GreedyHead, argmax,
                       candidates: torch.Tensor | None = None) -> torch.Tensor:
    """x: [rows, hidden] on the CPU in the head's dtype -> int64 [rows]: each row's argmax of the
    head's logits as its own kernel computes them (the first index of the maximum; of the first
    NaN where there is one). argmax: the backend's row argmax, for rows the screen leaves (an inf
    or NaN in x, or thousands of near-ties). candidates (int64 [rows], optional) receives how many
    logits each row computed exactly (the vocabulary's size for a row computed in full)."""
    if x.dim() != 2 or x.shape[1] != head.in_features or x.dtype != head.dtype or not x.is_cpu:
        raise ValueError(f"greedy_head_argmax: x {tuple(x.shape)} {x.dtype} on {x.device} for a {head.dtype} CPU "
                         f"head of {head.in_features} inputs")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0] == 0:
        return out
    lib = kernels.lib
    f32 = head.dtype == torch.float32
    chunk = 0 if f32 else lib.bf16_linear_chunk(x.shape[0], head.in_features)
    lib.greedy_head_int8(x, x.stride(0), x.shape[0], head.in_features, head.q8, head.scale, head.qsum, head.e_norm,
                         head.w_norm, head.panels, head.weight, head.out_features, chunk,
                         int(not f32 and kernels.bf16_widens), int(f32), out, candidates)
    left = (out < 0).nonzero().squeeze(1)
    if left.numel():
        out[left] = argmax(kernels.linear(x[left], head.linear))
    return out
