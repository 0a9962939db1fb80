"""Reading request bodies within bounds: the size (413), a total deadline and a minimum rate (408,
and the connection closed), uploads at once per client (429), and the bytes large bodies hold at
once (429). A body's first SMALL_BODY_BYTES never count toward the latter, so large uploads,
stalled or not, cannot crowd out small ones."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from fastapi import Request
from starlette.requests import ClientDisconnect

from proxy.clients import ClientCounts, client_id
from proxy.errors import ApiError, ClientGone, rate_limited
from proxy.metrics import ProxyMetrics

logger = logging.getLogger(__name__)

# NOTE: as app._PARSE_IN_THREAD_BYTES: a chat request with a long conversation, not a bulk upload.
SMALL_BODY_BYTES = 256 << 10
# Bytes past SMALL_BODY_BYTES that uploads in progress may hold at once, in largest bodies: past
# it new large uploads get a 429, so slow ones cannot pile up memory (each holds what it read).
_MAX_FULL_BODIES_BUFFERED = 16
_CLOSE = {"Connection": "close"}  # NOTE: uvicorn closes the connection after a response saying so


@dataclass(frozen=True)
class UploadLimits:
    """max_body_bytes: 413 past it. timeout_s: the whole body's deadline. min_bytes_per_s: every
    window of rate_window_s from the body's start must bring min_bytes_per_s * rate_window_s bytes;
    None: no minimum. max_client_uploads: bodies one client may be
    sending at once; None: no cap."""

    max_body_bytes: int
    timeout_s: float
    min_bytes_per_s: float | None = None
    rate_window_s: float = 5.0
    max_client_uploads: int | None = None


class UploadPace:
    """A body's arrival in consecutive windows of window_s from started_at: each must bring
    num_needed bytes. O(1) per chunk (a stall is caught within one to two windows)."""

    def __init__(self, started_at: float, min_bytes_per_s: float, window_s: float) -> None:
        self.started_at = started_at
        self.window_s = window_s
        self.num_needed = min_bytes_per_s * window_s
        self._window_idx = 0
        self._num_bytes = 0  # in window _window_idx

    def add(self, now: float, num_bytes: int) -> None:
        window_idx = self._window_of(now)
        if window_idx != self._window_idx:
            self._window_idx, self._num_bytes = window_idx, 0
        self._num_bytes += num_bytes

    def deadline(self) -> float:
        """When the body falls behind if nothing more arrives: the current window's end, or the
        next one's if this one has brought enough."""
        end = self.started_at + (self._window_idx + 1) * self.window_s
        return end + self.window_s if self._num_bytes >= self.num_needed else end

    def num_bytes_short(self) -> int:
        """The bytes brought in the window ending at deadline() (the one that fell short once it passed)."""
        return self._num_bytes if self._window_of(self.deadline() - self.window_s / 2) == self._window_idx else 0

    def _window_of(self, now: float) -> int:
        return int((now - self.started_at) // self.window_s)


@dataclass
class _Upload:
    client: str
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    num_large_bytes: int = 0  # past SMALL_BODY_BYTES, counted in BodyReader.num_large_bytes


class BodyReader:
    """Reads request bodies within UploadLimits; one per app (it counts the uploads in progress)."""

    def __init__(self, limits: UploadLimits, metrics: ProxyMetrics | None = None) -> None:
        self.limits = limits
        self.metrics = metrics
        self.max_large_bytes = limits.max_body_bytes * _MAX_FULL_BODIES_BUFFERED
        self.num_large_bytes = 0  # held by uploads in progress
        self.uploads = ClientCounts(limits.max_client_uploads)

    async def read(self, request: Request) -> bytes:
        """The whole body; raises ApiError (400 bad Content-Length, 408, 413, 429) or ClientGone."""
        self._check_declared(request.headers.get("content-length"))
        upload = _Upload(client_id(request))
        if not self.uploads.can_take(upload.client, 1):
            raise self._refuse("max_client_uploads", f"this client is sending {self.uploads.limit} request bodies "
                               f"at once, its limit (max_client_uploads); retry once one has arrived")
        self.uploads.take(upload.client, 1)
        try:
            await self._read_in_time(request, upload)
        except ClientDisconnect:
            raise ClientGone(f"{upload.size} bytes read") from None
        finally:
            self.uploads.free(upload.client, 1)
            self.num_large_bytes -= upload.num_large_bytes
        return b"".join(upload.chunks)

    def _check_declared(self, declared: str | None) -> None:
        if declared is None:
            return
        if not (declared.isascii() and declared.isdigit()):
            raise ApiError(400, f"Content-Length must be a number of bytes, got {declared[:40]!r}")
        if int(declared) > self.limits.max_body_bytes:
            raise self._too_large(f"{int(declared)} bytes")

    async def _read_in_time(self, request: Request, upload: _Upload) -> None:
        limits = self.limits
        loop = asyncio.get_running_loop()
        pace = None if limits.min_bytes_per_s is None else UploadPace(loop.time(), limits.min_bytes_per_s,
                                                                      limits.rate_window_s)
        # NOTE: asyncio.timeout, not wait_for (see request_flow._next)
        slow = asyncio.timeout(None if pace is None else pace.deadline())
        try:
            async with asyncio.timeout(limits.timeout_s), slow:
                async for chunk in request.stream():
                    self._keep(chunk, upload)
                    if pace is not None:
                        pace.add(loop.time(), len(chunk))
                        slow.reschedule(pace.deadline())
        except TimeoutError as exc:
            raise self._late(upload, pace if slow.expired() else None) from exc

    def _keep(self, chunk: bytes, upload: _Upload) -> None:
        """Add chunk to upload; raises ApiError 413 past max_body_bytes, 429 past the large bytes."""
        size = upload.size + len(chunk)
        if size > self.limits.max_body_bytes:
            raise self._too_large(f"more than {self.limits.max_body_bytes} bytes")
        num_large = max(0, size - SMALL_BODY_BYTES) - max(0, upload.size - SMALL_BODY_BYTES)
        if num_large and self.num_large_bytes + num_large > self.max_large_bytes:
            raise self._refuse("too_many_uploads", "the proxy is receiving too many large request bodies at once; "
                               "retry shortly")
        self.num_large_bytes += num_large
        upload.num_large_bytes += num_large
        upload.size = size
        upload.chunks.append(chunk)

    def _late(self, upload: _Upload, pace: UploadPace | None) -> ApiError:
        if pace is None:
            message = f"the request body did not arrive within {self.limits.timeout_s:g} s"
        else:
            message = (f"the request body arrived slower than {self.limits.min_bytes_per_s:g} bytes/s (the minimum "
                       f"over each {pace.window_s:g} s; {pace.num_bytes_short()} bytes in the last one)")
        logger.info("client %s: %s after %d bytes; closing the connection", upload.client, message, upload.size)
        return ApiError(408, message, code="request_timeout", headers=_CLOSE)

    def _refuse(self, reason: str, message: str) -> ApiError:
        if self.metrics is not None:
            self.metrics.rejections.labels(reason).inc()
        return rate_limited(message, reason, 1)

    def _too_large(self, size: str) -> ApiError:
        return ApiError(413, f"request body is {size}; the limit is {self.limits.max_body_bytes} bytes",
                        code="request_too_large")
