"""benchmarks/gpu_served.py (the GPU check's served step) on the CPU with the tiny model: both
setups serve each prompt length at rate inf, then as Poisson arrivals at the rate colocated set;
every measured prompt's KV is pulled (counted from the decode node's metrics, the
transport named), greedy outputs agree; and a SIGTERM (the step's timeout) stops it cleanly:
its servers gone, its results so far written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import live_processes

REPO = Path(__file__).resolve().parents[2]


def _command(model: Path, tmp_path: Path, num_requests: int, output_len: int, prompt_lens=("32",)) -> list[str]:
    return [sys.executable, "benchmarks/gpu_served.py", "--device", "cpu", "--dtype", "float32", "--model", str(model),
            "--num-requests", str(num_requests), "--prompt-lens", *prompt_lens, "--output-len", str(output_len),
            "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--budget-s", "200",
            "--log-dir", str(tmp_path / "logs")]


def _result(results: Path) -> dict:
    [record] = results.glob("gpu_served-*.json")
    return json.loads(record.read_text())["result"]


def _processes_naming(text: str) -> list[int]:
    return [pid for pid, (_, cmdline) in live_processes().items() if text in cmdline]


def test_both_setups_serve_each_length_at_rate_inf_then_poisson_and_every_prompt_is_pulled(tiny_model_dir, tmp_path):
    results = tmp_path / "results"
    proc = subprocess.run(_command(tiny_model_dir, tmp_path, 20, 8, prompt_lens=("32", "64")), cwd=REPO,
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PDSERVE_RESULTS_DIR": str(results)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = _result(results)
    colocated, disaggregated = result["setups"]["colocated"], result["setups"]["1P+1D"]
    runs = {name: [(r["num_requests"], r["prompt_len"], r["rate_rps"] is None) for r in setup["runs"]]
            for name, setup in result["setups"].items()}
    # the longer prompts send as many tokens (20 x 32 = 10 x 64), at least 16 requests
    assert runs["colocated"] == runs["1P+1D"] == [(20, 32, True), (20, 32, False), (16, 64, True), (16, 64, False)]
    poisson = [r["rate_rps"] for r in colocated["runs"] if r["rate_rps"] is not None]
    assert poisson == [r["rate_rps"] for r in disaggregated["runs"] if r["rate_rps"] is not None]
    assert poisson[0] == pytest.approx(0.9 * colocated["runs"][0]["output_throughput"] / 8)
    for run in colocated["runs"] + disaggregated["runs"]:
        assert run["num_failed"] == 0, run["errors"]
        assert all(0 < run["cores_busy"][k] < 2 for k in ("proxy", "client", "decode")), run["cores_busy"]
        steps = run["decode_steps"]
        assert steps["count"] >= 8 and steps["mean_ms"] > 0 and 1 <= steps["mean_batch"] <= run["num_requests"], steps
    for run in disaggregated["runs"]:
        pulls = run["pulls"]
        assert pulls["count"] == run["num_requests"] and pulls["bytes"] > 0 and pulls["fallbacks"] == 0, pulls
        assert pulls["transport"]["memory"] == "host" and pulls["transport"]["transport"], pulls
    assert [(c["prompt_len"], c["rate_rps"] is None) for c in result["comparisons"]] == [
        (32, True), (32, False), (64, True), (64, False)]
    assert all(c["pd_over_colocated"] > 0 for c in result["comparisons"])
    assert result["greedy_equal"] is True and len(colocated["tokens"]) == 16
    assert all(len(tokens) == 16 and all(t.startswith("token_id:") for t in tokens)  # named by id, text or not
               for tokens in colocated["tokens"])


def test_sigterm_stops_the_servers_and_writes_what_it_has(tiny_model_dir, tmp_path):
    model = tmp_path / "model-for-sigterm"
    model.symlink_to(tiny_model_dir)  # a path only this run's servers name
    results = tmp_path / "results"
    proc = subprocess.Popen(_command(model, tmp_path, 4000, 64), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PDSERVE_RESULTS_DIR": str(results)})
    try:
        deadline = time.monotonic() + 60
        while len(_processes_naming(str(model))) < 3:  # the bench process, its node and its proxy
            assert proc.poll() is None and time.monotonic() < deadline, "the colocated setup did not start"
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = _processes_naming(str(model))
    for pid in left:  # this test's own servers, were they left: never outlive it
        os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 1, output[-2000:]
    assert "stopped by signal" in _result(results)["setups"]["colocated"].get("error", ""), output[-2000:]
    assert left == [], "servers left running"
