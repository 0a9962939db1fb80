"""The node process around a NodeServer: logging, CPU pinning, signals, warm-up, the serve loop
and a fast exit. Both `pdserve prefill` and `pdserve decode` run through serve()."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from engine.cpu_quota import usable_cores
from engine.engine import LLMEngine
from engine.gc_policy import freeze_start_up_objects
from engine.protocol import Role
from engine.warm_up import warm_up
from kv_transfer.ucx import exit_now
from node.args import NodeConfigs, node_configs_from_args
from node.core_lending import Borrower, Lender
from node.server import NodeServer

BuildServer = Callable[[LLMEngine, NodeConfigs], NodeServer]
# Set by pdserve.standby: when it was handed this node (time.monotonic(), one clock for all processes).
_STANDBY_HANDED_OVER_ENV = "PDSERVE_STANDBY_HANDED_OVER_AT"


def serve(args: argparse.Namespace, role: Role, build_server: BuildServer) -> int:
    """Build the engine and the role's server from args, serve until drained (SIGTERM) or SIGINT, then leave
    the process at once (returns only 2, for bad arguments)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        pin_cpus(args.cpus)
        configs = node_configs_from_args(args, role)
        _check_lending(args, role)
    except ValueError as exc:  # process edge: a readable message, not a traceback
        print(f"pdserve {role.value}: {exc}", file=sys.stderr)  # noqa: T201 - the CLI's answer
        return 2
    keep_freed_memory()
    handed_over_at = os.environ.pop(_STANDBY_HANDED_OVER_ENV, None)  # a standby process became this node
    phases = ([("start-up and imports", seconds_since_process_start())] if handed_over_at is None
              else [("standby hand-over", time.monotonic() - float(handed_over_at))])
    configs = start_configs(configs, handed_over=handed_over_at is not None)
    started = time.monotonic()
    engine = LLMEngine(configs.engine)
    phases.append(("engine (weights, KV cache)", time.monotonic() - started))
    started = time.monotonic()
    server = build_server(engine, configs)
    if args.lend_flag:
        server.lender = Lender(args.lend_flag)
    if args.borrow_flag:
        server.borrower = Borrower(args.borrow_flag, _cores(args.borrow_cpus))
    # NOTE: SIGTERM drains (no new requests, finish the running ones, keep leases until pulled);
    # SIGINT stops at once.
    signal.signal(signal.SIGTERM, lambda *_: server.drain())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    phases.append(("server (sockets, KV transfer agent)", time.monotonic() - started))
    started = time.monotonic()
    warm_up(engine)  # NOTE: a full step, before the first report (routing sees a measured prefill rate)
    phases.append(("warm-up step", time.monotonic() - started))
    num_frozen = freeze_start_up_objects()
    logging.getLogger(__name__).info("%s node ready %.2f s after its process started: %s; %d start-up objects "
                                     "frozen (no collection traverses them)", role.value, sum(s for _, s in phases),
                                     ", ".join(f"{n} {s:.2f} s" for n, s in phases), num_frozen)
    server.run()
    engine.close()
    # NOTE: exit_now skips NIXL's and UCX's exit-time teardown (see there). A node that failed
    # (a tensor-parallel rank lost) exits 1, so that its supervisor restarts it.
    exit_now(0 if server.failure is None else 1)
    return 0


def start_configs(configs: NodeConfigs, *, handed_over: bool) -> NodeConfigs:
    """configs as this start uses them: a node that took over a standby process (a restart, where
    serving again soon matters most) leaves its CPU KV cache's pages to the steps that first write
    them instead of zeroing them before it is ready."""
    if not handed_over:
        return configs
    return replace(configs, engine=replace(configs.engine, cache=replace(configs.engine.cache, prefault=False)))


def seconds_since_process_start() -> float:
    """How long ago this process started (the kernel's record: interpreter start-up and imports
    included); 0.0 where /proc does not say."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_BYTES = 2**31 - 1  # mallopt takes an int: the heap keeps up to 2 GiB of free top
_HEAP_UP_TO_BYTES = 32 << 20  # glibc's largest mmap threshold: blocks up to this come from the heap


def keep_freed_memory() -> bool:
    """Fix glibc's mmap threshold at 32 MB and its trim threshold at 2 GiB, before the engine's
    own heap policy (engine.host_memory.keep_freed_memory: no mmap, no trimming) is set, so that
    a step's freed activations stay for the next step rather than being faulted in afresh. In
    child processes, 20 steps of three 12 MB activations faulted 3-6k pages with both against
    18-31k with the engine's alone (and 12-125k with glibc's defaults). False where the C library
    has no mallopt (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES) and mallopt(_M_MMAP_THRESHOLD, _HEAP_UP_TO_BYTES))


def _check_lending(args: argparse.Namespace, role: Role) -> None:
    if args.lend_flag and role != Role.PREFILL:
        raise ValueError("--lend-flag is for prefill nodes")
    if (args.borrow_flag or args.borrow_cpus) and role != Role.DECODE:
        raise ValueError("--borrow-flag and --borrow-cpus are for decode nodes")
    if bool(args.borrow_flag) != bool(args.borrow_cpus):
        raise ValueError("--borrow-flag and --borrow-cpus go together")
    if args.borrow_flag and not args.cpus:
        raise ValueError("--borrow-cpus needs --cpus (the node's own cores)")
    for name in ("lend_flag", "borrow_flag"):
        path = getattr(args, name)
        if path and not os.path.isfile(path):
            raise ValueError(f"--{name.replace('_', '-')} {path}: no such file")
    if args.borrow_cpus:
        _cores(args.borrow_cpus)


def _cores(cpus: str) -> set[int]:
    """Core numbers and ranges as taskset writes them: 0,1 or 0-7 or 0-3,8-11."""
    cores = set()
    try:
        for part in filter(None, (p.strip() for p in cpus.split(","))):
            first, _, last = part.partition("-")
            cores.update(range(int(first), int(last or first) + 1))
    except ValueError:
        cores = set()
    if not cores:
        raise ValueError(f"cores {cpus!r}: core numbers and ranges, e.g. 0,1 or 0-7 or 0-3,8-11")
    return cores


def pin_cpus(cpus: str | None) -> None:
    """Run this process on the given cores with one torch thread per core; without them, with at
    most one torch thread per core the process may use (its affinity and its cgroup's CPU quota)."""
    if not cpus:
        usable = len(usable_cores())
        if usable < torch.get_num_threads():
            logging.getLogger(__name__).info("%d torch threads: the cores this process may use (CPU quota, "
                                             "affinity)", usable)
            torch.set_num_threads(usable)
        return
    cores = _cores(cpus)
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
