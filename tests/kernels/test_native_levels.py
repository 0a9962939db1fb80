"""Each compiled kernel library holds its own level's instructions and none above them (setup.py
builds the levels side by side from the same sources). Read from the libraries' machine code with
objdump (binutils, beside the compiler the install needs), so it holds on any x86-64 CPU, whatever
levels that CPU runs: an AVX2 library holding AVX-512 code passes every test on an AVX-512 machine
and dies with SIGILL on an AVX2-only one."""

from __future__ import annotations

import re
import subprocess

import pytest

from kernels.cpu import native
from kernels.cpu.levels import LEVELS

# objdump's AT&T operands and mnemonics
_AVX512 = re.compile(r"%zmm\d|%k[0-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b")  # 512-bit, mask and upper-16 registers
_AVX512_BF16 = re.compile(r"\b(vdpbf16ps|vcvtne2ps2bf16|vcvtneps2bf16)\b")
_AMX = re.compile(r"\b(tdpbf16ps|tdpbssd|tileloadd|tileloaddt1|tilestored|ldtilecfg|tilezero|tilerelease)\b")
# each level: what its code must not hold (above it), and what it must (its own, where it uses it)
ABOVE = {"avx2": (_AVX512, _AVX512_BF16, _AMX), "avx512": (_AVX512_BF16, _AMX), "avx512bf16": (_AMX,), "amx": ()}
OWN = {"avx2": None, "avx512": _AVX512, "avx512bf16": _AVX512_BF16, "amx": _AMX}

def test_every_level_has_its_checks():
    assert set(ABOVE) == set(OWN) == {level.name for level in LEVELS}


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name)
def test_a_library_holds_no_instruction_above_its_level(level):
    path = native.library_path(level)
    assert path is not None, f"the install built no {level.name} library"
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True,
                          check=True, timeout=60).stdout
    for above in ABOVE[level.name]:
        found = [line.strip() for line in code.splitlines() if above.search(line)]
        assert not found, f"{path.name}: {len(found)} instructions above {level.name}, e.g. {found[:3]}"
    if OWN[level.name] is not None:
        assert OWN[level.name].search(code), f"{path.name} holds none of its own level's instructions"
