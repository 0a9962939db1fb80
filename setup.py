"""Builds pdserve's compiled CPU kernels at install time (pip install / make install): the C sources of
kernels/csrc into one shared library per x86-64 instruction-set level, loaded with ctypes by
kernels/cpu/native.py, which picks the best level the CPU has. Never the build host's own -march: a build must run
on any CPU of its level, so an image built on one host runs on another. Everything else is in
pyproject.toml."""

import copy
import os
import platform
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

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


class BuildEachLevelApart(build_ext):
    """build_ext with each library's objects in a folder of its own. The levels compile the same
    sources, whose objects build_ext names after the source alone: side by side in one folder, a
    level would link objects another level's flags had just written (an AVX2 library holding
    AVX-512 code, which dies with SIGILL on an AVX2-only CPU)."""

    def build_extension(self, ext: Extension) -> None:
        # NOTE: a copy per library, not self.build_temp set and restored: the libraries build on
        # threads of their own (parallel), which would all see one attribute.
        command = copy.copy(self)
        command.build_temp = os.path.join(self.build_temp, ext.name.rsplit(".", 1)[-1])
        build_ext.build_extension(command, ext)


# NOTE: the four libraries build side by side, one per core (50 s -> 27 s on two cores).
setup(ext_modules=extensions(), cmdclass={"build_ext": BuildEachLevelApart},
      options={"build_ext": {"parallel": os.cpu_count() or 1}})
