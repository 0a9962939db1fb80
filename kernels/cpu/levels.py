"""The x86-64 instruction-set levels the compiled CPU kernels are built for (setup.py) and chosen
among at run time (kernels/cpu/native.py): each level's compiler flags and the CPU features
(/proc/cpuinfo flag names) a CPU needs to run its build. Imports nothing, so setup.py can read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Level:
    name: str
    flags: tuple[str, ...]  # compiler flags of this level's build
    cpu_features: frozenset[str]  # what the CPU must report to run it


_AVX512 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})
_WIDE = ("-mprefer-vector-width=512",)  # GCC prefers 256-bit vectors on AVX-512 parts by default

# Lowest first. x86-64-v3 is AVX2 + FMA (+ BMI, F16C, MOVBE); x86-64-v4 adds AVX-512 F/BW/CD/DQ/VL.
LEVELS = (
    Level("avx2", ("-march=x86-64-v3",), frozenset({"avx2", "fma", "f16c", "bmi2"})),
    Level("avx512", ("-march=x86-64-v4", *_WIDE), _AVX512),
    Level("avx512bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", *_WIDE),
          _AVX512 | {"avx512_bf16", "avx512_vnni"}),
    Level("amx", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", *_WIDE),
          _AVX512 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"}),
)


def runnable_levels(cpu_features: set[str] | frozenset[str]) -> list[Level]:
    """The levels a CPU with these features can run, lowest first."""
    return [level for level in LEVELS if level.cpu_features <= cpu_features]
