"""The container image built and run: it answers the README's chat from outside the container.
Not part of `make test` (it needs a container runtime and a base image, and takes minutes): run
it by name where a runtime is at hand (docs/deployment.md#container):

    PDSERVE_CONTAINER_RUNTIME="podman --runtime runc" PDSERVE_CONTAINER_BASE=localhost/debian:bookworm \
        .venv/bin/python -m pytest tests/deploy/container_check.py"""

from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.deploy.test_container import CHAT, ROOT, USER_ID


def _runtime() -> list[str]:
    """PDSERVE_CONTAINER_RUNTIME (e.g. `podman --runtime runc`), else podman or docker: one that answers."""
    chosen = os.environ.get("PDSERVE_CONTAINER_RUNTIME")
    candidates = [shlex.split(chosen)] if chosen else [[name] for name in ("podman", "docker") if shutil.which(name)]
    for runtime in candidates:
        probe = subprocess.run([*runtime, "info"], capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            return runtime
    pytest.fail(f"no working container runtime among {candidates or 'podman, docker'}")


def _limit_flags() -> list[str]:
    """--ulimit at this process's own hard limits: a runtime asks for more by default, which a
    sandbox without CAP_SYS_RESOURCE refuses (nproc also at most pid_max, which podman keeps)."""
    flags = []
    for name, limit in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        hard = resource.getrlimit(limit)[1]
        if name == "nproc" and Path("/proc/sys/kernel/pid_max").exists():
            hard = min(hard if hard != resource.RLIM_INFINITY else 1 << 30,
                       int(Path("/proc/sys/kernel/pid_max").read_text()))
        if hard != resource.RLIM_INFINITY:
            flags += ["--ulimit", f"{name}={hard}:{hard}"]
    return flags


def _context(tmp_path: Path) -> Path:
    """A build context of what the Dockerfile copies, plus PDSERVE_CONTAINER_WHEELS as wheels/."""
    context = tmp_path / "context"
    context.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "_native_*.so")
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, context / name)
    for name in ("engine", "kernels", "kv_transfer", "node", "prefill_node", "decode_node", "proxy", "pdserve"):
        shutil.copytree(ROOT / name, context / name, ignore=ignore)
    wheels = os.environ.get("PDSERVE_CONTAINER_WHEELS")
    if wheels:
        shutil.copytree(wheels, context / "wheels")
    return context


def _build(runtime: list[str], context: Path, tag: str) -> None:
    base = os.environ.get("PDSERVE_CONTAINER_BASE", "python:3.11-slim")
    if subprocess.run([*runtime, "image", "inspect", base], capture_output=True, timeout=60).returncode != 0:
        pytest.fail(f"base image {base} is not on this machine: pull it, or make one and name it in "
                    "PDSERVE_CONTAINER_BASE (docs/deployment.md#container)")
    argv = [*runtime, "build", *_limit_flags(), "--network", "host", "--build-arg", f"BASE_IMAGE={base}", "-t", tag]
    if runtime[0] == "podman":
        argv += ["--format", "docker"]  # OCI images drop HEALTHCHECK
    if os.environ.get("PDSERVE_CONTAINER_WHEELS"):
        argv += ["--build-arg", "PIP_NO_INDEX=1"]
    started = time.monotonic()
    done = subprocess.run([*argv, str(context)], capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    print(f"built {tag} in {time.monotonic() - started:.0f} s")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_healthy(runtime: list[str], name: str, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        state = subprocess.run([*runtime, "inspect", "--format", "{{.State.Running}}", name], capture_output=True,
                               text=True, timeout=60).stdout.strip()
        assert state == "true", f"the container stopped: {_logs(runtime, name)}"
        time.sleep(2)
    pytest.fail(f"{url} not 200 within {timeout_s:.0f} s: {_logs(runtime, name)}")


def _logs(runtime: list[str], name: str, num_chars: int | None = 4000) -> str:
    """The container's output, its last num_chars characters (None: all)."""
    done = subprocess.run([*runtime, "logs", name], capture_output=True, text=True, timeout=60)
    text = done.stdout + done.stderr
    return text if num_chars is None else text[-num_chars:]


def _exec(runtime: list[str], name: str, script: str) -> subprocess.CompletedProcess:
    return subprocess.run([*runtime, "exec", name, "sh", "-c", script], capture_output=True, text=True, timeout=120)


def _chat(port: int) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(CHAT).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.status, json.loads(response.read())


def _healthcheck_passes(runtime: list[str], name: str) -> bool:
    if runtime[0] == "podman":
        return subprocess.run([*runtime, "healthcheck", "run", name], capture_output=True, timeout=60).returncode == 0
    deadline = time.monotonic() + 60  # docker runs the check itself, every --interval
    while time.monotonic() < deadline:
        status = subprocess.run([*runtime, "inspect", "--format", "{{.State.Health.Status}}", name],
                                capture_output=True, text=True, timeout=60).stdout.strip()
        if status != "starting":
            return status == "healthy"
        time.sleep(2)
    return False


@pytest.mark.timeout(3600)
def test_the_image_answers_a_chat_from_outside_the_container(tmp_path):
    """PDSERVE_CONTAINER_IMAGE: run that image (already built) instead of building one."""
    runtime = _runtime()
    given = os.environ.get("PDSERVE_CONTAINER_IMAGE")
    tag, name = given or f"localhost/pdserve-test:{uuid.uuid4().hex[:8]}", f"pdserve-test-{uuid.uuid4().hex[:8]}"
    try:
        if not given:
            _build(runtime, _context(tmp_path), tag)
        size = subprocess.run([*runtime, "image", "inspect", "--format", "{{.Size}}", tag], capture_output=True,
                              text=True, timeout=60).stdout.strip()
        print(f"image size: {int(size) / 1e9:.2f} GB")
        port = _free_port()
        # The image's own command, as `docker run -p 8000:8000 IMAGE` starts it.
        subprocess.run([*runtime, "run", "-d", *_limit_flags(), "--name", name, "-p", f"127.0.0.1:{port}:8000", tag],
                       check=True, capture_output=True, timeout=120)
        _wait_healthy(runtime, name, f"http://127.0.0.1:{port}/health", timeout_s=600)
        status, body = _chat(port)
        assert status == 200 and "Paris" in body["choices"][0]["message"]["content"], body
        _check_inside(runtime, name)
    finally:
        subprocess.run([*runtime, "rm", "-f", name], capture_output=True, timeout=120)
        if not given:
            subprocess.run([*runtime, "rmi", "-f", tag], capture_output=True, timeout=300)


def _check_inside(runtime: list[str], name: str) -> None:
    """The running container's health check, user, caches, libraries and kernels."""
    assert _healthcheck_passes(runtime, name), "the image's HEALTHCHECK failed on a healthy server"
    owned = _exec(runtime, name, 'id -u && touch "$HOME/w" "$PDSERVE_CACHE_DIR/w" "$TRITON_CACHE_DIR/w"')
    assert owned.returncode == 0 and owned.stdout.split() == [USER_ID], owned.stderr
    cuda = _exec(runtime, name, "pip list 2>/dev/null | grep -i -E '^(triton|nvidia-|nixl-cu13) ' || true")
    assert cuda.stdout.strip() == "", f"CUDA libraries in the CPU image: {cuda.stdout}"
    if "avx2" in Path("/proc/cpuinfo").read_text():
        assert "no compiled CPU kernels" not in _logs(runtime, name, None), "the nodes run without the CPU kernels"
