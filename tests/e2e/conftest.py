"""End-to-end fixtures: real node and proxy processes on 127.0.0.1, always stopped (by pid)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.launcher import Deployment, start_local, wait_healthy


@pytest.fixture
def deployment_factory(tmp_path):
    """start(model_dir, **start_local kwargs) -> a healthy Deployment; every one started is
    stopped when the test ends, also when it fails."""
    started: list[Deployment] = []

    def start(model_dir: Path, timeout_s: float = 120.0, **kwargs) -> Deployment:
        log_dir = tmp_path / f"logs{len(started)}"
        log_dir.mkdir()
        deployment = start_local(model_dir, log_dir=log_dir, pin_cpus=False, **kwargs)
        started.append(deployment)
        wait_healthy(deployment, timeout_s)
        return deployment

    yield start
    for deployment in started:
        deployment.stop()
