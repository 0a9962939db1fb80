"""The engine's own failures that no request isolation can get past."""

from __future__ import annotations

# CUDA errors after which the device's context is unusable (every later call fails too), as the
# CUDA runtime words them; an out-of-memory error or a bad launch configuration is not one.
_STICKY_CUDA_ERRORS = ("illegal memory access", "device-side assert", "misaligned address", "illegal instruction",
                       "unspecified launch failure", "hardware stack error", "uncorrectable ECC error")


class EngineBroken(RuntimeError):
    """The engine cannot run another step: a tensor-parallel rank is gone, or its device failed.
    Its node fails every request it holds (to run elsewhere) and stops."""


def ends_the_engine(exc: BaseException) -> bool:
    """Whether exc leaves the engine unable to step again (no request is isolated from it)."""
    return isinstance(exc, EngineBroken) or device_failure(exc)


def device_failure(exc: BaseException) -> bool:
    """Whether exc is the accelerator's own failure (an illegal address, a device-side assert...:
    the context is lost), not one batch's."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and "CUDA error" in text and any(s in text for s in _STICKY_CUDA_ERRORS)
