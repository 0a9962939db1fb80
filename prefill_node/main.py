"""`pdserve prefill`: start one prefill node (engine in the prefill role + KV connector)."""

from __future__ import annotations

import argparse

from engine.protocol import Role
from node.args import add_node_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from node.process import serve
    from node.transfer import connector_for
    from prefill_node.server import PrefillNode

    def build(engine, configs):
        connector = connector_for(engine, configs.transfer, configs.server.node_id)
        return PrefillNode(engine, configs.server, connector, configs.transfer.lease_timeout_s)

    return serve(args, Role.PREFILL, build)
