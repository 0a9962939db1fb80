"""Bounds on what a client may send before any of it is trusted: the body's size and how long
it takes to arrive (read in pieces, never whole into memory past the limit), and the JSON in it
(UTF-8, nesting depth, no NaN or Infinity, no lone surrogates). Each breach is a 4xx with an
OpenAI error body."""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from proxy.errors import ApiError, ClientGone, rate_limited
from proxy.metrics import ProxyMetrics

# NOTE: deep enough for any real JSON schema or tool definition (they rarely pass 20); the
# stdlib parser recurses once per level and pydantic, the chat template and json.dumps walk the
# same structures recursively, so this bound keeps all of them far from the recursion limit.
MAX_JSON_DEPTH = 64
# Bodies of the largest size that may be arriving at once: past it new uploads get a 429, so
# slow uploads cannot pile up memory (each holds what it has read so far).
_MAX_FULL_BODIES_BUFFERED = 16
# \uD800-\uDFFF escapes: a lone one becomes a lone surrogate, which no tokenizer can encode.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_CONTAINERS = (dict, list)


class BodyReader:
    """Reads request bodies of at most max_body_bytes (413: refused on Content-Length before
    reading, or as soon as the bytes read pass it), each within timeout_s (408), with at most
    _MAX_FULL_BODIES_BUFFERED bodies' worth of bytes held by the reads in progress (429)."""

    def __init__(self, max_body_bytes: int, timeout_s: float, metrics: ProxyMetrics | None = None) -> None:
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.max_buffered_bytes = max_body_bytes * _MAX_FULL_BODIES_BUFFERED
        self.num_buffered_bytes = 0  # held by reads in progress

    async def read(self, request: Request) -> bytes:
        """The whole body; raises ApiError (400 bad Content-Length, 408, 413, 429)."""
        declared = request.headers.get("content-length")
        if declared is not None:
            if not (declared.isascii() and declared.isdigit()):
                raise ApiError(400, f"Content-Length must be a number of bytes, got {declared[:40]!r}")
            if int(declared) > self.max_body_bytes:
                raise self._too_large(f"{int(declared)} bytes")
        chunks: list[bytes] = []
        try:
            async with asyncio.timeout(self.timeout_s):  # NOTE: not wait_for (see request_flow._next)
                await self._read_chunks(request, chunks)
        except TimeoutError as exc:
            raise ApiError(408, f"the request body did not arrive within {self.timeout_s:g} s",
                           code="request_timeout") from exc
        except ClientDisconnect:
            raise ClientGone(f"{sum(len(c) for c in chunks)} bytes read") from None
        finally:
            self.num_buffered_bytes -= sum(len(c) for c in chunks)
        return b"".join(chunks)

    async def _read_chunks(self, request: Request, chunks: list[bytes]) -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large(f"more than {self.max_body_bytes} bytes")
            if self.num_buffered_bytes + len(chunk) > self.max_buffered_bytes:
                if self.metrics is not None:
                    self.metrics.rejections.labels("too_many_uploads").inc()
                raise rate_limited("the proxy is receiving too many large request bodies at once; retry shortly",
                                   "too_many_uploads", 1)
            self.num_buffered_bytes += len(chunk)
            chunks.append(chunk)

    def _too_large(self, size: str) -> ApiError:
        return ApiError(413, f"request body is {size}; the limit is {self.max_body_bytes} bytes",
                        code="request_too_large")


def parse_json(raw: bytes) -> Any:
    """The body as JSON: strict UTF-8, nested at most MAX_JSON_DEPTH deep, numbers finite (no
    NaN or Infinity, as literals or overflowing), no lone surrogates (escapes \\uD800-\\uDFFF
    not in a pair). Raises ApiError (400). Costs one pass over the parsed values only for bodies
    with many brackets or surrogate escapes."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8: {exc}") from exc
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError as exc:  # NOTE: the C parser's own guard, well before the C stack is at risk
        raise _too_deep() from exc
    except ValueError as exc:  # JSONDecodeError, a refused number, an integer of over 4,300 digits
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH:
        _check_depth(data)
    if _SURROGATE_ESCAPE.search(raw):
        _check_no_lone_surrogates(data)
    return data


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid JSON number")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"number {literal[:40]} is out of range (not a finite double)")
    return value


def _too_deep() -> ApiError:
    return ApiError(400, f"request body is nested more than {MAX_JSON_DEPTH} levels deep")


def _check_depth(data: Any) -> None:
    """Raises ApiError (400) if arrays and objects nest deeper than MAX_JSON_DEPTH; level by
    level, so no recursion."""
    level = [data] if isinstance(data, _CONTAINERS) else []
    depth = 0
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        level = [child for item in level for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, _CONTAINERS)]


def _check_no_lone_surrogates(data: Any) -> None:
    """Raises ApiError (400) naming the first string (key or value) holding a lone surrogate."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _check_string(item)
        elif isinstance(item, dict):
            for key, value in item.items():
                _check_string(key)
                stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)


def _check_string(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"request body holds a lone surrogate (\\u{ord(text[exc.start]):04x}) in a string: "
                            "not valid Unicode text") from exc
