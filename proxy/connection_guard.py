"""Deadlines on each HTTP connection, below the app: a request's headers must arrive whole within
header_timeout_s (of the connection's start for its first request, of the first byte for later
ones: trickled header lines count), a connection with no request in progress closes after
uvicorn's timeout_keep_alive, and a body still arriving after its answer is discarded for at
most _DISCARD_S before the connection closes."""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from proxy.errors import ApiError

logger = logging.getLogger(__name__)

# How long the rest of a body answered before it arrived (a 401, a 413 by Content-Length, a 429)
# may keep coming: read and dropped meanwhile, so the client reads the answer rather than a reset.
_DISCARD_S = 5.0


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float


class _Wait(enum.Enum):
    """What the connection's one deadline is waiting for."""

    HEADERS = "headers"  # a request's headers (or, on a new connection, its first request)
    IDLE = "idle"  # the first byte of a next request (keep-alive)
    DISCARD = "discard"  # the end of a body whose answer was sent


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with one deadline per connection (see the module's docstring).
    NOTE: uvicorn alone has no header deadline, arms its keep-alive timer only after a response,
    and cancels it on any byte (blank lines included) and for good when a discarded body is still
    arriving; so a connection that sends nothing, trickles its headers or trickles a body past its
    answer was held forever. The keep-alive deadline here is cancelled only by a request's first
    byte, which starts the header deadline."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, limits: ConnectionLimits) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for: _Wait | None = None
        self._has_partial_request = False  # a request line began and its headers are not complete

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(_Wait.HEADERS, self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._has_partial_request = True
        self._unset_keepalive_if_required()  # NOTE: a request began: the connection is not idle
        if self._waiting_for is not _Wait.HEADERS:  # a new connection's first request keeps its deadline
            self._arm(_Wait.HEADERS, self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._has_partial_request = False
        self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self._waiting_for is _Wait.DISCARD and self.cycle.response_complete:
            self._arm(_Wait.IDLE, self.timeout_keep_alive)  # the dropped body ended: idle from now
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._unset_keepalive_if_required()  # NOTE: uvicorn's timer, replaced by the deadline below
        cycle = self.cycle
        if self.transport.is_closing() or not cycle.response_complete or self._waiting_for is _Wait.HEADERS:
            return  # closing, a pipelined request runs now, or a next request's headers are arriving
        if cycle.more_body:
            self._arm(_Wait.DISCARD, _DISCARD_S)
        else:
            self._arm(_Wait.IDLE, self.timeout_keep_alive)

    def _arm(self, waiting_for: _Wait, delay_s: float) -> None:
        self._disarm()
        self._waiting_for = waiting_for
        self._deadline = self.loop.call_later(delay_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._waiting_for = None, None

    def _expire(self) -> None:
        waiting_for, self._deadline, self._waiting_for = self._waiting_for, None, None
        if self.transport.is_closing():
            return
        is_between_responses = self.cycle is None or self.cycle.response_complete
        if waiting_for is _Wait.HEADERS and self._has_partial_request and is_between_responses:
            self.transport.write(_late_headers_response(self.limits.header_timeout_s))
        logger.debug("closing connection from %s: %s deadline passed", self.client, waiting_for.value)
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> Callable[..., GuardedHttpProtocol]:
    """What uvicorn.Config's http takes: a factory of GuardedHttpProtocol with these limits."""
    return partial(GuardedHttpProtocol, limits=limits)


def _late_headers_response(timeout_s: float) -> bytes:
    """A 408 with an OpenAI error body, closing the connection."""
    error = ApiError(408, f"the request headers did not arrive within {timeout_s:g} s", code="request_timeout")
    body = json.dumps(error.body()).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
