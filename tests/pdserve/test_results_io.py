"""benchmarks/results_io.py: a benchmark's RESULT line is printed as before, and the same payload
is stored with its provenance as one JSON file; every benchmark script goes through it."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
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


def test_commit_of_names_a_trees_commit_and_whether_its_tracked_files_changed(tmp_path, monkeypatch):
    results_io = _results_io()
    monkeypatch.setenv(results_io.COMMIT_ENV, "1234567")  # this checkout's commit, not another tree's
    assert results_io.commit_of(tmp_path) == (None, None)  # no .git
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f").write_text("1")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "m"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short=7", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    assert results_io.commit_of(tmp_path) == (head, False)
    (tmp_path / "f").write_text("2")
    assert results_io.commit_of(tmp_path) == (head, True)


def _render_ab_trees(records: list[dict]) -> str:
    sys.path.insert(0, str(ROOT))
    from benchmarks.results_served import render_ab_trees

    return "\n".join(render_ab_trees(records)[0])


def _ab_record(date: str, ratios: dict[str, float], cpu: str = "X", flags: tuple[str, ...] = ("avx2",),
               **commits) -> dict:
    """An ab_trees record of date with a row per mode: B / A = its ratio."""
    rows = [{"mode": mode, "a_tok_s": 10.0, "b_tok_s": 10.0 * r, "b_over_a": r, "round_ratios": [r]}
            for mode, r in ratios.items()]
    return {"_file": f"ab_trees-{date}.json", "date": date, "machine": {"cpu": cpu, "cores": 2, "cpu_flags": flags},
            "result": {"preset": "small", "dtype": "float32", "tree_a": "/tmp/a", "tree_b": "/tmp/b", "rows": rows,
                       **commits}}


def test_ab_trees_table_keeps_the_newest_run_of_each_kind_of_cpu():
    text = _render_ab_trees([
        _ab_record("1", {"offline": 0.5}, "AMD EPYC"),
        _ab_record("2", {"offline": 0.6}, "Intel", ("avx2", "avx512f", "amx_tile")),
        _ab_record("3", {"offline": 0.7}, "AMD EPYC", tree_a_commit="581bf56"),
        _ab_record("4", {"offline": 0.8}, "AMD EPYC", ("avx2", "avx512f"))])
    assert "**0.500**" not in text  # superseded on its kind of CPU
    assert all(f"**{r:.3f}**" in text for r in (0.6, 0.7, 0.8))
    assert "**AMD EPYC, AVX2 only**" in text and "**Intel, AMX**" in text and "**AMD EPYC, AVX-512**" in text
    assert "`/tmp/a` (581bf56), `/tmp/b`" in text


def test_ab_trees_table_keeps_each_modes_newest_run():
    text = _render_ab_trees([_ab_record("1", {"offline": 0.91, "served 1:1": 0.92}),
                             _ab_record("2", {"served 1:1": 0.93})])
    assert "**0.910**" in text and "**0.930**" in text and "**0.920**" not in text
    assert "ab_trees-1.json" in text and "ab_trees-2.json" in text
