"""Command-line arguments of `pdserve prefill` and `pdserve decode`, and the configs built from
them. Every default is read from its config dataclass field, where it is defined once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine.config import (
    KERNEL_BACKENDS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    resolve_device,
    resolve_dtype,
)
from engine.model_files import check_model_dir
from engine.protocol import DTYPE_CHOICES, Role, curve_keys, default_of
from kv_transfer.config import BACKENDS, DEVICE_COPY_MODES, TransferConfig
from kv_transfer.security import is_wildcard
from node.config import ServerConfig


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag a node takes: model and engine, control socket, KV transfer."""
    _add_engine_arguments(parser)
    _add_transfer_arguments(parser)
    parser.add_argument("--cluster-secret", default=None,
                        help="secret shared by the proxy and every node (CURVE on every socket; without one, "
                             "every listener must be on loopback)")
    parser.add_argument("--orphan-timeout-s", type=float, default=default_of(ServerConfig, "orphan_timeout_s"),
                        help="abort the requests of a proxy silent this long (no message, no ping)")
    parser.add_argument("--health-port", type=int, default=default_of(ServerConfig, "health_port"),
                        help="HTTP port of GET /health (liveness), /ready (not draining) and /metrics (Prometheus) "
                             "on --host; 0: none")
    parser.add_argument("--drain-timeout-s", type=float, default=default_of(ServerConfig, "drain_timeout_s"),
                        help="on SIGTERM, wait this long at most for running requests and unpulled leases")
    parser.add_argument("--max-num-waiting", type=int, default=default_of(ServerConfig, "max_num_waiting"),
                        help="refuse new requests while this many wait on this node (the proxy tries another node)")
    parser.add_argument("--grammar-threads", type=int, default=default_of(ServerConfig, "grammar_threads"),
                        help="threads compiling structured requests' grammars, off the step loop")
    parser.add_argument("--grammar-compile-timeout-s", type=float,
                        default=default_of(ServerConfig, "grammar_compile_timeout_s"),
                        help="a grammar taking longer to compile is refused (400), and so is every later request "
                             "with its schema")
    parser.add_argument("--cpus", default=None,
                        help="CPU cores for this node, e.g. 0,1 or 0-7 (also sets torch threads; default: the "
                             "process's cores, as many threads as its CPU quota allows)")
    parser.add_argument("--lend-flag", default=None,
                        help="prefill node: keep whether it has work in this file (node.core_lending), so that a "
                             "decode node given the same file borrows its cores while it has none")
    parser.add_argument("--borrow-flag", default=None,
                        help="decode node: while the prefill node keeping this file (--lend-flag) has no work, "
                             "run on --borrow-cpus too")
    parser.add_argument("--borrow-cpus", default=None,
                        help="decode node: the lender's cores, e.g. 0 (see --borrow-flag)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", default="text", choices=("text", "json"),
                        help="json: one object per line (time, level, logger, message, request_id)")


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--host", default=default_of(ServerConfig, "host"),
                        help="address the control socket, the KV side channel and /health bind (0.0.0.0: all)")
    parser.add_argument("--advertise-host", default=default_of(TransferConfig, "advertise_host"),
                        help="address peers are told to reach this node's KV side channel and NIXL agent at "
                             "(default: --host, which must then be a concrete address, not 0.0.0.0)")
    parser.add_argument("--port", type=int, default=default_of(ServerConfig, "port"),
                        help="control socket port (0: pick one)")
    parser.add_argument("--node-id", default=None, help="name in logs and reports (default: ROLE-PORT)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="auto: float32 on the CPU; on CUDA the checkpoint's bfloat16 or float16 "
                             "(bfloat16 for a float32 checkpoint)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (CUDA when available)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the checkpoint's")
    parser.add_argument("--kernel-backend", default=default_of(EngineConfig, "kernel_backend"),
                        choices=KERNEL_BACKENDS,
                        help="compute backend: auto (Triton on CUDA, the compiled CPU kernels on the CPU), cpu, "
                             "triton, or reference (plain torch)")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                        help="run every step eagerly: no CUDA graphs (on CUDA they are captured at start-up: "
                             "decode steps per batch-size bucket up to --max-num-seqs, steps with prompt tokens per "
                             "token bucket up to --mixed-graph-tokens)")
    parser.add_argument("--mixed-graph-tokens", type=int, default=default_of(EngineConfig, "mixed_graph_tokens"),
                        help="steps with prompt tokens, up to this many tokens, run as CUDA graphs between their "
                             "attentions (captured at start-up per token bucket; 0, --enforce-eager or a split model: "
                             "eagerly)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=default_of(EngineConfig, "async_scheduling"),
                        help="queue the next decode step before reading this one's tokens (CUDA graphs; decode "
                             "batches without logprobs, penalties, logit bias or grammars)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int,
                        default=default_of(EngineConfig, "tensor_parallel_size"),
                        help="ranks the model is split over: one process each (one GPU each on CUDA); prefill and "
                             "decode nodes of any sizes exchange KV")
    parser.add_argument("--block-size", type=int, default=default_of(CacheConfig, "block_size"))
    parser.add_argument("--num-blocks", type=int, default=default_of(CacheConfig, "num_blocks"))
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None,
                        help="KV cache budget (default: a share of free memory)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=default_of(CacheConfig, "gpu_memory_utilization"),
                        help="on a GPU without --kv-cache-memory-gb: the share of the GPU's memory this node holds in "
                             "all (nodes sharing a GPU split it)")
    parser.add_argument("--max-num-seqs", type=int, default=default_of(SchedulerConfig, "max_num_seqs"))
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=default_of(SchedulerConfig, "max_num_batched_tokens"))
    parser.add_argument("--seed", type=int, default=default_of(EngineConfig, "seed"))
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=default_of(EngineConfig, "enable_prefix_caching"),
                        help="reuse the KV of cached prompt prefixes (--no-enable-prefix-caching: off)")


def _add_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transfer-backend", default=default_of(TransferConfig, "backend"),
                        choices=[b for b in BACKENDS if b != "fake"])
    parser.add_argument("--kv-port", type=int, default=default_of(TransferConfig, "side_channel_port"),
                        help="KV side-channel port (0: pick one)")
    for name in ("handshake_timeout_s", "transfer_timeout_s", "lease_timeout_s"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=default_of(TransferConfig, name))
    parser.add_argument("--kv-device-copy", default=default_of(TransferConfig, "device_copy"),
                        choices=DEVICE_COPY_MODES,
                        help="NIXL between nodes of one host, caches on GPUs: read the blocks as device copies over "
                             "CUDA IPC from a peer on this GPU or, once a probe copied from its GPU reads back equal, "
                             "on another GPU of this host (auto); from this GPU only (same-gpu); never (off: UCX)")


@dataclass(frozen=True)
class NodeConfigs:
    """What one node process is built from."""

    engine: EngineConfig
    server: ServerConfig
    transfer: TransferConfig


def node_configs_from_args(args: argparse.Namespace, role: Role) -> NodeConfigs:
    """Raises ValueError (naming the field) for a bad value (a non-loopback host without a
    cluster secret included), OSError for unreadable model files."""
    check_model_dir(args.model)
    device = resolve_device(args.device)
    memory = int(args.kv_cache_memory_gb * (1 << 30)) if args.kv_cache_memory_gb else None
    engine = EngineConfig(
        model=ModelConfig.from_pretrained(args.model, dtype=resolve_dtype(args.dtype, device, args.model),
                                          max_model_len=args.max_model_len),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory_bytes=memory,
                          gpu_memory_utilization=args.gpu_memory_utilization),
        scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens),
        device=device,
        seed=args.seed,
        role=role,
        enable_prefix_caching=args.enable_prefix_caching,
        kernel_backend=args.kernel_backend,
        decode_graphs="off" if args.enforce_eager else default_of(EngineConfig, "decode_graphs"),
        async_scheduling=args.async_scheduling,
        mixed_graph_tokens=args.mixed_graph_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        lost_rank_ends_process=True,
    )
    keys = curve_keys(args.cluster_secret) if args.cluster_secret else None
    server = ServerConfig(args.node_id or f"{role.value}-{args.port}", args.host, args.port,
                          orphan_timeout_s=args.orphan_timeout_s, curve_keys=keys,
                          health_port=args.health_port, drain_timeout_s=args.drain_timeout_s,
                          max_num_waiting=args.max_num_waiting, grammar_threads=args.grammar_threads,
                          grammar_compile_timeout_s=args.grammar_compile_timeout_s)
    if role is not Role.COLOCATED and is_wildcard(args.host) and not args.advertise_host:
        raise ValueError(f"--host {args.host} binds every interface, but prefill and decode nodes dial each "
                         "other's KV side channel: set --advertise-host to this node's address")
    transfer = TransferConfig(
        backend=args.transfer_backend, host=args.host, advertise_host=args.advertise_host,
        side_channel_port=args.kv_port,
        handshake_timeout_s=args.handshake_timeout_s, transfer_timeout_s=args.transfer_timeout_s,
        lease_timeout_s=args.lease_timeout_s, curve_keys=keys, device_copy=args.kv_device_copy,
    )
    return NodeConfigs(engine, server, transfer)
