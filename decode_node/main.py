"""`pdserve decode`: start one decode node (role decode: pulls KV; role both: colocated)."""

from __future__ import annotations

import argparse
import logging
import signal

from engine.node_server import ServerConfig, add_engine_arguments, engine_config_from_args, exit_now, kv_layout_fields, pin_cpus
from kv_transfer.cli import add_transfer_arguments, create_connector, transfer_config_from_args
from kv_transfer.layout import KVLayout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_transfer_arguments(parser)
    parser.add_argument("--role", default="decode", choices=["decode", "both"],
                        help="decode: pull prompts' KV from prefill nodes; both: colocated (prefill here)")


def main(args: argparse.Namespace) -> int:
    from decode_node.server import DecodeNode
    from engine.engine import LLMEngine

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    pin_cpus(args.cpus)
    node_id = args.node_id or f"decode-{args.port}"
    # NOTE: the engine runs in the "both" role either way: a decode node prefills locally in
    # colocated mode and when a KV pull fails.
    engine = LLMEngine(engine_config_from_args(args, role="both"))
    connector = None
    if args.role == "decode":
        connector = create_connector(transfer_config_from_args(args), engine.kv_cache, kv_layout(engine), node_id)
    server = DecodeNode(engine, ServerConfig(node_id, args.host, args.port), connector, role=args.role)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    engine.warm_up()  # NOTE: before the first report, so routing sees a measured prefill rate
    server.run()
    exit_now()  # NOTE: skips UCX's teardown, which aborts when a peer died first
    return 0


def kv_layout(engine) -> KVLayout:
    return KVLayout(**kv_layout_fields(engine))
