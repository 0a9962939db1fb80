"""Fixtures for tests of the benchmark scripts, which are files under benchmarks/, not modules."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def vs_vllm():
    return _benchmark("vs_vllm")


@pytest.fixture(scope="module")
def profile_serve():
    return _benchmark("profile_serve")


@pytest.fixture(autouse=True)
def _results_elsewhere(tmp_path, monkeypatch):
    """Benchmark scripts run by these tests write their result files to a temporary folder, never
    into benchmarks/results/ (benchmarks/results_io.py)."""
    monkeypatch.setenv("PDSERVE_RESULTS_DIR", str(tmp_path / "results"))
