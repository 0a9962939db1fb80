"""Local servers' addresses and readiness: free ports for them to listen on (never one handed out
twice), and polling an HTTP endpoint until it answers 200."""

from __future__ import annotations

import json
import os
import random
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

_GIVEN_PORTS: set[tuple[str, int]] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on host now, never one this process was given before (the kernel may hand a
    just-released port out again, and the nodes of one deployment must not share one), drawn
    from PORT_RANGE_VARIABLE's range where it is set, else below the kernel's ephemeral range
    where that leaves room: a port from the ephemeral range can be taken by any outgoing
    connection or bind(0) of any process (UCX opens some as a node starts) between now and the
    server's bind, which once failed a node's start-up with "Address already in use". Raises
    OSError when no port is found, ValueError for a malformed PORT_RANGE_VARIABLE."""
    draw_from = port_range()
    for _ in range(200):
        port = random.choice(draw_from) if draw_from is not None else _kernel_port(host)
        if (host, port) not in _GIVEN_PORTS and _can_bind(host, port):
            _GIVEN_PORTS.add((host, port))
            return port
    raise OSError(f"no free port on {host} that this process was not given before")


_LOWEST_PORT = 20000  # free_port draws from here to the ephemeral range's start
PORT_RANGE_VARIABLE = "PDSERVE_PORT_RANGE"  # LOW-HIGH, both included: the ports free_port draws from


def port_range() -> range | None:
    """The ports free_port draws from: PORT_RANGE_VARIABLE's (e.g. 30000-30999, to fit a firewall
    rule, or to keep two launchers on one host apart), else from _LOWEST_PORT up to the kernel's
    ephemeral range where that leaves 1,024 or more; None: let the kernel choose."""
    text = os.environ.get(PORT_RANGE_VARIABLE, "").strip()
    if text:
        low, sep, high = text.partition("-")
        if not (sep and low.strip().isdigit() and high.strip().isdigit()
                and 1024 <= int(low) <= int(high) <= 65535):
            raise ValueError(f"{PORT_RANGE_VARIABLE}={text!r}: two port numbers LOW-HIGH, 1024 <= LOW <= HIGH <= "
                             "65535, e.g. 30000-30999")
        return range(int(low), int(high) + 1)
    low = _ephemeral_range()[0]
    return range(_LOWEST_PORT, low) if low - _LOWEST_PORT >= 1024 else None


def share_of_range(index: int, count: int) -> str | None:
    """A PORT_RANGE_VARIABLE value for the index-th (from 0) of count processes that draw ports
    side by side (test workers), so no two draw the same: an equal share of port_range(), or, where
    that is None, of the ports above the kernel's ephemeral range; None where a share would hold
    fewer than 256 ports (each then lets the kernel choose)."""
    draw = port_range() or range(_ephemeral_range()[1] + 1, 65536)
    width = len(draw) // count
    if width < 256:
        return None
    low = draw.start + index * width
    return f"{low}-{low + width - 1}"


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


def health_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, json.JSONDecodeError):
        return False


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
