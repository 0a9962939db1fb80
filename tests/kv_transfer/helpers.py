"""Helpers of the kv_transfer tests and of their child scripts (reader.py imports this module: it
needs no test dependency): polling a connector for its read results, and reading a child's
result lines."""

from __future__ import annotations

import json
import subprocess
import time


def poll_until(connector, request_ids: set[str], timeout_s: float) -> dict:
    """Request id -> ReadResult: connector.poll()'s results until every one of request_ids has
    one, or timeout_s passed (then those seen so far)."""
    results = {}
    deadline = time.monotonic() + timeout_s
    while set(results) != request_ids and time.monotonic() < deadline:
        for result in connector.poll():
            results[result.request_id] = result
        time.sleep(0.001)
    return results


def json_line(proc: subprocess.Popen) -> dict:
    """The next JSON line of a child's stdout (NIXL logs its own lines there too)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child ended (exit {proc.poll()}) before printing a result")
        if line.startswith("{"):
            return json.loads(line)
