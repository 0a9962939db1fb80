"""A standby node process: started ahead of need with the heavy imports done (torch alone takes
~2.3 s of a tiny node's ~3.6 s start-up), it waits for one line on stdin naming the node it is to
become, then runs that node's command in place. `pdserve up`'s supervisor keeps one ready, so a
node that dies is replaced in the time its model and KV cache take to load, not a whole start.

The line is JSON: {"argv": the pdserve command's arguments (["decode", "--model", ...]),
"env": variables to add, "log": a file to append stdout and stderr to, or null}. End of input
without a line: the standby exits 0.

    python -m pdserve.standby
"""

from __future__ import annotations

import json
import os
import sys
import time

# What every node command imports before its first line runs (the rest is light).
_PRELOAD = ("torch", "engine.engine", "prefill_node.main", "decode_node.main")
NODE_COMMANDS = ("prefill", "decode")
# Set for the node: time.monotonic() (one clock for every process) when the standby was handed it.
HANDED_OVER_ENV = "PDSERVE_STANDBY_HANDED_OVER_AT"


def main() -> int:
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    handed_over_at = time.monotonic()
    order = json.loads(line)
    argv = list(order["argv"])
    if not argv or argv[0] not in NODE_COMMANDS:
        print(f"pdserve standby: not a node command: {argv[:1]}", file=sys.stderr)
        return 2
    os.environ.update(order.get("env") or {})
    os.environ[HANDED_OVER_ENV] = repr(handed_over_at)
    if order.get("log"):
        fd = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    sys.argv = [sys.argv[0], *argv]
    from pdserve.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
