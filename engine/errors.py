"""The engine's own failures that no request isolation can get past."""

from __future__ import annotations

import torch


class EngineBroken(RuntimeError):
    """The engine cannot run another step: a tensor-parallel rank is gone, or its device failed
    (a CUDA error leaves the device's context unusable). Its node fails every request it holds (to
    run elsewhere) and stops."""


def device_failure(exc: BaseException) -> bool:
    """Whether exc is the accelerator's own failure (an illegal address, a device-side assert: every
    later call fails too), not one request's: torch.AcceleratorError, or a RuntimeError naming a CUDA
    error. An out-of-memory error is not one (the step's requests can run again alone)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)
