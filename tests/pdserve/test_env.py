"""`pdserve env`: what it reports is what the code that runs the model decides, on any machine."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from kernels.cpu import native
from kernels.cpu.levels import LEVELS
from kernels.select import select_backend
from pdserve import cli, env

REPO = Path(__file__).resolve().parents[2]


def _report(capsys, *flags: str) -> str:
    assert cli.main(["env", *flags]) == 0
    return capsys.readouterr().out


def test_json_report_is_what_the_engine_would_pick(capsys):
    report = json.loads(_report(capsys, "--json"))
    runs = [level.name for level in native.available_levels()]
    assert report["cpu_kernels"]["runs"] == runs
    assert report["cpu_kernels"]["loaded"] == (runs[-1] if runs else None)
    assert report["cpu_kernels"]["loaded"] == (native.load().level.name if native.load() else None)
    assert [lv["built"] for lv in report["cpu_kernels"]["levels"]] == [native.library_path(lv) is not None
                                                                         for lv in LEVELS]
    assert report["kernel_backends"]["cpu"] == select_backend("cpu").describe()
    assert report["device_auto"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert report["packages"]["torch"] == torch.__version__
    assert len(report["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    model = re.search(r"^model name\s*:(.*)$", Path("/proc/cpuinfo").read_text(), flags=re.M)
    assert report["cpu"]["name"] == (model.group(1).strip() if model else report["cpu"]["name"])
    flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), flags=re.M).group(1).split())
    assert set(report["cpu"]["features"]) <= flags and "avx2" in report["cpu"]["features"]


def test_lines_name_the_loaded_level_and_what_each_level_the_cpu_cannot_run_lacks(capsys, monkeypatch):
    # An AVX2-only CPU, whatever this one is: each AVX-512 level is said to need what it lacks.
    monkeypatch.setattr(native, "cpu_features", lambda: frozenset({"avx2", "fma", "f16c", "bmi2", "avx"}))
    report = env.collect()
    assert report["cpu_kernels"]["runs"] == ["avx2"]
    text = env.render(report)
    line = next(line for line in text.splitlines() if line.startswith("compiled CPU kernels:"))
    assert "this CPU runs avx2 (loaded: avx2)" in line
    assert "amx needs amx_bf16, amx_tile, avx512_bf16, avx512_vnni, avx512bw" in line
    assert "avx512 needs avx512bw, avx512cd, avx512dq, avx512f, avx512vl" in line


def test_nixl_build_and_plugins_are_read_without_loading_nixl():
    code = ("import json, sys; from pdserve import env; report = env.collect(); "
            "print(json.dumps([report['packages']['nixl'], report['nixl'], 'nixl' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    version, nixl, loaded = json.loads(out.stdout.splitlines()[-1])
    assert not loaded
    if version is None:
        assert nixl is None
        return
    assert nixl["version"] == version and nixl["build"] in ("nixl-cu12", "nixl-cu13")
    assert "UCX" in nixl["plugins"]
