"""`pdserve decode`: start one decode node (pulls KV from prefill nodes) or, with --colocated, a
node that prefills and decodes everything itself."""

from __future__ import annotations

import argparse

from engine.protocol import Role
from node.args import add_node_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_arguments(parser)
    parser.add_argument("--colocated", action="store_true",
                        help="prefill every prompt here (no prefill pool, no KV connector)")


def main(args: argparse.Namespace) -> int:
    from decode_node.server import DecodeNode
    from node.process import serve
    from node.server import NodeServer
    from node.transfer import connector_for

    def build(engine, configs):
        if args.colocated:
            return NodeServer(engine, configs.server)
        return DecodeNode(engine, configs.server, connector_for(engine, configs.transfer, configs.server.node_id))

    return serve(args, Role.COLOCATED if args.colocated else Role.DECODE, build)
