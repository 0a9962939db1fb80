"""benchmarks/gpu_served.py's bookkeeping without servers: a run cut short by the step's timeout
(SIGTERM) keeps the runs that ended before it, and the comparison pairs runs of one length and rate."""

from __future__ import annotations

import argparse
import math

import pytest

from benchmarks import gpu_served


class _Deployment:
    base_url = "http://127.0.0.1:1"
    stopped = False

    def stop(self) -> None:
        _Deployment.stopped = True


def _run(prompt_len: int, rate: float, tok_s: float) -> dict:
    return {"prompt_len": prompt_len, "rate_rps": None if rate == math.inf else rate, "num_requests": 4,
            "output_throughput": tok_s, "ttft_ms": {"p50": 1.0, "p99": 2.0}, "tpot_ms": {"p50": 1.0, "p99": 3.0},
            "num_failed": 0, "duration_s": 1.0, "cores_busy": {"proxy": 0.5, "client": 0.2, "decode": 0.9},
            "decode_steps": {"count": 10.0, "mean_ms": 3.0, "mean_batch": 4.0}}


@pytest.fixture
def fakes(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    args = argparse.Namespace(model=str(tmp_path), dtype="float32", device="cpu", num_requests=4, prompt_lens=[32, 64],
                              output_len=8, poisson_fraction=0.5, max_num_seqs=8, max_num_batched_tokens=256,
                              budget_s=1000.0, log_dir=str(tmp_path / "logs"))
    written = {}
    monkeypatch.setattr(gpu_served, "parse_args", lambda: args)
    monkeypatch.setattr(gpu_served, "start_local", lambda *a, **k: _Deployment())
    monkeypatch.setattr(gpu_served, "wait_healthy", lambda *a: None)
    monkeypatch.setattr(gpu_served, "load", lambda *a, **k: {})
    monkeypatch.setattr(gpu_served, "greedy_tokens", lambda *a: [["token_id:1", "token_id:2"]])
    monkeypatch.setattr(gpu_served, "write_result", lambda name, payload: written.update(payload))
    return written, monkeypatch


def test_a_sigterm_mid_setup_keeps_the_runs_that_ended(fakes):
    written, monkeypatch = fakes
    calls = []

    def measure(deployment, served, args, prompt_len, rate, seed, has_pulls):
        calls.append((prompt_len, rate))
        if len(calls) == 3:
            raise gpu_served.Stopped("stopped by signal 15")
        return _run(prompt_len, rate, 100.0)

    monkeypatch.setattr(gpu_served, "measure", measure)
    assert gpu_served.main() == 1
    colocated = written["setups"]["colocated"]
    assert colocated["error"] == "stopped by signal 15" and _Deployment.stopped
    assert [(r["prompt_len"], r["rate_rps"]) for r in colocated["runs"]] == [(32, None), (32, 0.5 * 100.0 / 8)]
    assert "1P+1D" not in written["setups"] and written["comparisons"] == []


def test_both_setups_are_compared_run_by_run_at_colocateds_rate(fakes):
    written, monkeypatch = fakes
    tok_s = {0: 100.0, 1: 120.0}  # colocated, then 1P+1D
    setups = []

    def measure(deployment, served, args, prompt_len, rate, seed, has_pulls):
        setups.append(has_pulls)
        return _run(prompt_len, rate, tok_s[int(has_pulls)])

    monkeypatch.setattr(gpu_served, "measure", measure)
    assert gpu_served.main() == 0
    assert [(c["prompt_len"], c["rate_rps"], c["pd_over_colocated"]) for c in written["comparisons"]] == [
        (32, None, 1.2), (32, 6.25, 1.2), (64, None, 1.2), (64, 6.25, 1.2)]
    assert written["greedy_equal"] is True and setups == [False] * 4 + [True] * 4
