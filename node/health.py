"""HealthServer: a node's HTTP /health (liveness), /ready (readiness) for orchestrators and
/metrics (Prometheus, node.metrics), a tiny stdlib server on a daemon thread."""

from __future__ import annotations

import http.server
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST

# NOTE: one engine step of the small preset can take ~6 s on one core (a 2,048-token prefill
# chunk): a loop is stuck only well past that.
LIVENESS_TIMEOUT_S = 30.0


class _Node(Protocol):
    last_progress_at: float  # time.monotonic() of the loop's last iteration
    is_serving: bool
    is_draining: bool


class HealthServer:
    """GET /health: 200 while the node's loop progressed within LIVENESS_TIMEOUT_S, else 503.
    GET /ready: 200 while it serves (warmed up) and is not draining, else 503. GET /metrics:
    render_metrics() in Prometheus' text format (404 without it). Reads only attributes the loop
    assigns whole (no lock needed); never blocks the loop."""

    def __init__(self, host: str, port: int, node: _Node, render_metrics: Callable[[], bytes] | None = None) -> None:
        handler = _handler_for(node, render_metrics)
        self._server = _Server((host, port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="node-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


class _Server(http.server.ThreadingHTTPServer):
    def server_bind(self) -> None:
        """As HTTPServer's, without its reverse DNS lookup of the address (socket.getfqdn): where
        no resolver answers for it (a network namespace, a pod without DNS for that address) the
        node would wait out the resolver's timeouts before serving. server_name is only read by
        CGI handlers, which this server has none of."""
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


def is_live(node: _Node) -> bool:
    return time.monotonic() - node.last_progress_at < LIVENESS_TIMEOUT_S


def is_ready(node: _Node) -> bool:
    return node.is_serving and not node.is_draining and is_live(node)


def _handler_for(node: _Node, render_metrics: Callable[[], bytes] | None) -> type[http.server.BaseHTTPRequestHandler]:
    checks = {"/health": is_live, "/ready": is_ready}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            path = self.path.split("?", 1)[0]
            check = checks.get(path)
            if path == "/metrics" and render_metrics is not None:
                self._answer(200, render_metrics(), CONTENT_TYPE_LATEST)
            elif check is None:
                self._answer(404, b"not found\n")
            elif check(node):
                self._answer(200, b"ok\n")
            else:
                self._answer(503, b"unavailable\n")

        def _answer(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # quiet: probes come every few seconds
            pass

    return Handler
