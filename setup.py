"""Builds pdserve's compiled CPU kernels at install time (pip install / make install): the C sources of
kernels/csrc into one shared library per x86-64 instruction-set level, loaded with ctypes by
kernels/cpu/native.py, which picks the best level the CPU has. Never the build host's own -march: a build must run
on any CPU of its level, so an image built on one host runs on another. Everything else is in
pyproject.toml."""

import os
import platform
import sys
from pathlib import Path

from setuptools import Extension, setup

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for kernels.cpu.levels in an isolated build too
from kernels.cpu.levels import LEVELS  # noqa: E402

SOURCES = sorted(str(p) for p in Path("kernels/csrc").glob("*.c"))
HEADERS = sorted(str(p) for p in Path("kernels/csrc").glob("*.h"))
# NOTE: -ffast-math when compiling only (vector expf from libmvec, reassociated sums): linking with it
# would add crtfastmath.o, which turns on flush-to-zero for the whole process. OpenMP joins torch's
# libgomp pool, so torch.set_num_threads governs the kernels too.
COMMON = ["-O3", "-ffast-math", "-fopenmp", "-std=c11", "-fvisibility=hidden", "-Wno-psabi"]


def extensions() -> list[Extension]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []  # no x86 kernels: the CPU backend uses oneDNN and the reference ops
    return [
        Extension(
            f"kernels.cpu._native_{level.name}", sources=SOURCES, depends=HEADERS,
            extra_compile_args=COMMON + list(level.flags), extra_link_args=["-fopenmp"], libraries=["mvec", "m"],
            optional=True,
        )
        for level in LEVELS
    ]


# NOTE: the four libraries build side by side, one per core (50 s -> 27 s on two cores).
setup(ext_modules=extensions(), options={"build_ext": {"parallel": os.cpu_count() or 1}})
