"""`pdserve up`: start prefill nodes, decode nodes and the proxy as separate processes on this
machine, wait until all are healthy, print the endpoint, restart any that ends on its own (with
backoff; the rest keep serving), and stop them all, in drain order, on Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.cpu_quota import HostLoad, usable_cores
from pdserve.huge_heap import huge_heap_environ_here
from pdserve.settings import CONFIG_ENV
from pdserve.standby import NODE_COMMANDS as STANDBY_COMMANDS

logger = logging.getLogger(__name__)


# NOTE: the order processes stop in: the proxy first (it stops accepting and lets open streams
# finish within its grace period while the nodes still serve them), then the prefill nodes, then
# the decode nodes (whose running requests the proxy no longer waits for).
_STOP_ORDER = ("proxy", "prefill", "decode")


# How the launcher runs pdserve's commands; a standby process (pdserve.standby) becomes these.
PDSERVE_COMMAND = (sys.executable, "-m", "pdserve.cli")


@dataclass
class Cluster:
    """The processes of one local deployment, each restartable with the argv it started with;
    stop() ends every one of them (by process group: each child leads its own session)."""

    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    argvs: dict[str, list[str]] = field(default_factory=dict)
    envs: dict[str, dict[str, str]] = field(default_factory=dict)  # each process's additions to the environment
    log_dir: Path | None = None
    files: list[Path] = field(default_factory=list)  # removed by stop() (core-lending flags)
    standby: subprocess.Popen | None = None  # a node process with its imports done (pdserve.standby)

    def start(self, name: str, argv: list[str], log_dir: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        self.log_dir = log_dir or self.log_dir
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        stdout = open(self.log_dir / f"{name}.log", "ab") if self.log_dir else None  # noqa: SIM115
        # NOTE: children get every setting on their command line; the launcher's config file is
        # not theirs (its flat keys are `pdserve up`'s).
        self.envs[name] = dict(env or {})
        child_env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV} | self.envs[name]
        proc = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
                                start_new_session=True, env=child_env)
        if stdout:
            stdout.close()  # the child holds its own copy
        self.argvs[name] = list(argv)
        self.procs = [(n, p) for n, p in self.procs if n != name] + [(name, proc)]
        return proc

    def restart(self, name: str) -> subprocess.Popen:
        """Start name again with its argv (same ports); the old process must have ended. A node
        becomes the standby process where one is up (start_standby), which is then replaced."""
        argv = self.argvs[name]
        standby, self.standby = self.standby, None
        if (standby is not None and standby.poll() is None and tuple(argv[:3]) == PDSERVE_COMMAND
                and argv[3] in STANDBY_COMMANDS):
            log = str(self.log_dir / f"{name}.log") if self.log_dir else None
            order = {"argv": argv[3:], "env": self.envs.get(name) or {}, "log": log}
            try:
                standby.stdin.write(json.dumps(order).encode() + b"\n")
                standby.stdin.close()
            except OSError:  # it died meanwhile: a fresh start below
                pass
            else:
                self.procs = [(n, p) for n, p in self.procs if n != name] + [(name, standby)]
                self.start_standby()
                return standby
        elif standby is not None:
            self.standby = standby
        return self.start(name, argv, env=self.envs.get(name))

    @property
    def has_standby(self) -> bool:
        return self.standby is not None and self.standby.poll() is None

    def start_standby(self) -> None:
        """Have a standby node process ready for restart() (pdserve.standby), unless one is up."""
        if self.standby is not None and self.standby.poll() is None:
            return
        env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
        self.standby = subprocess.Popen([sys.executable, "-m", "pdserve.standby"], stdin=subprocess.PIPE,
                                        start_new_session=True, env=huge_heap_environ_here(env) or env)

    def process(self, name: str) -> subprocess.Popen:
        return dict(self.procs)[name]

    def dead(self) -> list[str]:
        return [f"{name} (exit {p.returncode})" for name, p in self.procs if p.poll() is not None]

    def dead_names(self) -> list[str]:
        return [name for name, p in self.procs if p.poll() is not None]

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM each group of processes in _STOP_ORDER, waiting up to timeout_s for each
        group before SIGKILL."""
        for kind in _STOP_ORDER:
            group = [p for name, p in self.procs if name.startswith(kind)]
            for proc in group:
                if proc.poll() is None:
                    _signal_group(proc, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for proc in group:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(proc, signal.SIGKILL)
                    proc.wait()
        if self.standby is not None:
            _signal_group(self.standby, signal.SIGKILL)  # it serves nothing yet
            self.standby.wait()
            self.standby = None
        for path in self.files:
            path.unlink(missing_ok=True)


@dataclass
class Supervisor:
    """Restarts processes of a cluster that end on their own, with exponential backoff per
    process (initial_backoff_s doubling up to max_backoff_s; back to the start after a process
    has run healthy for reset_after_s). Driven by tick() from the launcher's loop."""

    cluster: Cluster
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 30.0
    reset_after_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    _backoff_s: dict[str, float] = field(default_factory=dict)
    _restart_at: dict[str, float] = field(default_factory=dict)
    _started_at: dict[str, float] = field(default_factory=dict)
    num_restarts: int = 0
    # Keep a standby node process ready (Cluster.start_standby): a restart then skips the imports.
    # A new standby starts standby_after_s after the last restart, not beside the restarting node
    # (its imports took a core from that node's start on two cores), and once the host has been
    # quiet (host_load at most _QUIET_HOST_SHARE) for standby_when_quiet_s, or standby_at_latest_s
    # after it was due: its imports (seconds of CPU) took a core from the first requests after ready.
    keep_standby: bool = False
    standby_after_s: float = 5.0
    standby_when_quiet_s: float = 1.0
    standby_at_latest_s: float = 15.0
    host_load: Callable[[], float | None] | None = None  # None: HostLoad() (engine.cpu_quota)
    _standby_due_at: float | None = None
    _quiet_since: float | None = None

    def tick(self) -> list[str]:
        """Schedule or carry out restarts; returns a line for each event (for the console)."""
        now, events = self.clock(), []
        last_restart = max(self._started_at.values(), default=-math.inf)
        if (self.keep_standby and not self._restart_at and now - last_restart >= self.standby_after_s
                and not self.cluster.has_standby and self._host_quiet(now)):
            self.cluster.start_standby()
            self._standby_due_at = self._quiet_since = None
        for name in self.cluster.dead_names():
            if name not in self._restart_at:
                code = self.cluster.process(name).returncode
                backoff = self._next_backoff(name, now)
                self._restart_at[name] = now + backoff
                events.append(f"{name} ended (exit {code}); restarting in {backoff:g} s")
            elif now >= self._restart_at[name]:
                del self._restart_at[name]
                had_standby = self.cluster.standby is not None
                proc = self.cluster.restart(name)
                self._started_at[name] = now
                self.num_restarts += 1
                how = "the standby process" if had_standby and self.cluster.standby is not proc else "a new process"
                events.append(f"{name} restarted (pid {proc.pid}, {how})")
        return events

    def _host_quiet(self, now: float) -> bool:
        """Whether the host has been quiet for standby_when_quiet_s, or the standby has waited
        standby_at_latest_s (counted from the first call since the last start)."""
        if self.host_load is None:
            self.host_load = HostLoad()
        share = self.host_load()
        if self._standby_due_at is None:
            self._standby_due_at = now
        if share is None or share > _QUIET_HOST_SHARE:
            self._quiet_since = None
        elif self._quiet_since is None:
            self._quiet_since = now
        return (now - self._standby_due_at >= self.standby_at_latest_s
                or (self._quiet_since is not None and now - self._quiet_since >= self.standby_when_quiet_s))

    def _next_backoff(self, name: str, now: float) -> float:
        ran_s = now - self._started_at.get(name, now)
        previous = self._backoff_s.get(name)
        if previous is None or ran_s >= self.reset_after_s:
            backoff = self.initial_backoff_s
        else:
            backoff = min(previous * 2, self.max_backoff_s)
        self._backoff_s[name] = backoff
        return backoff


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # the child leads its own session: only what we started


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (default: models/smollm2, SmolLM2-135M-Instruct, made if missing)")
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill nodes (0: colocated decode nodes)")
    parser.add_argument("--decode", type=int, default=1, help="number of decode nodes")
    parser.add_argument("--host", default="127.0.0.1", help="the proxy's HTTP address (0.0.0.0: every interface, "
                        "as in a container); the nodes stay on --node-host")
    parser.add_argument("--node-host", default=None,
                        help="the address the nodes listen on and the proxy reaches them at (default: --host, or "
                             "127.0.0.1 where --host is a wildcard such as 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8000)
    # Passed on to every node only when given: each default is the node's own (pdserve decode --help).
    for flag, kind in _NODE_FLAGS:
        parser.add_argument(flag, type=kind, default=None, help="per node (default: the node's)")
    for flag in _NODE_SWITCHES:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                            help="per node (default: the node's)")
    parser.add_argument("--gpus", default=None,
                        help="GPUs for the nodes, as CUDA_VISIBLE_DEVICES names them (e.g. 0,1,2,3): node i (prefill "
                             "nodes first) runs on the i-th, round robin; nodes sharing a GPU split its memory "
                             "(--gpu-memory-utilization). Default: every visible GPU, unless --device cpu")
    parser.add_argument("--prefill-gpus", default=None, help="GPUs for the prefill nodes alone (as --gpus)")
    parser.add_argument("--prefill-tp", type=int, default=1,
                        help="tensor-parallel size of each prefill node: its model split over this many processes "
                             "(GPUs on CUDA)")
    parser.add_argument("--decode-tp", type=int, default=1,
                        help="tensor-parallel size of each decode node (any size beside --prefill-tp's: KV moves "
                             "between any two; on GPUs, above 1 only with --prefill 0 for now)")
    parser.add_argument("--decode-gpus", default=None, help="GPUs for the decode nodes alone (as --gpus)")
    parser.add_argument("--log-format", choices=("text", "json"), default=None,
                        help="every process's log lines (default: text)")
    parser.add_argument("--log-dir", default=None, help="write each process's log here")
    parser.add_argument("--ready-timeout-s", type=float, default=180.0)
    parser.add_argument("--standby", action=argparse.BooleanOptionalAction, default=True,
                        help="keep one node process ready with its imports done (~300 MB), so that a node that "
                             "dies is back in the time its model takes to load")
    parser.add_argument("--lend-cores", action=argparse.BooleanOptionalAction, default=None,
                        help="decode node i runs on prefill node i's cores too while that one has nothing to "
                             "prefill (node.core_lending), where nodes have cores of their own and there are at "
                             "least as many prefill nodes as decode nodes (default: for models whose weights take "
                             "at least 64 MB in the nodes' dtype)")
    parser.add_argument("--metrics-port-base", type=int, default=None,
                        help="node i (prefill nodes first) serves /health, /ready and /metrics on this port + i "
                             "(default: free ports, printed when ready); the proxy's /metrics has the nodes' "
                             "vllm:* series too")
    parser.add_argument("--proxy-cores", type=int, default=None,
                        help="cores kept off the nodes for the proxy and its clients (default: 1 for models whose "
                             "weights take under 10 MB in the nodes' dtype when every node still gets a core "
                             "of its own, else 0)")
    for flag, kind in _PROXY_FLAGS:
        parser.add_argument(flag, type=kind, default=None, help="for the proxy (default: the proxy's)")
    for flag in _PROXY_SWITCHES:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                            help="for the proxy (default: the proxy's)")


_NODE_FLAGS = (("--dtype", str), ("--transfer-backend", str), ("--kv-cache-memory-gb", float), ("--num-blocks", int),
               ("--max-num-seqs", int), ("--max-num-batched-tokens", int), ("--kernel-backend", str),
               ("--device", str), ("--gpu-memory-utilization", float), ("--grammar-threads", int),
               ("--grammar-compile-timeout-s", float), ("--max-model-len", int))


_NODE_SWITCHES = ("--enable-prefix-caching", "--enforce-eager", "--async-scheduling")


_PROXY_FLAGS = (("--served-model-name", str), ("--chat-template", str), ("--api-key", str),
                ("--local-prefill-min-wait-s", float), ("--routing", str), ("--slo-ttft-ms", float),
                ("--header-timeout-s", float), ("--keep-alive-timeout-s", float), ("--min-upload-bytes-per-s", float),
                ("--upload-rate-window-s", float), ("--max-client-uploads", int), ("--max-client-requests", int))


_PROXY_SWITCHES = ("--strict-fields",)


def _check_node_addresses(args: argparse.Namespace) -> None:
    """--node-host not a wildcard; --metrics-port-base's ports in range and free on the nodes' host now."""
    if (args.node_host or "") in _WILDCARDS[:2]:
        raise ValueError(f"--node-host {args.node_host}: an address the proxy can reach the nodes at, not a wildcard")
    if args.metrics_port_base is None:
        return
    host = args.node_host or nodes_host(args.host)
    names = _node_names(args.prefill, args.decode)
    if not 0 < args.metrics_port_base <= 65535 - len(names) + 1:
        raise ValueError(f"--metrics-port-base {args.metrics_port_base}: the nodes' ports must lie in 1-65535")
    for i, name in enumerate(names):
        port = args.metrics_port_base + i
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise ValueError(f"--metrics-port-base {args.metrics_port_base}: port {port} ({name}'s /metrics) "
                                 f"on {host}: {exc.strerror or exc}") from None


def _given(args: argparse.Namespace, flags, switches=()) -> list[str]:
    """The flags (and on/off switches) of these lists the user set, as command-line arguments
    for a child."""
    given = []
    for flag, _ in flags:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is not None:
            given += [flag, str(value)]
    for flag in switches:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is not None:
            given.append(flag if value else "--no-" + flag.removeprefix("--"))
    return given


def main(args: argparse.Namespace) -> int:
    from engine.model_files import check_model_dir
    from pdserve.default_model import ensure_default_model

    if args.decode < 1:
        print("pdserve up: --decode must be >= 1", file=sys.stderr)
        return 2
    model_dir = Path(args.model) if args.model else ensure_default_model()
    try:
        check_model_dir(model_dir)
    except ValueError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir) if args.log_dir else None  # made by the first process started
    stop = _install_signal_handlers()
    node_args, proxy_args = _given(args, _NODE_FLAGS, _NODE_SWITCHES), _given(args, _PROXY_FLAGS, _PROXY_SWITCHES)
    if args.log_format:
        node_args += ["--log-format", args.log_format]
        proxy_args += ["--log-format", args.log_format]
    try:
        gpus = gpu_plan(args.prefill, args.decode, _gpu_list(args.gpus, "--gpus"),
                        _gpu_list(args.prefill_gpus, "--prefill-gpus"), _gpu_list(args.decode_gpus, "--decode-gpus"),
                        visible_gpus() if args.device in (None, "auto", "cuda") else [],
                        prefill_tp=args.prefill_tp, decode_tp=args.decode_tp)
        _check_tp(args, gpus)
        _check_node_addresses(args)
    except ValueError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    print(f"pdserve up: starting {args.prefill} prefill + {args.decode} decode nodes and the proxy ...", flush=True)
    if any(gpus):
        print("pdserve up: GPUs " + ", ".join(f"{name} on {gpu}" for name, gpu in zip(_node_names(args.prefill,
                                                                                            args.decode), gpus)),
              flush=True)
    deployment = start_local(model_dir, num_prefill=args.prefill, num_decode=args.decode, host=args.host,
                             node_host=args.node_host,
                             port=args.port, node_args=node_args, proxy_args=proxy_args, log_dir=log_dir,
                             proxy_cores=args.proxy_cores, lend_cores=args.lend_cores, gpus=gpus,
                             tensor_parallel=(args.prefill_tp, args.decode_tp),
                             metrics_port_base=args.metrics_port_base)
    try:
        wait_healthy(deployment, args.ready_timeout_s, stop)
        pin_kv_capacity(deployment)
        print(f"pdserve is ready: {deployment.base_url}/v1 (model {model_dir}); Ctrl-C stops it", flush=True)
        for name, url in deployment.health_urls.items():
            print(f"  {name}: {url}/health, /ready, /metrics", flush=True)
        supervisor = Supervisor(deployment.cluster, keep_standby=args.standby)
        while not stop.is_set:
            for event in supervisor.tick():
                print(f"pdserve up: {event}", file=sys.stderr, flush=True)
            time.sleep(0.2)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 1
    except InterruptedError:
        return 0
    finally:
        deployment.stop()


@dataclass
class Deployment:
    """A running proxy with its nodes; base_url is the OpenAI endpoint (without /v1)."""

    cluster: Cluster
    base_url: str
    node_addresses: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    health_urls: dict[str, str] = field(default_factory=dict)  # node name -> its /health, /ready, /metrics server

    def logs(self, tail_chars: int = 3000) -> str:
        if not self.log_dir:
            return ""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail_chars:]}"
                         for p in sorted(self.log_dir.glob("*.log")))

    def stop(self) -> None:
        self.cluster.stop()


def start_local(
    model_dir: Path, *, num_prefill: int = 1, num_decode: int = 1, host: str = "127.0.0.1",
    port: int | None = None, node_args: list[str] | tuple[str, ...] = (),
    proxy_args: list[str] | tuple[str, ...] = (), log_dir: Path | None = None, pin_cpus: bool = True,
    proxy_cores: int | None = None, lend_cores: bool | None = None, gpus: list[str | None] | None = None,
    tensor_parallel: tuple[int, int] = (1, 1), metrics_port_base: int | None = None, node_host: str | None = None,
) -> Deployment:
    """Start nodes and proxy as separate processes (not waiting for health: see wait_healthy).
    On any failure the caller must stop() the returned deployment's cluster. pin_cpus: each node
    on cores of its own where there are enough (see _cpu_plan), proxy_cores of them (None: see
    auto_proxy_cores) left to the proxy and the clients. lend_cores: where nodes have cores of
    their own, prefill node i lends its cores to decode node i while it has nothing to prefill
    (node.core_lending); only with at least as many prefill nodes as decode nodes, so that no two
    decode nodes borrow the same cores. None: see auto_lend_cores. gpus: per node (prefill nodes
    first) the GPUs it runs on (gpu_plan), or None for the node's own default device.
    tensor_parallel: the tensor-parallel size of the prefill nodes and of the decode nodes.
    metrics_port_base: node i's health port (/metrics) is this + i (None: a free port). node_host:
    where the nodes listen and the proxy reaches them (None: see nodes_host)."""
    proxy_host, host = host, node_host or nodes_host(host)
    cluster = Cluster()
    cpus = []
    if pin_cpus:
        cores = usable_cores()  # the affinity, cut to a container's CPU limit
        if proxy_cores is None:
            proxy_cores = auto_proxy_cores(model_dir, len(cores), num_prefill + num_decode, _node_dtype(node_args))
        cpus = _cpu_plan(cores, num_prefill + num_decode, proxy_cores)
    pdserve = list(PDSERVE_COMMAND)
    common = ["--model", str(model_dir), "--host", host, *node_args]
    addresses: dict[str, str] = {}
    health_urls: dict[str, str] = {}
    if lend_cores is None:
        lend_cores = auto_lend_cores(model_dir, _node_dtype(node_args))
    lending = _lending_flags(cluster, cpus, num_prefill, num_decode) if lend_cores else {}
    for i in range(num_prefill + num_decode):
        kind = "prefill" if i < num_prefill else "decode"
        name = f"{kind}{i if kind == 'prefill' else i - num_prefill}"
        addresses[name] = f"{host}:{free_port(host)}"
        health_port = metrics_port_base + i if metrics_port_base else free_port(host)
        health_urls[name] = f"http://{host}:{health_port}"
        argv = pdserve + [kind, *common, "--port", addresses[name].rsplit(":", 1)[1], "--node-id", name,
                          "--health-port", str(health_port)]
        if kind == "decode" and not num_prefill:
            argv.append("--colocated")
        tp = tensor_parallel[kind == "decode"]
        if tp > 1:
            argv += ["--tensor-parallel-size", str(tp)]
        if cpus:
            argv += ["--cpus", cpus[i]]
        env = None
        if gpus and gpus[i] is not None:
            env = {"CUDA_VISIBLE_DEVICES": gpus[i]}
            argv += _gpu_flags(gpus, i, node_args)
        pair = i if kind == "prefill" else i - num_prefill
        if pair in lending:
            argv += (["--lend-flag", str(lending[pair])] if kind == "prefill"
                     else ["--borrow-flag", str(lending[pair]), "--borrow-cpus", cpus[pair]])
        cluster.start(name, argv, log_dir, env)
    http_port = port or free_port(proxy_host)
    proxy_argv = pdserve + ["proxy", "--model", str(model_dir), "--host", proxy_host, "--port", str(http_port),
                            "--decode", _joined(addresses, "decode"), *proxy_args]
    if num_prefill:
        proxy_argv += ["--prefill", _joined(addresses, "prefill")]
    cluster.start("proxy", proxy_argv, log_dir)
    reach = host if proxy_host in _WILDCARDS else proxy_host
    return Deployment(cluster, f"http://{_url_host(reach)}:{http_port}", addresses, log_dir, health_urls)


_WILDCARDS = ("0.0.0.0", "::", "")


def nodes_host(proxy_host: str) -> str:
    """Where `pdserve up`'s nodes listen by default: the proxy's host, or loopback where the proxy
    listens on every interface (only the proxy is published)."""
    return "127.0.0.1" if proxy_host in _WILDCARDS else proxy_host


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# The host's cores at most this busy (all of them together, between two supervisor ticks) count
# as quiet for starting the standby process.
_QUIET_HOST_SHARE = 0.3

# NOTE: the share of a GPU its nodes hold in all when several share it (split evenly).
_SHARED_GPU_UTILIZATION = 0.9


def gpu_plan(num_prefill: int, num_decode: int, gpus: list[str] | None = None, prefill_gpus: list[str] | None = None,
             decode_gpus: list[str] | None = None, visible: list[str] = (), prefill_tp: int = 1,
             decode_tp: int = 1) -> list[str | None]:
    """The GPUs of each node (prefill nodes first), as CUDA_VISIBLE_DEVICES names them: a node of
    tensor-parallel size k takes k consecutive GPUs, round robin over prefill_gpus / decode_gpus
    for its pool where given, else over gpus, else over the visible GPUs; all None (each node's
    own default device) where there are none. Raises ValueError when a pool has fewer GPUs than
    one of its nodes needs."""
    pool = gpus or list(visible)
    sizes = [prefill_tp] * num_prefill + [decode_tp] * num_decode
    if not (prefill_gpus or decode_gpus):
        return _gpu_groups(pool, sizes) if pool else [None] * len(sizes)
    prefill, decode = prefill_gpus or pool, decode_gpus or pool
    if (num_prefill and not prefill) or (num_decode and not decode):
        raise ValueError("--prefill-gpus / --decode-gpus: the other pool has no GPU; give it its own, or --gpus")
    return _gpu_groups(prefill, sizes[:num_prefill]) + _gpu_groups(decode, sizes[num_prefill:])


def _gpu_groups(pool: list[str], sizes: list[int]) -> list[str]:
    """Each node its size consecutive GPUs of pool, in turn; past the pool's end nodes share
    them from its start again."""
    groups, at = [], 0
    for size in sizes:
        if size > len(pool):
            raise ValueError(f"a node of tensor-parallel size {size} needs {size} GPUs; its pool has "
                             f"{len(pool)} ({','.join(pool)})")
        if at + size > len(pool):
            at = 0
        groups.append(",".join(pool[at : at + size]))
        at = (at + size) % len(pool)
    return groups


def _check_tp(args: argparse.Namespace, gpus: list[str | None]) -> None:
    for flag, size in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        if size < 1:
            raise ValueError(f"{flag} must be >= 1, got {size}")
    if args.prefill and max(args.prefill_tp, args.decode_tp) > 1 and any(gpus):
        raise ValueError("--prefill-tp / --decode-tp above 1 on GPUs serve colocated nodes only for now "
                         "(--prefill 0): prefill and decode nodes of split models exchange KV on the CPU only")


def _gpu_flags(gpus: list[str | None], index: int, node_args: list[str] | tuple[str, ...]) -> list[str]:
    """A node's flags for its GPU: the device, and where k nodes share it, a 1/k share of its
    memory (unless the user set a share or a budget)."""
    flags = [] if "--device" in node_args else ["--device", "cuda"]
    sharing = sum(1 for gpu in gpus if gpu == gpus[index])
    if sharing > 1 and "--gpu-memory-utilization" not in node_args and "--kv-cache-memory-gb" not in node_args:
        flags += ["--gpu-memory-utilization", f"{_SHARED_GPU_UTILIZATION / sharing:.4f}"]
    return flags


def _gpu_list(text: str | None, flag: str) -> list[str] | None:
    if text is None:
        return None
    ids = [part.strip() for part in text.split(",") if part.strip()]
    if not ids:
        raise ValueError(f"{flag} {text!r} names no GPU (e.g. {flag} 0,1)")
    return ids


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as a child's CUDA_VISIBLE_DEVICES names them: that
    variable's entries where it is set, else one index per GPU nvidia-smi lists (none without it)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [part.strip() for part in listed.split(",") if part.strip() and part.strip() != "-1"]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(line for line in out.splitlines() if line.startswith("GPU "))]


def _node_names(num_prefill: int, num_decode: int) -> list[str]:
    return [f"prefill{i}" for i in range(num_prefill)] + [f"decode{i}" for i in range(num_decode)]


def _lending_flags(cluster: Cluster, cpus: list[str], num_prefill: int, num_decode: int) -> dict[int, Path]:
    """A core-lending flag file (node.core_lending) for each pair of prefill node i and decode
    node i, where every node has cores of its own and num_prefill >= num_decode; on tmpfs where
    there is one. Cluster.stop() removes them."""
    if not cpus or len(set(cpus)) < len(cpus) or not 0 < num_decode <= num_prefill:
        return {}
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    flags = {}
    for pair in range(num_decode):
        fd, name = tempfile.mkstemp(prefix=f"pdserve-lend-{os.getpid()}-{pair}-", dir=folder)
        os.close(fd)
        flags[pair] = Path(name)
        cluster.files.append(flags[pair])
        flags[pair].write_bytes(b"\x01")  # NOTE: node.core_lending's "busy": nothing lent until the lender says
    return flags


def _joined(addresses: dict[str, str], kind: str) -> str:
    return ",".join(a for name, a in addresses.items() if name.startswith(kind))


def wait_healthy(deployment: Deployment, timeout_s: float, stop: _StopFlag | None = None) -> None:
    """Poll the proxy's /health until 200. Raises RuntimeError if a process ends, TimeoutError
    past the deadline, InterruptedError when stop is set."""

    def check() -> None:
        if stop is not None and stop.is_set:
            raise InterruptedError("stopped while starting")
        dead = deployment.cluster.dead()
        if dead:
            raise RuntimeError(f"process ended during start-up: {', '.join(dead)}\n{deployment.logs()}")

    try:
        wait_http_ok(deployment.base_url + "/health", timeout_s, check)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\n{deployment.logs()}") from None


def pin_kv_capacity(deployment: Deployment) -> dict[str, int]:
    """Give each node's argv the KV blocks it sized for itself at start-up (its /metrics), so
    that a restart has the same capacity however much memory is free then (a node sized from
    free memory while its killed predecessor's was still held came back with 41,688 blocks of
    65,536). Nodes given --num-blocks or --kv-cache-memory-gb keep theirs; a node whose metrics
    cannot be read keeps sizing itself. Returns node name -> blocks pinned."""
    pinned = {}
    for name, url in deployment.health_urls.items():
        argv = deployment.cluster.argvs[name]
        if "--num-blocks" in argv or "--kv-cache-memory-gb" in argv:
            continue
        try:
            with urllib.request.urlopen(url + "/metrics", timeout=5.0) as response:
                text = response.read().decode()
        except OSError:
            continue
        found = re.search(r"^pdserve_node_kv_blocks_total\{[^}]*\} ([0-9.e+]+)$", text, re.MULTILINE)
        if found:
            pinned[name] = int(float(found.group(1)))
            argv += ["--num-blocks", str(pinned[name])]
    return pinned


def wait_http_ok(url: str, timeout_s: float, check: Callable[[], None] | None = None,
                 interval_s: float = 0.05) -> None:
    """Poll url until it answers 200. check(), called before each try, may raise to give up;
    raises TimeoutError past the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check is not None:
            check()
        if health_ok(url):
            return
        time.sleep(interval_s)
    raise TimeoutError(f"{url} not answering 200 after {timeout_s:.0f} s")


# NOTE: below this many bytes of weights a node's work per token is of the order of the proxy's
# and the client's (~0.2 ms of CPU per streamed token together), and a node whose OpenMP threads
# share their cores with them waits at every op's barrier for the one that was preempted.
# Measured on a 2-core Xeon with AMX, 64 streams of 64 tokens, one colocated node, 3 alternated
# pairs, on one core beside the proxy against both: `tiny` (3.4M parameters) in bfloat16 (6.8 MB)
# 6,377-7,338 tok/s against 4,573-5,423, in float32 (13.6 MB) 2,908-3,425 against 3,270-3,701;
# SmolLM-135M's shape in bfloat16 (268 MB) 445 against 650-692. The crossover lies between 6.8
# and 13.6 MB on this CPU; where exactly was not measured.
_PROXY_CORE_BELOW_WEIGHT_BYTES = 10_000_000
# NOTE: core lending (node.core_lending) from this many bytes of weights. Measured on a 2-core
# Zen 5 (AVX-512, AVX512-BF16), 1P+1D, 64 streams of 256 + 64 tokens, pdserve alone, alternated
# pairs, lending against none: `small` (111M parameters) in bfloat16 583.8 / 583.5 / 605.4 tok/s
# against 512.4 / 554.4 / 544.8, in float32 298.4 / 296.8 / 314.7 against 276.9 / 269.4 / 278.8;
# `tiny` (3.4M), 6 pairs, medians, float32 (13.6 MB) ~4,740 against ~5,190 (its two threads' step
# is mostly OpenMP barriers, which the proxy and client preempt), bfloat16 (6.8 MB) ~7,350
# against ~6,910. Between 13.6 MB and `small`'s 222 MB was not measured.
_LEND_CORES_FROM_WEIGHT_BYTES = 64 << 20
_BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}  # engine.config.DTYPES' sizes, torch-free


def auto_lend_cores(model_dir: Path, dtype: str | None = None) -> bool:
    """Core lending for models whose weights in the nodes' dtype (None: float32) take at least
    _LEND_CORES_FROM_WEIGHT_BYTES."""
    return _num_parameters(model_dir) * _BYTES_PER_ELEMENT[dtype or "float32"] >= _LEND_CORES_FROM_WEIGHT_BYTES


def auto_proxy_cores(model_dir: Path, num_cores: int, num_nodes: int, dtype: str | None = None) -> int:
    """1 for a model whose weights in the nodes' dtype (None: float32, the nodes' default) take
    under _PROXY_CORE_BELOW_WEIGHT_BYTES, when every node still gets a core of its own; else 0."""
    if num_cores - 1 < num_nodes:
        return 0
    weight_bytes = _num_parameters(model_dir) * _BYTES_PER_ELEMENT[dtype or "float32"]
    return int(weight_bytes < _PROXY_CORE_BELOW_WEIGHT_BYTES)


def _node_dtype(node_args: list[str] | tuple[str, ...]) -> str | None:
    """The --dtype among a node's arguments (either spelling; the last one wins), or None."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--dtype", default=None)
    return parser.parse_known_args(list(node_args))[0].dtype


def _num_parameters(model_dir: Path) -> int:
    """From the safetensors headers (no weights read); 0 when there are none."""
    from safetensors import safe_open

    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="numpy") as f:  # NOTE: not "pt": that imports torch (~200 MB)
            names = f.keys()  # a safe_open handle is not iterable itself
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in names)
    return total


def _cpu_plan(cores: list[int], num_nodes: int, proxy_cores: int = 0) -> list[str]:
    """Give each node its own cores where the machine has enough, after the first proxy_cores
    (kept for the proxy and clients while at least one core is left); else all nodes share."""
    if 0 < proxy_cores < len(cores):
        cores = cores[proxy_cores:]
    if num_nodes <= 0:
        return []
    if len(cores) < num_nodes:
        return [",".join(map(str, cores))] * num_nodes
    # Sizes differ by at most one core, and every core goes to a node.
    bounds = [i * len(cores) // num_nodes for i in range(num_nodes + 1)]
    return [",".join(map(str, cores[bounds[i]:bounds[i + 1]])) for i in range(num_nodes)]


def health_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, json.JSONDecodeError):
        return False


_GIVEN_PORTS: set[tuple[str, int]] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on host now, never one this process was given before (the kernel may hand a
    just-released port out again, and the nodes of one deployment must not share one), drawn
    below the kernel's ephemeral range where that leaves room: a port from the ephemeral range
    can be taken by any outgoing connection or bind(0) of any process (UCX opens some as a node
    starts) between now and the server's bind, which once failed a node's start-up with "Address
    already in use". Raises OSError when no port is found."""
    low = _ephemeral_range()[0]
    below = range(_LOWEST_PORT, low) if low - _LOWEST_PORT >= 1024 else None
    for _ in range(200):
        port = random.choice(below) if below is not None else _kernel_port(host)
        if (host, port) not in _GIVEN_PORTS and _can_bind(host, port):
            _GIVEN_PORTS.add((host, port))
            return port
    raise OSError(f"no free port on {host} that this process was not given before")


_LOWEST_PORT = 20000  # free_port draws from here to the ephemeral range's start


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (Linux's default where unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


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
