"""The one place a compute backend is chosen: once per engine, from the device and the CPU's features,
or as the operator names it (--kernel-backend). Importing it loads no torch."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kernels.interface import Backend

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "cpu", "triton", "reference")


def select_backend(device: str, name: str = "auto", *, cpu_level: str | None = None) -> Backend:
    """The backend for device ("cpu", "cuda", "cuda:1", ...): name "auto" takes Triton on CUDA and the
    compiled CPU kernels on the CPU; "cpu", "triton" or "reference" force one. cpu_level picks the
    compiled CPU kernels' instruction-set level (None: the best this CPU runs; tests use it to run
    each level the machine has). Raises ValueError for an unknown name or one the device cannot run."""
    if name not in BACKENDS:
        raise ValueError(f"kernel backend {name!r} is not one of {', '.join(BACKENDS)}")
    is_cuda = device.startswith("cuda")
    if name == "auto":
        name = "triton" if is_cuda else "cpu"
    if name == "reference":
        from kernels.reference.backend import ReferenceBackend

        backend = ReferenceBackend(device)
    elif name == "triton":
        if not is_cuda:
            raise ValueError(f"kernel backend 'triton' runs on CUDA devices, not {device!r}")
        from kernels.triton.backend import TritonBackend

        backend = TritonBackend(device)
    else:
        if is_cuda:
            raise ValueError(f"kernel backend 'cpu' runs on the CPU, not {device!r}")
        from kernels.cpu import native
        from kernels.cpu.backend import CpuBackend

        backend = CpuBackend(device, native.load(cpu_level))
    logger.info("kernel backend: %s", backend.describe())
    return backend
