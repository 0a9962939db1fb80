"""Every error of the proxy and its HTTP answer: node failures, bad input, and the OpenAI error
body each becomes (4xx for the client's fault, 5xx for a node's)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import protocol, sampling_rules

logger = logging.getLogger(__name__)


class NodeDied(Exception):
    """The node holding a request stopped reporting (or is not accepting messages)."""


class NoNodeAvailable(Exception):
    """No healthy node of a needed kind."""


class NodeRejected(Exception):
    """A node answered with an ErrorReply; reply.is_client_error tells whose fault it was."""

    def __init__(self, reply: protocol.ErrorReply) -> None:
        super().__init__(reply.message)
        self.reply = reply


class ClientGone(Exception):
    """The client went away before its request's body arrived whole: nothing to answer."""


class ChatTemplateError(ValueError):
    """A chat template that cannot serve a request: none, a syntax error, or a failure on the
    request's messages (raise_exception, undefined misuse, sandbox refusal, deadline). A 400;
    param names the request field to blame."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


class ApiError(Exception):
    """An error answered with an OpenAI error body; param names the offending request field,
    headers go on the response (Retry-After on a 429)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def with_headers(self, headers: dict[str, str]) -> ApiError:
        """This error with headers added to its response's."""
        return ApiError(self.status, self.message, self.param, self.kind, self.code,
                        {**(self.headers or {}), **headers})


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def rate_limited(message: str, code: str, retry_after_s: int) -> ApiError:
    """A 429 telling the client to come back after retry_after_s seconds (Retry-After); code
    names why (OpenAI's type for a 429 is rate_limit_exceeded)."""
    return ApiError(429, message, kind="rate_limit_exceeded", code=code, headers={"Retry-After": str(retry_after_s)})


def api_error_of(exc: Exception, request_id: str | None = None) -> ApiError:
    """The answer for a failed request: ChatTemplateError 400, NodeRejected 400 or 500 (as the
    node says), NoNodeAvailable 503, NodeDied 502, TimeoutError 504, anything else 500 (and
    logged under request_id: a bug)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ChatTemplateError):
        return ApiError(400, str(exc), exc.param)
    if isinstance(exc, NodeRejected):
        if exc.reply.is_client_error:
            return ApiError(400, exc.reply.message)
        return ApiError(500, exc.reply.message, kind="server_error")
    if isinstance(exc, NoNodeAvailable):
        return ApiError(503, str(exc), kind="server_error")
    if isinstance(exc, NodeDied):
        return ApiError(502, str(exc), kind="server_error")
    if isinstance(exc, TimeoutError):
        return ApiError(504, str(exc), kind="server_error")
    logger.exception("request %s failed", request_id, exc_info=exc)
    return ApiError(500, f"{type(exc).__name__}: {exc}", kind="server_error")


def from_validation(errors: list[dict]) -> ApiError:
    """A 400 for pydantic's errors, naming the first one's field (dotted path) as param."""
    first = errors[0] if errors else {}
    param = field_path(first.get("loc", ())) or None
    return ApiError(400, f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg")), param)


def field_path(loc: tuple) -> str:
    """A pydantic error location as a dotted request path ("messages.0.content"), without the
    union member names pydantic puts in it ("str", "list[TextPart]", "NamedToolChoice")."""
    return ".".join(str(p) for p in loc if p != "body" and not _is_union_member(p))


def _is_union_member(item: str | int) -> bool:
    if isinstance(item, int):
        return False
    return "[" in item or item[:1].isupper() or item in ("str", "int", "float", "bool", "none", "dict", "list")


def from_sampling(exc: sampling_rules.SamplingError) -> ApiError:
    """A 400 for a sampling option out of its range, naming the option as param."""
    return ApiError(400, str(exc), exc.param)


def install_handlers(app: FastAPI) -> None:
    """Answer every error with an OpenAI error body: ApiError, FastAPI's own validation errors,
    Starlette's (unknown path 404, wrong method 405) and, as a 500, anything else (a bug)."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        # NOTE: an INFO line, no traceback: a client may hang up whenever it likes.
        logger.info("client %s disconnected before its request body arrived (%s)",
                    request.client.host if request.client else "?", exc)
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        return error_response(ApiError(exc.status_code, str(exc.detail), kind=kind,
                                       headers=dict(exc.headers) if exc.headers else None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        request_id = getattr(getattr(request.state, "request_id", None), "value", None)
        return error_response(api_error_of(exc, request_id))
