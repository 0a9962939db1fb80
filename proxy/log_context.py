"""The request id on the proxy's log lines: while a request is served (and in every task it
starts, which copy the context), each log record carries its id as `context_request_id`, which
the log formatter prints (pdserve.logs; `request_id` in JSON). Installed by create_app."""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

current_request_id: ContextVar[str | None] = ContextVar("pdserve_request_id", default=None)
access_logger = logging.getLogger("proxy.access")
# Orchestrators' and scrapers' probes: their access lines are DEBUG (in one run 1,944 of 2,209
# access lines were probes); --log-level debug shows them.
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
_installed = False


def install_record_factory() -> None:
    """Make every log record carry the current request id (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = logging.getLogRecordFactory()

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        # NOTE: not "request_id": makeRecord refuses an extra= key the record already has.
        record.context_request_id = current_request_id.get()
        return record

    logging.setLogRecordFactory(factory)


class RequestLogContext:
    """ASGI middleware inside proxy.request_id.RequestIdMiddleware: sets current_request_id for
    the request's whole life and logs one access line per HTTP request (method, path, status,
    milliseconds) with its id (uvicorn's own access line runs outside the request's context):
    INFO, but DEBUG for a successful GET probe (PROBE_PATHS)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = scope.get("state", {}).get("request_id") if scope["type"] == "http" else None
        if request_id is None:
            await self.app(scope, receive, send)
            return
        token = current_request_id.set(request_id.value)
        started, status = time.monotonic(), [0]

        async def send_noting_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            is_probe = scope["method"] == "GET" and scope["path"] in PROBE_PATHS and status[0] < 400
            access_logger.log(logging.DEBUG if is_probe else logging.INFO, "%s %s %d %.1f ms", scope["method"],
                              scope["path"], status[0], (time.monotonic() - started) * 1000)
            current_request_id.reset(token)
