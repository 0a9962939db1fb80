"""The kernels' exceptions: a bad argument at a backend's boundary, and a compiled kernel's status."""

from __future__ import annotations


class KernelArgumentError(TypeError, ValueError):
    """An argument a kernel does not take (type, dtype, device, shape, or memory it would overrun)."""


class KernelError(RuntimeError):
    """A compiled kernel answered a status other than success."""

    meaning = "an unknown status"  # what the status says, in the message

    def __init__(self, entry: str, status: str) -> None:
        super().__init__(f"{entry}: {self.meaning} ({status})")
        self.entry = entry
        self.status = status


class KernelRangeError(KernelError, ValueError):
    """An index in the data (a position, slot or block id) outside what the caches hold."""

    meaning = "an index in the data (a position, slot or block id) is out of range"


class KernelMemoryError(KernelError, MemoryError):
    """A kernel's buffer could not be allocated."""

    meaning = "a buffer could not be allocated"


class KernelUnsupported(KernelError):
    """Sizes the kernel has no path for; the caller takes another."""

    meaning = "no path for these sizes"
