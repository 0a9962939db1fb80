"""Renders the current benchmark results (benchmarks/results/*.json, written by each benchmark
through results_io.write_result) into docs/benchmarks.md and docs/img/results/: each benchmark's
tables between its `<!-- results:NAME -->` and `<!-- /results:NAME -->` markers, and its plots
as PNGs. "Current" is the latest record per benchmark and what it measured on (machine, dtype,
preset, ...); older records stay in the folder as history. This file loads the records and fills
the page; the renderers live in results_cpu.py, results_served.py and results_gpu.py.

    .venv/bin/python benchmarks/render_results.py           # rewrite the tables and the plots
    .venv/bin/python benchmarks/render_results.py --check   # exit 1 if the tables are stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img" / "results"
COMMAND = ".venv/bin/python benchmarks/render_results.py"
sys.path.insert(0, str(ROOT))

from benchmarks import results_cpu, results_gpu, results_served  # noqa: E402


def load(folder: Path = RESULTS) -> list[dict]:
    """Every record, oldest first (undated ones first of all)."""
    records = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        record["_file"] = path.name
        records.append(record)
    return sorted(records, key=lambda r: (r.get("date") or "", r["_file"]))


# One renderer per benchmark: its records -> (markdown lines, plots to draw as (file name, draw(path))).
RENDERERS: dict[str, Callable[[list[dict]], tuple[list[str], list]]] = {
    "ab_trees": results_served.render_ab_trees,
    "vs_vllm": results_served.render_vs_vllm, "kernels_gpu": results_gpu.render_kernels_gpu,
    "kernels_cpu": results_cpu.render_kernels_cpu, "kv_transfer": results_cpu.render_kv_transfer,
    "offline_throughput": results_cpu.render_offline_throughput,
    "serve_throughput": results_served.render_serve_throughput, "decode_latency": results_cpu.render_decode_latency,
    "multiturn": results_served.render_multiturn, "disagg_vs_colocated": results_served.render_disagg_vs_colocated,
    "chaos": results_served.render_chaos, "load_client": results_served.render_load_client,
    "profile_serve": results_served.render_profile_serve, "fuzz": results_served.render_fuzz,
    "gpu_engine": results_gpu.render_gpu_engine, "kv_transfer_gpu": results_gpu.render_kv_transfer_gpu,
    "gpu_served": results_gpu.render_gpu_served, "tensor_parallel": results_cpu.render_tensor_parallel,
    "kv_transfer_tp": results_cpu.render_kv_transfer_tp, "hostile_soak": results_served.render_hostile_soak,
    "overload": results_served.render_overload,
    "proxy_capacity": results_served.render_proxy_capacity,
    "core_lending": results_served.render_core_lending, "kv_streaming": results_served.render_kv_streaming,
    "host_ceiling": results_cpu.render_host_ceiling,
}


def render(records: list[dict]) -> tuple[dict[str, str], list]:
    """{benchmark: markdown block}, and the plots [(file name, draw(path))]."""
    blocks, plots = {}, []
    for name, renderer in RENDERERS.items():
        mine = [r for r in records if r["benchmark"] == name]
        if not mine:
            blocks[name] = "*No results recorded yet.*\n"
            continue
        lines, figures = renderer(mine)
        while lines and lines[-1] == "":
            lines.pop()
        blocks[name] = "\n".join(lines) + "\n"
        plots += figures
    return blocks, plots


def fill(page: str, blocks: dict[str, str]) -> str:
    """The page with each marked block replaced; a block the page has no markers for is an error."""
    for name, block in blocks.items():
        pattern = re.compile(rf"(<!-- results:{re.escape(name)} -->\n).*?(<!-- /results:{re.escape(name)} -->)", re.S)
        if not pattern.search(page):
            raise SystemExit(f"{PAGE.relative_to(ROOT)} has no <!-- results:{name} --> markers")
        page = pattern.sub(lambda m, block=block: m.group(1) + block + m.group(2), page)
    return page


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="render docs/benchmarks.md's tables and plots from benchmarks/results")
    parser.add_argument("--check", action="store_true", help="exit 1 if the tables differ from a fresh render")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    args = parser.parse_args(argv)
    blocks, plots = render(load())
    page = PAGE.read_text()
    new = fill(page, blocks)
    if args.check:
        missing = [name for name, _ in plots if not (IMG / name).exists()]
        if new != page or missing:
            print(f"{PAGE.relative_to(ROOT)} is stale (or plots missing: {missing}): run {COMMAND}",  # noqa: T201
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    if not args.no_plots:
        IMG.mkdir(parents=True, exist_ok=True)
        for name, draw in plots:
            draw(IMG / name)
    print(f"wrote {PAGE.relative_to(ROOT)}" + ("" if args.no_plots else f" and {len(plots)} plots in "  # noqa: T201
                                                f"{IMG.relative_to(ROOT)}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
