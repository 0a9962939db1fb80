"""The compiled CPU kernels' one typed boundary, generated from kernels/csrc/pdserve_kernels.h.

The header declares every entry point, shared structure, status code and limit once. This module
parses it and generates a Python wrapper for each entry point of the library built for this CPU's
best instruction-set level (setup.py builds one per level, kernels/cpu/levels.py): tensors go in for
pointers and are checked for type, device, dtype and the span of memory the header says the call
touches (against the view's own extent); integers and floats are checked for type; a status code
comes back as an exception (kernels.errors). Nothing
here chooses what to run: kernels/cpu/backend.py does, once.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
import platform
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.cpu.levels import LEVELS, Level, runnable_levels
from kernels.errors import (
    KernelArgumentError,
    KernelError,
    KernelMemoryError,
    KernelRangeError,
    KernelUnsupported,
)

logger = logging.getLogger(__name__)

HEADER = Path(__file__).resolve().parent.parent / "csrc" / "pdserve_kernels.h"
_LIB_DIR = Path(__file__).resolve().parent

_SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}
_DTYPES = {
    "float": (torch.float32,), "uint16_t": (torch.bfloat16,), "void": (torch.float32, torch.bfloat16),
    "int8_t": (torch.int8,), "int32_t": (torch.int32,), "int64_t": (torch.int64,),
}
_STATUS_ERRORS = {"PDS_ERR_RANGE": KernelRangeError, "PDS_ERR_MEMORY": KernelMemoryError,
                  "PDS_ERR_UNSUPPORTED": KernelUnsupported}


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str  # the base type: int, int64_t, float, double, void, uint16_t, ..., or a struct's name
    is_pointer: bool
    nullable: bool
    span: str | None  # PDS_SPAN's expression, over the integer parameters


@dataclass(frozen=True)
class Entry:
    name: str
    returns: str  # int, int64_t, double, void
    params: tuple[Param, ...]

    @property
    def returns_status(self) -> bool:
        """int results are status codes but for the capability probes (*_ready, *_takes)."""
        return self.returns == "int" and not self.name.endswith(("_ready", "_takes"))


@dataclass(frozen=True)
class Declarations:
    entries: dict[str, Entry]
    structs: dict[str, tuple[tuple[str, str], ...]]  # name -> ((C type, field), ...)
    statuses: dict[int, str]
    limits: tuple[str, ...]
    constants: dict[str, int]  # the other enums' members (e.g. PDS_LINEAR_F32)


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def _parse_param(text: str) -> Param:
    span = re.search(r"PDS_SPAN\((.*)\)\s*$", text)
    nullable = "PDS_NULLABLE" in text
    text = re.sub(r"PDS_SPAN\(.*\)\s*$", "", text).replace("PDS_NULLABLE", "").replace("const ", "").strip()
    match = re.fullmatch(r"(\w+)\s*(\*?)\s*(\w+)", text)
    if match is None:
        raise ValueError(f"{HEADER.name}: cannot parse parameter {text!r}")
    ctype, star, name = match.groups()
    return Param(name, ctype, bool(star), nullable, span.group(1) if span else None)


@functools.cache
def declarations(header: Path = HEADER) -> Declarations:
    """Everything the header declares; raises ValueError on a line it cannot parse."""
    text = _strip_comments(header.read_text())
    entries = {}
    for returns, name, args in re.findall(r"PDS_API\s+(\w+)\s+(\w+)\s*\((.*?)\)\s*;", text, flags=re.S):
        args = " ".join(args.split())
        params = () if args == "void" else tuple(_parse_param(a) for a in _split_args(args))
        entries[name] = Entry(name, returns, params)
    structs = {}
    for body, name in re.findall(r"typedef struct\s*\{(.*?)\}\s*(\w+)\s*;", text, flags=re.S):
        fields = []
        for line in body.split(";"):
            line = line.replace("const ", "").strip()
            if line:
                ctype, star, field = re.fullmatch(r"(\w+)\s*(\*?)\s*(\w+)", line).groups()
                fields.append((ctype + star, field))
        structs[name] = tuple(fields)
    statuses = {int(v): k for k, v in re.findall(r"(PDS_(?:OK|ERR_\w+))\s*=\s*(\d+)", text)}
    constants = {k: int(v) for k, v in re.findall(r"(PDS_LINEAR_\w+)\s*=\s*(\d+)", text)}
    limits = tuple(re.findall(r"X\((\w+),\s*\d+\)", text))
    return Declarations(entries, structs, statuses, limits, constants)


def _split_args(args: str) -> list[str]:
    """Split on the commas outside PDS_SPAN's parentheses."""
    parts, depth, current = [], 0, ""
    for char in args:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    return [*parts, current.strip()]


_STRUCT_TYPES = {"int64_t": ctypes.c_int64, "float": ctypes.c_float}


@functools.cache
def struct_type(name: str) -> type[ctypes.Structure]:
    """The ctypes structure for the header's typedef struct `name` (pointers as c_void_p)."""
    fields = [(field, _STRUCT_TYPES.get(ctype, ctypes.c_void_p)) for ctype, field in declarations().structs[name]]
    return type(name, (ctypes.Structure,), {"_fields_": fields})


def _cpuinfo_field(name: str) -> str | None:
    """The first value of a /proc/cpuinfo field; None where there is none or it is unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    match = re.search(rf"^{name}\s*:(.*)$", text, flags=re.M)
    return match.group(1).strip() if match else None


def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo); empty where unreadable."""
    return frozenset((_cpuinfo_field("flags") or "").split())


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or the machine's architecture where it gives none."""
    return _cpuinfo_field("model name") or platform.machine() or "unknown CPU"


def library_path(level: Level) -> Path | None:
    """The built library of this level (setup.py), or None when it was not built."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = _LIB_DIR / f"_native_{level.name}{suffix}"
        if path.exists():
            return path
    return None


def available_levels() -> list[Level]:
    """The levels this CPU can run and this install built, lowest first."""
    return [level for level in runnable_levels(cpu_features()) if library_path(level) is not None]


def _tensor_address(entry: str, name: str, value, dtypes: tuple, nullable: bool) -> int | None:
    """A pointer argument: a CPU tensor of one of dtypes (its address), or None where nullable."""
    if value is None:
        if nullable:
            return None
        raise KernelArgumentError(f"{entry}: {name} may not be None")
    if not isinstance(value, torch.Tensor):
        raise KernelArgumentError(f"{entry}: {name} takes a tensor, got {type(value).__name__}")
    if value.dtype not in dtypes or not value.is_cpu:
        raise KernelArgumentError(f"{entry}: {name} takes a CPU tensor of {' or '.join(map(str, dtypes))}, got "
                                  f"{value.dtype} on {value.device}")
    return value.data_ptr()


def _extent(tensor: torch.Tensor) -> int:
    """The elements a view reaches from its first one (0 for an empty view)."""
    extent = 1
    for size, stride in zip(tensor.shape, tensor.stride()):
        if size == 0:
            return 0
        extent += (size - 1) * stride
    return extent


def _short_span(entry: str, name: str, tensor, span: int, expression: str) -> KernelArgumentError:
    return KernelArgumentError(f"{entry}: {name} must cover {span} elements ({expression}); the tensor reaches "
                               f"{_extent(tensor)}")


def _integer(entry: str, name: str, value) -> int:
    if not isinstance(value, int):
        raise KernelArgumentError(f"{entry}: {name} takes an int, got {type(value).__name__}")
    return value


def _number(entry: str, name: str, value) -> float:
    if not isinstance(value, (int, float)):
        raise KernelArgumentError(f"{entry}: {name} takes a number, got {type(value).__name__}")
    return value


def _struct_address(entry: str, name: str, value, struct: str) -> int:
    if not isinstance(value, (struct_type(struct), ctypes.Array)):
        raise KernelArgumentError(f"{entry}: {name} takes a {struct}")
    return ctypes.addressof(value)


def _wrapper_source(entry: Entry) -> str:
    """The Python source of entry's checked wrapper: every argument converted and checked in the
    header's order, each PDS_SPAN compared with the tensor's extent, the call, its status."""
    names = [p.name for p in entry.params]
    lines = [f"def {entry.name}({', '.join(names)}):"]
    args = []
    for i, p in enumerate(entry.params):
        if not p.is_pointer:
            # NOTE: the common case inline (type() is), the helpers only for subclasses and errors:
            # the checks run on every op of every layer of every step.
            kinds = "(int, float)" if p.ctype in ("float", "double") else "int"
            check = "_number" if p.ctype in ("float", "double") else "_integer"
            lines.append(f"    if type({p.name}) is not int:")
            if kinds == "int":
                lines.append(f"        {p.name} = {check}({entry.name!r}, {p.name!r}, {p.name})")
            else:
                lines.append(f"        if type({p.name}) is not float:")
                lines.append(f"            {p.name} = {check}({entry.name!r}, {p.name!r}, {p.name})")
            args.append(p.name)
        elif p.ctype in declarations().structs:
            lines.append(f"    a_{p.name} = _struct_address({entry.name!r}, {p.name!r}, {p.name}, {p.ctype!r})")
            args.append(f"a_{p.name}")
        else:
            lines.append(f"    if type({p.name}) is _Tensor and {p.name}.dtype in _D{i} and {p.name}.is_cpu:")
            lines.append(f"        a_{p.name} = {p.name}.data_ptr()")
            lines.append("    else:")
            lines.append(f"        a_{p.name} = _tensor_address({entry.name!r}, {p.name!r}, {p.name}, _D{i}, "
                         f"{p.nullable})")
            args.append(f"a_{p.name}")
    for p in entry.params:
        if p.is_pointer and p.span is not None:
            guard = f"{p.name} is not None and " if p.nullable else ""
            lines.append(f"    span = {p.span}")
            lines.append(f"    if {guard}span > 0 and _extent({p.name}) < span:")
            lines.append(f"        raise _short_span({entry.name!r}, {p.name!r}, {p.name}, span, {p.span!r})")
    lines.append(f"    result = _function({', '.join(args)})")
    if entry.returns_status:
        lines.append("    if result:")
        lines.append(f"        raise _status_error({entry.name!r}, result)")
    lines.append("    return result")
    return "\n".join(lines) + "\n"


def _wrap(entry: Entry, function, statuses: dict[int, str]):
    """entry's checked wrapper around the ctypes function (generated from _wrapper_source)."""
    function.argtypes = [ctypes.c_void_p if p.is_pointer else _SCALARS[p.ctype] for p in entry.params]
    function.restype = None if entry.returns == "void" else _SCALARS[entry.returns]

    def status_error(name: str, code: int) -> KernelError:
        status = statuses.get(code, f"status {code}")
        return _STATUS_ERRORS.get(status, KernelError)(name, status)

    scope = {f"_D{i}": _DTYPES.get(p.ctype) for i, p in enumerate(entry.params) if p.is_pointer}
    scope |= {"_function": function, "_status_error": status_error, "_Tensor": torch.Tensor, "_extent": _extent,
             "_short_span": _short_span, "_tensor_address": _tensor_address, "_integer": _integer,
             "_number": _number, "_struct_address": _struct_address}
    exec(compile(_wrapper_source(entry), f"<{HEADER.name}: {entry.name}>", "exec"), scope)  # noqa: S102
    wrapper = scope[entry.name]
    wrapper.entry = entry
    return wrapper


class NativeLibrary:
    """The kernels of one built level: each entry point the build has as a checked attribute (a
    missing one: AttributeError; `has` asks first), and the header's limits read from it."""

    def __init__(self, level: Level, path: Path) -> None:
        self.level = level
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        decl = declarations()
        self.limits = {name: ctypes.c_int64.in_dll(self._lib, f"pds_limit_{name}").value for name in decl.limits}
        self.constants = decl.constants
        self._functions: dict = {}
        for name, entry in decl.entries.items():
            try:
                function = getattr(self._lib, name)
            except AttributeError:
                continue  # a higher level's entry point
            self._functions[name] = _wrap(entry, function, decl.statuses)

    def has(self, name: str) -> bool:
        return name in self._functions

    def __getattr__(self, name: str):
        functions = self.__dict__.get("_functions", {})
        if name not in functions:
            raise AttributeError(f"the {self.__dict__.get('level')} kernels have no entry point {name!r}")
        return functions[name]

    def entry_points(self) -> list[str]:
        return sorted(self._functions)


@functools.cache
def load(level_name: str | None = None) -> NativeLibrary | None:
    """The library of level_name (None: the best this CPU runs and this install built); None where
    there is none (logged once). Raises ValueError for a level this CPU cannot run or not built."""
    levels = available_levels()
    if level_name is None:
        if not levels:
            logger.warning("no compiled CPU kernels for this CPU (not built at install, or not x86-64)")
            return None
        level = levels[-1]
    else:
        level = next((lv for lv in levels if lv.name == level_name), None)
        if level is None:
            raise ValueError(f"CPU kernel level {level_name!r} is not runnable here or not built "
                             f"(available: {[lv.name for lv in levels]}; known: {[lv.name for lv in LEVELS]})")
    library = NativeLibrary(level, library_path(level))
    logger.info("compiled CPU kernels: %s (%s)", level.name, library.path.name)
    return library


def describe() -> str:
    """The boundary as a table: every entry point the header declares, its typed parameters (spans),
    and the built levels that export it; then the levels this CPU runs and the limits."""
    decl = declarations()
    exported = {}
    for level in LEVELS:
        path = library_path(level)
        if path is not None:
            lib = ctypes.CDLL(str(path))
            exported[level.name] = {name for name in decl.entries if hasattr(lib, name)}
    lines = ["| entry point | returns | parameters | levels |", "|---|---|---|---|"]
    for name, entry in decl.entries.items():
        params = ", ".join(f"{p.ctype}{'*' if p.is_pointer else ''} {p.name}"
                           + (f" [{p.span}]" if p.span else "") + (" or None" if p.nullable else "")
                           for p in entry.params) or "-"
        levels = ", ".join(level for level, names in exported.items() if name in names) or "none built"
        lines.append(f"| `{name}` | {'status' if entry.returns_status else entry.returns} | {params} | {levels} |")
    best = available_levels()
    lines.append("")
    lines.append(f"this CPU runs: {', '.join(lv.name for lv in best) or 'none'}")
    if best:
        lines.append(f"limits: {load().limits}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe())  # noqa: T201 (python -m kernels.cpu.native: the boundary, for people)
