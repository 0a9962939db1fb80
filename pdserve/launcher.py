"""`pdserve up`: start prefill nodes, decode nodes and the proxy as separate processes on this
machine, wait until all are healthy, print the endpoint, and stop them all on Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass
class Cluster:
    """The processes of one local deployment; stop() ends every one of them (by pid)."""

    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def start(self, name: str, argv: list[str], log_dir: Path | None) -> subprocess.Popen:
        stdout = open(log_dir / f"{name}.log", "wb") if log_dir else None  # noqa: SIM115
        proc = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
                                start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def dead(self) -> list[str]:
        return [f"{name} (exit {p.returncode})" for name, p in self.procs if p.poll() is not None]

    def stop(self, timeout_s: float = 10.0) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for _, proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the child leads its own session: only what we started
    except ProcessLookupError:
        pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the tiny default model, made if missing)")
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill nodes (0: colocated decode nodes)")
    parser.add_argument("--decode", type=int, default=1, help="number of decode nodes")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--transfer-backend", default="nixl", choices=["nixl", "gloo"])
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--log-dir", default=None, help="write each process's log here")
    parser.add_argument("--ready-timeout-s", type=float, default=180.0)
    parser.add_argument("--served-model-name", default=None)


def main(args: argparse.Namespace) -> int:
    from pdserve.default_model import ensure_default_model

    if args.decode < 1:
        print("pdserve up: --decode must be >= 1", file=sys.stderr)
        return 2
    model_dir = Path(args.model) if args.model else ensure_default_model()
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster()
    stop = _install_signal_handlers()
    try:
        _start_all(cluster, args, model_dir, log_dir)
        if not _wait_ready(cluster, args, stop):
            return 1
        print(f"pdserve is ready: http://{args.host}:{args.port}/v1 (model {model_dir}); Ctrl-C stops it", flush=True)
        while not stop.is_set and not cluster.dead():
            time.sleep(0.2)
        if cluster.dead():
            print(f"pdserve up: process ended: {', '.join(cluster.dead())}", file=sys.stderr)
            return 1
        return 0
    finally:
        cluster.stop()


def _start_all(cluster: Cluster, args: argparse.Namespace, model_dir: Path, log_dir: Path | None) -> None:
    cpus = _cpu_plan(args.prefill + args.decode)
    common = ["--model", str(model_dir), "--host", args.host, "--dtype", args.dtype,
              "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--transfer-backend", args.transfer_backend]
    if args.kv_cache_memory_gb:
        common += ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb)]
    pdserve = [sys.executable, "-m", "pdserve.cli"]
    prefill_addrs, decode_addrs = [], []
    for i in range(args.prefill):
        port = free_port(args.host)
        prefill_addrs.append(f"{args.host}:{port}")
        cluster.start(f"prefill{i}", pdserve + ["prefill", *common, "--port", str(port),
                      "--node-id", f"prefill{i}", "--cpus", cpus[i]], log_dir)
    for i in range(args.decode):
        port = free_port(args.host)
        decode_addrs.append(f"{args.host}:{port}")
        role = "decode" if args.prefill else "both"
        cluster.start(f"decode{i}", pdserve + ["decode", *common, "--port", str(port), "--role", role,
                      "--node-id", f"decode{i}", "--cpus", cpus[args.prefill + i]], log_dir)
    proxy_argv = pdserve + ["proxy", "--model", str(model_dir), "--host", args.host, "--port", str(args.port),
                            "--decode", ",".join(decode_addrs)]
    if prefill_addrs:
        proxy_argv += ["--prefill", ",".join(prefill_addrs)]
    if args.served_model_name:
        proxy_argv += ["--served-model-name", args.served_model_name]
    cluster.start("proxy", proxy_argv, log_dir)


def _cpu_plan(num_nodes: int) -> list[str]:
    """Give each node its own cores where the machine has enough; else all nodes share."""
    cores = sorted(os.sched_getaffinity(0))
    if num_nodes <= 0:
        return []
    if len(cores) < num_nodes:
        return [",".join(map(str, cores))] * num_nodes
    per_node = len(cores) // num_nodes
    return [",".join(map(str, cores[i * per_node:(i + 1) * per_node])) for i in range(num_nodes)]


def _wait_ready(cluster: Cluster, args: argparse.Namespace, stop: "_StopFlag") -> bool:
    url = f"http://{args.host}:{args.port}/health"
    deadline = time.monotonic() + args.ready_timeout_s
    print(f"pdserve up: starting {args.prefill} prefill + {args.decode} decode nodes and the proxy ...", flush=True)
    while time.monotonic() < deadline and not stop.is_set:
        if cluster.dead():
            print(f"pdserve up: process ended during start-up: {', '.join(cluster.dead())}", file=sys.stderr)
            return False
        if health_ok(url):
            return True
        time.sleep(0.25)
    if not stop.is_set:
        print(f"pdserve up: not healthy after {args.ready_timeout_s:.0f} s ({url})", file=sys.stderr)
    return False


def health_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, json.JSONDecodeError):
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class _StopFlag:
    def __init__(self) -> None:
        self.is_set = False

    def set(self, *_: object) -> None:
        self.is_set = True


def _install_signal_handlers() -> _StopFlag:
    flag = _StopFlag()
    signal.signal(signal.SIGINT, flag.set)
    signal.signal(signal.SIGTERM, flag.set)
    return flag
