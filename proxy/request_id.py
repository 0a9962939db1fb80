"""The id a request is known by: the client's X-Request-Id (checked) or a fresh one. A pure ASGI
middleware puts it on request.state and echoes it on every response, errors included."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.errors import ApiError, error_response

HEADER = "x-request-id"
MAX_LENGTH = 128
# Visible ASCII only: the id goes into response ids, node request ids and log lines.
_VALID = re.compile(rf"[\x21-\x7e]{{1,{MAX_LENGTH}}}")


@dataclass(frozen=True)
class RequestId:
    """value: the client's X-Request-Id, else a fresh uuid4 hex; is_given: it came from the client
    (and so may repeat: node request ids then get a nonce, see ResponseFormat)."""

    value: str
    is_given: bool


def request_id_of(header: str | None) -> RequestId:
    """Raises ApiError (400) for a header that is not 1 to MAX_LENGTH visible ASCII characters."""
    if header is None:
        return RequestId(uuid.uuid4().hex, is_given=False)
    if not _VALID.fullmatch(header):
        raise ApiError(400, f"X-Request-Id must be 1 to {MAX_LENGTH} visible ASCII characters", "X-Request-Id")
    return RequestId(header, is_given=True)


class RequestIdMiddleware:
    """Sets scope["state"]["request_id"] (a RequestId) and adds X-Request-Id to the response.
    NOTE: plain ASGI, not BaseHTTPMiddleware, which wraps receive() (the endpoints' disconnect
    watchers rely on it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == HEADER.encode()), None)
        try:
            request_id = request_id_of(header)
        except ApiError as exc:
            await error_response(exc)(scope, receive, send)
            return
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (HEADER.encode(), request_id.value.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)
