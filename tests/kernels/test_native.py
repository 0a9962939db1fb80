"""The compiled kernels' one boundary (kernels/cpu/native.py, generated from
kernels/csrc/pdserve_kernels.h): every entry point declared once and reached through the checked
wrapper, limits read from the library, bad arguments and status codes as Python errors, and no
a build for the host's own CPU anywhere a build can be copied from."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from kernels.cpu import native
from kernels.errors import KernelArgumentError, KernelRangeError

ROOT = Path(__file__).resolve().parents[2]
LIB = native.load()


def test_every_exported_symbol_is_declared_in_the_header_and_wrapped():
    """What each built library exports is exactly the header's entry points (and its limits)."""
    decl = native.declarations()
    for level in native.LEVELS:
        path = native.library_path(level)
        assert path is not None, f"the {level.name} library was not built at install"
        out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True,
                             check=True).stdout
        exported = {line.split()[-1] for line in out.splitlines() if line.split()[1] in ("T", "R")}
        functions = {name for name in exported if not name.startswith("pds_limit_")}
        assert functions <= set(decl.entries), functions - set(decl.entries)
        assert {f"pds_limit_{name}" for name in decl.limits} <= exported


def test_limits_are_read_from_the_library_and_defined_once():
    header = native.HEADER.read_text()
    for name, value in LIB.limits.items():
        assert re.search(rf"X\({name},\s*{value}\)", header)
    for path in (ROOT / "kernels").rglob("*.py"):
        text = path.read_text()
        assert "MAX_HEAD_DIM" not in text and "+47)//48" not in text.replace(" ", ""), path


def test_arguments_are_checked_at_the_boundary():
    x, out = torch.randn(3, 5), torch.empty(3, dtype=torch.int64)
    LIB.argmax_rows_f32(x, 5, 3, 5, out)
    assert torch.equal(out, x.argmax(dim=1))
    with pytest.raises(KernelArgumentError, match="must cover 20 elements"):
        LIB.argmax_rows_f32(x, 5, 4, 5, out)  # one row past x's storage
    with pytest.raises(KernelArgumentError, match="float32"):
        LIB.argmax_rows_f32(x.double(), 5, 3, 5, out)
    with pytest.raises(KernelArgumentError, match="may not be None"):
        LIB.argmax_rows_f32(None, 5, 3, 5, out)
    with pytest.raises(KernelArgumentError, match="takes an int"):
        LIB.argmax_rows_f32(x, 5.0, 3, 5, out)
    with pytest.raises(TypeError, match="argmax_rows_f32.*missing 1 required positional argument: 'out'"):
        LIB.argmax_rows_f32(x, 5, 3, 5)
    with pytest.raises(KernelArgumentError, match="takes a tensor"):
        LIB.argmax_rows_f32(x.tolist(), 5, 3, 5, out)
    with pytest.raises(KernelArgumentError, match="CPU tensor"):
        LIB.argmax_rows_f32(x.to("meta"), 5, 3, 5, out)
    with pytest.raises(AttributeError):
        LIB.no_such_kernel  # noqa: B018


def test_a_status_code_comes_back_as_its_exception():
    query, key = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    cos_sin = torch.randn(4, 8)
    with pytest.raises(KernelRangeError, match="PDS_ERR_RANGE"):
        LIB.rotary_f32(query, 8, 8, 1, key, 8, 8, 1, torch.tensor([0, 9]), cos_sin, 8, 4, 2, 4)


def test_no_build_uses_march_native():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in tracked.split():
        path = ROOT / name
        if path.suffix in (".py", ".toml", ".sh", ".cfg") or path.name in ("Makefile", "Dockerfile"):
            assert "march=" + "native" not in path.read_text(errors="replace"), name


def test_every_span_in_the_header_is_an_expression_of_its_entrys_integer_parameters():
    """A span the wrapper cannot evaluate would fail every call of that entry, on the CPUs that
    have it (which may not be this one): each is checked here, on any CPU."""
    import ast

    for name, entry in native.declarations().entries.items():
        integers = {p.name for p in entry.params if not p.is_pointer and p.ctype in ("int", "int64_t")}
        for param in entry.params:
            if param.span is None:
                continue
            assert param.is_pointer, f"{name}.{param.name}: a span on a non-pointer"
            tree = ast.parse(param.span, mode="eval")
            used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
            assert used and used <= integers, f"{name}.{param.name}: {param.span!r} uses {used - integers}"
            allowed = (ast.Expression, ast.BinOp, ast.Name, ast.Constant, ast.Load, ast.Add, ast.Sub, ast.Mult)
            assert all(isinstance(node, allowed) for node in ast.walk(tree)), f"{name}.{param.name}: {param.span!r}"
