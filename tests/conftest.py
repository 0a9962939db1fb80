"""Shared fixtures: the tiny random-weight models (made once, cached across runs). Free ports and
waiting for health come from pdserve.ports (free_port, wait_http_ok), defined once there;
held_port, here, keeps a port bound for a test that must name an address nobody serves. Also
shared: dealer (a proxy's DEALER socket on a node's or a KV holder's ZMQ address) and
UvicornServer (an ASGI app served on a thread, on a loopback socket bound before it starts)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import zmq

# NOTE: Triton decides at kernel definition whether to interpret, so this must run before any
# kernels module is imported. Without CUDA, the kernel tests then run Triton on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "models"

# Under pytest-xdist (make test runs most of the suite as `pytest -n 2`) each worker is a process
# of its own: it keeps torch to one thread (with torch's two threads per worker that part took
# 640 s on 2 cores, with one 542 s: two workers' OpenMP threads wait at barriers for a core), and
# it and the servers it starts draw ports from a range of their own (pdserve.ports
# PORT_RANGE_VARIABLE), so two workers never pick one port for servers that bind it seconds later.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    from pdserve import ports

    torch.set_num_threads(1)
    _share = ports.share_of_range(int(_WORKER.removeprefix("gw")),
                                  int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    if ports.PORT_RANGE_VARIABLE not in os.environ and _share is not None:
        os.environ[ports.PORT_RANGE_VARIABLE] = _share


_SESSION = pytest.StashKey["pytest.Session"]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_SESSION] = session


def pytest_terminal_summary(terminalreporter) -> None:
    """The machine the run was on, last in its output: a log then says which CPU (and which of the
    kernel levels) a pass or a failure was on."""
    from kernels.cpu.native import available_levels, cpu_name

    levels = ", ".join(level.name for level in available_levels()) or "none"
    terminalreporter.write_line(f"machine: {cpu_name()}, {os.cpu_count()} cores; "
                                f"kernel levels run: {levels}; torch {torch.__version__}")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """A pytest process that loaded NIXL (tests that read KV in this process) ends through
    kv_transfer.ucx.exit_now, with the session's exit status: its exit-time teardown is not safe
    (see there). pytest-xdist's workers exit on their own: the controller has their results then."""
    session = config.stash.get(_SESSION, None)
    if _WORKER or session is None or "nixl" not in sys.modules:
        return
    from kv_transfer.ucx import exit_now

    exit_now(int(session.exitstatus))


def cached_checkpoint(path: Path, modules: tuple[str, ...], libraries: tuple[str, ...],
                      make: Callable[[Path], object]) -> Path:
    """path as make(directory) writes it, unless a copy made by the same pdserve modules and library
    versions is there (a stamp holds their hash). One process at a time (a lock beside it: two
    pytest-xdist workers may want it at once); written beside and renamed, so a run stopped midway
    never leaves half a checkpoint behind."""
    import fcntl
    import importlib.metadata
    import shutil

    versions = " ".join(f"{name}={importlib.metadata.version(name)}" for name in libraries)
    code = b"".join((REPO / "pdserve" / name).read_bytes() for name in modules)
    code_hash = hashlib.sha256(code + f"{versions} {sys.version}".encode()).hexdigest()
    stamp = path / ".stamp"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f"{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        if stamp.exists() and stamp.read_text() == code_hash and (path / "model.safetensors").exists():
            return path
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        make(partial)
        (partial / ".stamp").write_text(code_hash)
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)
    return path


@contextlib.contextmanager
def held_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port bound (not listening) for the block: connecting to it is refused, and no server
    started in the meantime can take it, as it can take a port free_port only looked at."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        yield sock.getsockname()[1]


def dealer(address: str, keys=None, **options) -> zmq.Socket:
    """A DEALER connected to tcp://address as a proxy's (LINGER 0: closing never waits), a CURVE
    client of the cluster when given its keys (engine.protocol.curve_keys), with options set as
    pyzmq socket attributes (rcvhwm=1) before it connects. The caller closes it."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        setattr(socket, name, value)
    if keys is not None:
        socket.curve_serverkey, socket.curve_publickey = keys.server_public, keys.client_public
        socket.curve_secretkey = keys.client_secret
    socket.connect(f"tcp://{address}")
    return socket


class UvicornServer:
    """app served by uvicorn on a daemon thread, on a 127.0.0.1 socket bound here (its port is
    known before start and no other server can take it); config: more uvicorn.Config fields."""

    def __init__(self, app, **config) -> None:
        import uvicorn

        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def start(self, timeout_s: float = 10.0) -> None:
        """Start serving; return once uvicorn says it has started (RuntimeError after timeout_s)."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop serving; for a proxy's app, then assert that every request it took on came to
        an answered end (see assert_ledger_closed)."""
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()
        ledger = getattr(getattr(self.server.config.app, "state", None), "ledger", None)
        if ledger is not None:
            assert_ledger_closed(ledger.num_open, ledger.ends["unanswered"], ledger.oldest_open())


# ---- the harness that tracks every request a proxy took on to its end ---------------------------


def live_processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line with spaces for NULs) of every live process (from /proc)."""
    processes = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # it ended meanwhile
        processes[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmdline)
    return processes


def is_alive(pid: int) -> bool:
    """Whether pid runs (exists, and not a zombie waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a Python child process of a test: the repo first on its PYTHONPATH, the
    path the suite was given kept behind it (where a machine installs packages beside the image's,
    as the GPU check does), then extra."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def assert_ledger_closed(num_open: int, num_unanswered: int, oldest_open: object = ()) -> None:
    """No request is open any more and none ended without an answer (proxy.ledger)."""
    assert num_unanswered == 0, f"{num_unanswered} requests ended without an answer"
    assert num_open == 0, f"{num_open} requests never ended; the oldest (id, seconds open): {oldest_open}"


def assert_every_request_answered(base_url: str, wait_s: float = 10.0) -> None:
    """The proxy at base_url (its /metrics) holds no open request, waiting up to wait_s for the
    ends under way, and none of its requests ended unanswered. A proxy that no longer answers
    (a test stopped it) is not checked."""
    import httpx

    deadline = time.monotonic() + wait_s
    while True:
        try:
            text = httpx.get(base_url + "/metrics", timeout=5.0).text
        except httpx.HTTPError:
            return
        num_open = _sample(text, "pdserve_requests_open")
        if num_open == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert_ledger_closed(num_open, _sample(text, "pdserve_request_ends_total", {"outcome": "unanswered"}))


def _sample(metrics_text: str, name: str, labels: dict[str, str] | None = None) -> int:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and sample.labels == (labels or {}):
                return int(sample.value)
    raise AssertionError(f"{name} {labels or ''} is not among the proxy's metrics")


@pytest.fixture(scope="session", autouse=True)
def _every_deployment_answered_every_request() -> Iterator[None]:
    """Every deployment (pdserve.launcher.Deployment) a test stops is checked first: its proxy
    answered every request it took on (assert_every_request_answered)."""
    from pdserve.launcher import Deployment

    real_stop = Deployment.stop

    def checked_stop(self) -> None:
        try:
            if self.cluster.process("proxy").poll() is None:
                assert_every_request_answered(self.base_url)
        finally:
            real_stop(self)

    Deployment.stop = checked_stop
    yield
    Deployment.stop = real_stop


def _cached_model(preset: str) -> Path:
    """The preset in .cache/models/<preset>-seed0, made once per make-model code and libraries."""
    from pdserve.make_model import make_model

    return cached_checkpoint(CACHE / f"{preset}-seed0", ("make_model.py", "make_tokenizer.py"),
                             ("torch", "transformers", "tokenizers"),
                             lambda out: make_model(out, preset, seed=0, show_progress=False))


def poison_sampling(sampler, request_id: str, error: Exception) -> None:
    """Make the engine's sampler raise error for every batch that holds request_id, on both of its
    ways to a token: from logits (sample) and from the greedy head's argmax (tokens_of)."""
    for name in ("sample", "tokens_of"):
        real = getattr(sampler, name)

        def poisoned(values, requests, real=real):
            if any(r.request_id == request_id for r in requests):
                raise error
            return real(values, requests)

        setattr(sampler, name, poisoned)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return _cached_model("tiny")


@pytest.fixture(scope="session")
def qwen2_tiny_model_dir() -> Path:
    return _cached_model("qwen2-tiny")


@pytest.fixture(scope="session")
def mistral_tiny_model_dir() -> Path:
    return _cached_model("mistral-tiny")


@pytest.fixture(autouse=True)
def _ucx_settings_stay_in_their_test() -> Iterator[None]:
    """A NIXL connector made in this process sets UCX_* defaults in os.environ (set_ucx_defaults:
    UCX_NET_DEVICES=lo for a loopback node); servers started later inherit the environment and
    take such a setting for the operator's. Measured: tests/nodes then tests/e2e in one run left
    the multi-host nodes' UCX on lo alone, and every KV handshake between hosts failed."""
    before = {name: value for name, value in os.environ.items() if name.startswith("UCX_")}
    yield
    for name in [name for name in os.environ if name.startswith("UCX_") and name not in before]:
        del os.environ[name]
    os.environ.update(before)


@pytest.fixture(autouse=True)
def _root_logger_stays_as_it_was() -> Iterator[None]:
    """A test that configures logging (cli.main does, on the sys.stderr pytest captures) leaves
    no handler of its own on the root logger: one left on a captured stream outlives the capture,
    and a later test's proxy thread logging through it printed "--- Logging error ---". pytest's
    own capture handlers are left to pytest."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in before and not type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture
def gate_up_calls(monkeypatch) -> list:
    """(rows, gated) of each float32 gate/up kernel run (kernels/csrc/f32_gate_up.c), in order."""
    from kernels.cpu.linear import ProjectionKernels

    calls, real = [], ProjectionKernels.gate_up

    def spy(self, x, w, gated):
        calls.append((x.shape[0], gated))
        return real(self, x, w, gated)

    monkeypatch.setattr(ProjectionKernels, "gate_up", spy)
    return calls
