"""Process-wide heap policy for running the model on the CPU, and huge pages for the KV cache.

glibc serves large allocations (every activation of a prefill chunk, every KV gather) with a
fresh mmap and returns them to the OS on free, so each step page-faults its working set in
again (the offline benchmark, benchmarks/offline_throughput.py, ran ~2x faster with mmap off and
trimming raised).

The heap itself goes onto transparent huge pages by a glibc tunable that only a process's start
reads: the node and `generate` commands restart themselves with it (pdserve/huge_heap.py, which
stays free of torch so that the command line can run it first).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import sys

import torch

logger = logging.getLogger(__name__)

# madvise's advice for transparent huge pages (Linux, asm-generic/mman-common.h).
_MADV_HUGEPAGE = 14
_HUGE_PAGE_BYTES = 2 << 20

# glibc's mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# NOTE: the largest value mallopt takes (an int); freed memory beyond this at the heap's top
# still goes back to the OS, so a one-off burst does not pin memory forever.
_TRIM_THRESHOLD_BYTES = 2**31 - 1


def keep_freed_memory() -> bool:
    """Serve every allocation from the heap and keep freed memory for reuse (no mmap per large
    tensor, no trimming below 2 GiB). Idempotent; the process's peak heap stays mapped. Returns
    False, changing nothing, where the C library is not glibc."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        logger.info("no glibc mallopt here; keeping the C library's heap policy")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    is_ok = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))
    if not is_ok:
        logger.warning("mallopt refused the heap settings; large tensors will page-fault each step")
    return is_ok


def zeroed_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of zeros on memory of its own (an anonymous mapping, which the kernel zeroes page
    by page on first touch): nothing is written up front, and its pages are faulted in when first
    written. Not committed up front either: memory is taken as it is touched.
    The mapping lives as long as the tensor."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, num_bytes), dtype=dtype).view(shape)


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """Ask Linux to back the 2 MiB-aligned interior of a CPU tensor's memory with transparent
    huge pages (madvise MADV_HUGEPAGE; it takes effect for pages not yet touched, so call it on a
    fresh torch.empty and fill afterwards). Returns the bytes advised: 0 where nothing was
    (another OS or device, a tensor under 2 MiB, a kernel without huge pages).

    The KV cache is read in scattered ~6-12 KB pieces (one per sequence, layer and block), and
    with 4 KiB pages nearly every piece is a TLB miss (offline bfloat16 ~7% faster with them,
    benchmarks/offline_throughput.py)."""
    if tensor.device.type != "cpu" or _libc_madvise() is None:
        return 0
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
    last = end // _HUGE_PAGE_BYTES * _HUGE_PAGE_BYTES
    if last <= first:
        return 0
    if _libc_madvise()(first, last - first, _MADV_HUGEPAGE) != 0:
        logger.info("madvise(MADV_HUGEPAGE) refused (errno %d): the KV cache stays on 4 KiB pages", ctypes.get_errno())
        return 0
    return last - first


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except (OSError, TypeError):
        return None


@functools.cache
def _libc_madvise():
    madvise = getattr(_libc(), "madvise", None) if sys.platform.startswith("linux") else None
    if madvise is None:
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
