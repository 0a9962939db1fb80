"""The proxy's own drain on SIGTERM: no new requests (503, /ready 503) while the open ones get
drain_timeout_s to finish; those still open then end with an error (a streaming one with an
error event and [DONE]); then the server exits. SIGINT (and a second SIGTERM) still stop at once,
as uvicorn does."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn

from proxy.admission import Admission
from proxy.errors import ApiError
from proxy.nodes import NodePool

logger = logging.getLogger(__name__)

_POLL_S = 0.05
# After the deadline: how long the ended requests get to write their error events and [DONE]
# (each only has to send a few bytes) before uvicorn's own shutdown cuts what is left.
_END_GRACE_S = 5.0


class ProxyDrain:
    """Drains one app: admission refuses new requests once started (see Admission.enter), and
    the requests in flight (admission.num_in_flight) are waited for, then ended."""

    def __init__(self, admission: Admission, pool: NodePool, timeout_s: float) -> None:
        self.admission = admission
        self.pool = pool
        self.timeout_s = timeout_s
        self._task: asyncio.Task | None = None

    @property
    def is_draining(self) -> bool:
        return self.admission.is_draining

    def start(self, on_drained) -> None:
        """Begin draining (on the event loop's thread); on_drained() is called once nothing is in
        flight any more, or when the open requests were ended."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drain(on_drained))

    async def _drain(self, on_drained) -> None:
        admission = self.admission
        admission.is_draining = True
        logger.info("draining: new requests get 503; %d in flight get up to %.0f s to finish",
                    admission.num_in_flight, self.timeout_s)
        if not await _wait_idle(admission, self.timeout_s):
            logger.warning("drain timeout (%.0f s): ending %d requests still in flight", self.timeout_s,
                           admission.num_in_flight)
            self._end_open_requests()
            await _wait_idle(admission, _END_GRACE_S)
        logger.info("drained: shutting down")
        on_drained()

    def _end_open_requests(self) -> None:
        """Fail every request waiting on a node's messages: its choice ends with this error (an
        SSE error event and [DONE] on a stream) and aborts on its node."""
        error = ApiError(503, f"the server is shutting down: this request did not finish within the drain "
                              f"timeout ({self.timeout_s:g} s)", kind="server_error")
        for node in self.pool.all:
            for queue in node.queues.values():
                queue.put_nowait(error)


async def _wait_idle(admission: Admission, timeout_s: float) -> bool:
    """Whether nothing was in flight any more within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while admission.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)
    return not admission.num_in_flight


class DrainingServer(uvicorn.Server):
    """uvicorn's server with SIGTERM draining first (ProxyDrain); the socket stays open meanwhile,
    so clients and load balancers get a 503 rather than a refused connection."""

    def __init__(self, config: uvicorn.Config, drain: ProxyDrain) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        is_first_term = sig == signal.SIGTERM and not self.should_exit and not self.drain.is_draining
        if not is_first_term or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self.drain.start, self._drained)

    def _drained(self) -> None:
        self.should_exit = True
