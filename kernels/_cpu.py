"""Compiled CPU kernels: C sources in kernels/csrc, built on first use with the machine's C
compiler for the machine itself (-march=native) and loaded with ctypes.

Each build is cached under ~/.cache/pdserve/kernels, named by a hash of the source, the shared
headers (csrc/*.h), the flags and the compiler's version, so a changed source or compiler builds
anew. Without a compiler (or when a build fails) the loader returns None once and the op modules
keep their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
_CACHE_DIR = Path.home() / ".cache" / "pdserve" / "kernels"
# NOTE: -ffast-math only when compiling (vector expf from libmvec, reassociated dot products);
# linking with it would add crtfastmath.o, whose constructor turns on flush-to-zero for the whole
# process (measured: torch then rounded 1e-40 to 0). OpenMP: the library joins torch's own
# libgomp.so.1 pool, so torch.set_num_threads governs it too. 512-bit vectors where the CPU has
# them: GCC prefers 256 on Intel's AVX-512 parts by default; the bfloat16 SiLU-and-mul measured
# 2.0x faster with 512 on a 2-core Xeon (AMX), the other kernels the same.
_COMPILE_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
_LINK_FLAGS = ("-shared", "-fopenmp")
_LIBS = ("-lmvec", "-lm")
_BUILD_TIMEOUT_S = 120


@functools.cache
def load_library(name: str) -> ctypes.CDLL | None:
    """The compiled kernels/csrc/<name>.c, built if needed; None (logged once) when no C
    compiler is found or the build fails. Thread-safe enough for start-up: concurrent builds
    by several processes each write their own file and rename it into place."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: CPU kernel %s unavailable, using the torch path", name)
        return None
    source = _SOURCE_DIR / f"{name}.c"
    try:
        path = _built(compiler, source)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("building CPU kernel %s failed (%s): using the torch path", name, exc)
        return None


def _built(compiler: str, source: Path) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    # NOTE: the shared headers are part of every kernel's key: a changed header rebuilds them all.
    headers = b"".join(h.read_bytes() for h in sorted(_SOURCE_DIR.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(_COMPILE_FLAGS + _LINK_FLAGS).encode()
                         + version.encode())
    target = _CACHE_DIR / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    _CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=_CACHE_DIR) as work:
        obj, lib = Path(work) / "kernel.o", Path(work) / "kernel.so"
        _run([compiler, *_COMPILE_FLAGS, "-c", str(source), "-o", str(obj)])
        _run([compiler, *_LINK_FLAGS, str(obj), "-o", str(lib), *_LIBS])
        os.replace(lib, target)
    logger.info("built CPU kernel %s", target)
    return target


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
    if result.returncode != 0:
        raise OSError(f"{' '.join(argv[:2])} ... exited {result.returncode}: {result.stderr.strip()[:500]}")


@functools.cache
def cpu_function(library: str, name: str, argtypes: tuple, restype=None):
    """Function `name` of the compiled kernels/csrc/<library>.c with its ctypes signature, or
    None when the library is unavailable (see load_library)."""
    lib = load_library(library)
    if lib is None:
        return None
    function = getattr(lib, name)
    function.argtypes = list(argtypes)
    function.restype = restype
    return function


# The C kernels' name suffix per dtype they take.
KERNEL_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def is_cpu_rows(dtype: torch.dtype, *tensors) -> bool:
    """All CPU 2-D tensors of dtype with unit stride along their rows."""
    return all(t.device.type == "cpu" and t.dtype == dtype and t.dim() == 2 and t.stride(1) == 1 for t in tensors)


def row_kernel_suffix(*tensors) -> str | None:
    """"f32" or "bf16": the row kernels' name suffix for these tensors (all CPU float32, or all
    CPU bfloat16, 2-D with unit stride along their rows); None when no row kernel takes them."""
    suffix = KERNEL_SUFFIXES.get(tensors[0].dtype) if tensors else None
    return suffix if suffix is not None and is_cpu_rows(tensors[0].dtype, *tensors) else None
