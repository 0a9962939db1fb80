"""The node process around a NodeServer: logging, CPU pinning, signals, warm-up, the serve loop
and a fast exit. Both `pdserve prefill` and `pdserve decode` run through serve()."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable

import torch

from engine.engine import LLMEngine
from engine.protocol import Role
from node.args import NodeConfigs, node_configs_from_args
from node.server import NodeServer

BuildServer = Callable[[LLMEngine, NodeConfigs], NodeServer]


def serve(args: argparse.Namespace, role: Role, build_server: BuildServer) -> int:
    """Build the engine and the role's server from args, serve until drained (SIGTERM) or SIGINT, then leave
    the process at once (returns only 2, for bad arguments)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    pin_cpus(args.cpus)
    try:
        configs = node_configs_from_args(args, role)
    except ValueError as exc:  # process edge: a readable message, not a traceback
        print(f"pdserve {role.value}: {exc}", file=sys.stderr)  # noqa: T201 - the CLI's answer
        return 2
    engine = LLMEngine(configs.engine)
    server = build_server(engine, configs)
    # NOTE: SIGTERM drains (no new requests, finish the running ones, keep leases until pulled);
    # SIGINT stops at once.
    signal.signal(signal.SIGTERM, lambda *_: server.drain())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    engine.warm_up()  # NOTE: before the first report, so routing sees a measured prefill rate
    server.run()
    exit_now()  # NOTE: skips UCX's teardown, which aborts when a peer died first
    return 0


def exit_now(code: int = 0) -> None:
    """Leave the process at once after a clean shutdown (flushing logs and streams first)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def pin_cpus(cpus: str | None) -> None:
    """Run this process on the given cores with one torch thread per core."""
    if not cpus:
        return
    cores = {int(c) for c in cpus.split(",") if c.strip()}
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
