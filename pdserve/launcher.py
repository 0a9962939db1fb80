"""`pdserve up`: start prefill nodes, decode nodes and the proxy as separate processes on this
machine, wait until all are healthy, print the endpoint, restart any that ends on its own (with
backoff; the rest keep serving), and stop them all, in drain order, on Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import re
import signal
import socket
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from engine.cpu_quota import usable_cores
from pdserve.cluster import PDSERVE_COMMAND, Cluster, Supervisor
from pdserve.cores import auto_lend_cores, auto_proxy_cores, cpu_plan, lending_flags, node_dtype, node_flag
from pdserve.gpus import check_tp, gpu_flags, gpu_list, gpu_plan, visible_gpus
from pdserve.ports import free_port, port_range, wait_http_ok


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
        parser.add_argument(flag, type=kind, default=None, help=_NODE_FLAG_HELP.get(flag, "per node (default: the "
                                                                                          "node's)"))
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
                             "between any two)")
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
                             "least as many prefill nodes as decode nodes, each of one rank (default: for models "
                             "whose weights take at least 64 MB in the nodes' dtype)")
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
               ("--grammar-compile-timeout-s", float), ("--max-model-len", int), ("--mixed-graph-tokens", int))


_NODE_FLAG_HELP = {
    "--gpu-memory-utilization": "the share of each GPU's memory its nodes hold in all, split evenly among the nodes "
                                "sharing it (default 0.9)",
    "--device": "per node (default: the node's); cuda:N puts every node on GPU N, as --gpus N does",
}


_NODE_SWITCHES = ("--enable-prefix-caching", "--enforce-eager", "--async-scheduling")


_PROXY_FLAGS = (("--served-model-name", str), ("--chat-template", str), ("--api-key", str),
                ("--local-prefill-min-wait-s", float), ("--kv-stream-min-tokens", int), ("--routing", str),
                ("--slo-ttft-ms", float),
                ("--header-timeout-s", float), ("--keep-alive-timeout-s", float), ("--min-upload-bytes-per-s", float),
                ("--upload-rate-window-s", float), ("--max-client-uploads", int), ("--max-client-requests", int))


_PROXY_SWITCHES = ("--strict-fields",)


def _one_gpu_device(args: argparse.Namespace, node_args: list[str]) -> list[str]:
    """--device cuda:N as --gpus N (each node then sees that GPU alone, as cuda, and those sharing
    it split its memory); the node arguments with the device as the nodes name it. ValueError
    beside a GPU list: one place says which GPUs."""
    device = args.device or ""
    if not device.startswith("cuda:"):
        return node_args
    if args.gpus or args.prefill_gpus or args.decode_gpus:
        raise ValueError(f"--device {device} with --gpus/--prefill-gpus/--decode-gpus: name the GPUs in those lists "
                         "and give --device cuda")
    args.gpus = device.split(":", 1)[1]
    return [("cuda" if i > 0 and node_args[i - 1] == "--device" else word) for i, word in enumerate(node_args)]


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
    node_args, proxy_args = _given(args, _NODE_FLAGS, _NODE_SWITCHES), _given(args, _PROXY_FLAGS, _PROXY_SWITCHES)
    if args.log_format:
        node_args += ["--log-format", args.log_format]
        proxy_args += ["--log-format", args.log_format]
    try:
        check_tp(args)
        node_args = _one_gpu_device(args, node_args)
        gpus = gpu_plan(args.prefill, args.decode, gpu_list(args.gpus, "--gpus"),
                        gpu_list(args.prefill_gpus, "--prefill-gpus"), gpu_list(args.decode_gpus, "--decode-gpus"),
                        visible_gpus() if args.device in (None, "auto", "cuda") else [],  # cuda:N: --gpus N
                        prefill_tp=args.prefill_tp, decode_tp=args.decode_tp)
        _check_node_addresses(args)
        port_range()
    except ValueError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    stop = _install_signal_handlers()
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
    Where starting fails, what was started is stopped; on any failure after, the caller must
    stop() the returned deployment's cluster. pin_cpus: each node
    on cores of its own where there are enough (see cpu_plan; a tensor-parallel node gets a share
    per rank), proxy_cores of them (None: see auto_proxy_cores) left to the proxy and the
    clients. lend_cores: where nodes have cores of
    their own, prefill node i lends its cores to decode node i while it has nothing to prefill
    (node.core_lending); only with at least as many prefill nodes as decode nodes, so that no two
    decode nodes borrow the same cores. None: see auto_lend_cores. gpus: per node (prefill nodes
    first) the GPUs it runs on (gpu_plan), or None for the node's own default device.
    tensor_parallel: the tensor-parallel size of the prefill nodes and of the decode nodes.
    metrics_port_base: node i's health port (/metrics) is this + i (None: a free port). node_host:
    where the nodes listen and the proxy reaches them (None: see nodes_host)."""
    proxy_host, host = host, node_host or nodes_host(host)
    cluster = Cluster()
    try:
        cpus = []
        ranks = [tensor_parallel[0]] * num_prefill + [tensor_parallel[1]] * num_decode  # each node's processes
        if pin_cpus:
            cores = usable_cores()  # the affinity, cut to a container's CPU limit
            if proxy_cores is None:
                proxy_cores = auto_proxy_cores(model_dir, len(cores), sum(ranks), node_dtype(node_args))
            cpus = cpu_plan(cores, num_prefill + num_decode, proxy_cores, ranks)
        pdserve = list(PDSERVE_COMMAND)
        common = ["--model", str(model_dir), "--host", host, *node_args]
        addresses: dict[str, str] = {}
        health_urls: dict[str, str] = {}
        if lend_cores is None:
            lend_cores = auto_lend_cores(model_dir, node_dtype(node_args))
        # NOTE: lending resizes one process's threads; a tensor-parallel node's ranks keep their own cores,
        # and a node on a GPU has no compute on its cores to lend or borrow.
        on_gpus = (any(gpu is not None for gpu in gpus or [])
                   or (node_flag(node_args, "--device") or "").startswith("cuda"))
        lend_cores = lend_cores and max(ranks, default=1) == 1 and not on_gpus
        lending = lending_flags(cluster, cpus, num_prefill, num_decode) if lend_cores else {}
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
                argv += gpu_flags(gpus, i, node_args)
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
    except BaseException:  # NOTE: a signal's exception too (a caller stopping mid-start): none left running
        cluster.stop()
        raise


_WILDCARDS = ("0.0.0.0", "::", "")


def nodes_host(proxy_host: str) -> str:
    """Where `pdserve up`'s nodes listen by default: the proxy's host, or loopback where the proxy
    listens on every interface (only the proxy is published)."""
    return "127.0.0.1" if proxy_host in _WILDCARDS else proxy_host


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _node_names(num_prefill: int, num_decode: int) -> list[str]:
    return [f"prefill{i}" for i in range(num_prefill)] + [f"decode{i}" for i in range(num_decode)]


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
