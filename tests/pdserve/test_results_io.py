"""benchmarks/results_io.py: a benchmark's RESULT line is printed as before, and the same payload
is stored with its provenance as one JSON file; every benchmark script goes through it."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _results_io():
    spec = importlib.util.spec_from_file_location("results_io", ROOT / "benchmarks" / "results_io.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_write_result_prints_the_line_and_writes_the_record(tmp_path, capsys):
    payload = {"rows": [{"tok_s": 1.5, "preset": "tiny"}], "device": "cpu"}
    path = _results_io().write_result("demo", payload, results_dir=tmp_path)
    assert capsys.readouterr().out == "RESULT " + json.dumps(payload) + "\n"
    assert path.parent == tmp_path and path.name.startswith("demo-")
    record = json.loads(path.read_text())
    assert record["benchmark"] == "demo" and record["result"] == payload
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record["date"])
    assert record["machine"]["cores"] >= 1 and "python" in record["versions"]
    assert record["commit"] is None or re.fullmatch(r"[0-9a-f]{7,}", record["commit"])


def test_the_environment_variable_redirects_or_turns_off_the_files(tmp_path, monkeypatch, capsys):
    results_io = _results_io()
    monkeypatch.setenv(results_io.ENV, str(tmp_path / "elsewhere"))
    assert results_io.write_result("demo", {"a": 1}).parent == tmp_path / "elsewhere"
    monkeypatch.setenv(results_io.ENV, "")
    assert results_io.write_result("demo", {"a": 1}) is None
    assert capsys.readouterr().out.splitlines() == ['RESULT {"a": 1}'] * 2


def test_every_benchmark_script_writes_its_result_through_results_io():
    for script in sorted(set((ROOT / "benchmarks").glob("*.py")) - {ROOT / "benchmarks" / "results_io.py"}):
        text = script.read_text()
        assert 'print("RESULT ' not in text, f"{script.name} prints RESULT itself: use results_io.write_result"


def test_a_process_without_torch_records_the_gpu_nvidia_smi_names(tmp_path, monkeypatch):
    """gpu_served and kv_transfer_gpu only start the processes on the GPU: their records name the
    GPU from nvidia-smi; without one (a CPU machine), none."""
    results_io = _results_io()
    monkeypatch.setitem(__import__("sys").modules, "torch", None)
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\n[ \"$1\" = --query-gpu=name ] && printf 'NVIDIA H200\\nNVIDIA H200\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(smi.parent))
    assert results_io.machine()["gpu"] == "NVIDIA H200"
    monkeypatch.setenv("PATH", str(tmp_path))
    assert results_io.machine()["gpu"] is None
