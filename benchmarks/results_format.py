"""What every benchmark renderer shares (see render_results.py): picking the current records,
formatting cells, tables and provenance lines, and drawing plots with matplotlib off-screen.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

IMG_LINK = "img/results"  # from docs/benchmarks.md


def latest(records: list[dict], key: Callable[[dict], object]) -> list[dict]:
    """The newest record for each key, in the order the keys first appear."""
    found: dict = {}
    for record in records:
        found[key(record)] = record
    return list(found.values())


def cpu(record: dict) -> str:
    machine = record.get("machine") or {}
    return machine.get("gpu") or machine.get("cpu") or "unknown machine"


def cpu_kind(record: dict) -> str:
    """cpu(record) and the widest vector level its recorded flags (results_io.CPU_FLAGS) show."""
    flags = set((record.get("machine") or {}).get("cpu_flags") or ())
    level = ("AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2 only" if "avx2" in flags
             else "no AVX2")
    return f"{cpu(record)}, {level}"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def provenance(record: dict) -> str:
    machine = record.get("machine") or {}
    where = machine.get("cpu") or "machine not recorded"
    if machine.get("cores"):
        where += f", {machine['cores']} cores"
    if machine.get("gpu"):
        where = f"{machine['gpu']} ({where})"
    parts = [where, record.get("date") or "undated", f"commit {record['commit']}" if record.get("commit") else
             "commit not recorded"]
    text = "Measured on " + "; ".join(parts)
    if record.get("command"):
        text += f"; `{record['command']}`"
    if record.get("note"):
        text += f". Note: {record['note']}"
    return f"*{text}* (data: `benchmarks/results/{record['_file']}`)"


def num(value, digits: int = 1, unit: str = "") -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    text = f"{value:,.{digits}f}"
    return text + unit


def rng(values, digits: int = 2) -> str:
    if not values:
        return ""
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def with_plot(lines: list[str], name: str, alt: str, draw: Callable[[Path], None]) -> tuple[list[str], list]:
    """A renderer's answer: its lines and a link to plot `name` (alt text `alt`), and that plot to draw."""
    return lines + [f"![{alt}]({IMG_LINK}/{name})", ""], [(name, draw)]


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
