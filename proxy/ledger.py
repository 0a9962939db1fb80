"""RequestLedger: every generation request the proxy took on, from its admission to its end, and
how it ended. A request ends answered (its output, or an error: a status with an OpenAI error
body or an SSE error event), with its client gone first, or unanswered: the proxy stopped
working on it without telling the client anything (a bug; a stream cut off without [DONE] and
without an error event). The metrics export the open requests and the ends by outcome, so a
harness can check that every request it sent came to an answered end."""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Callable


class Outcome(enum.StrEnum):
    TOKENS = "tokens"  # the output, whole (a body, or a stream to [DONE])
    ERROR = "error"  # an error status with its body, or an SSE error event
    CLIENT_GONE = "client_gone"  # the client left before its answer
    UNANSWERED = "unanswered"  # ended with nothing said to a client still there: a bug


class RequestLedger:
    """Owned by the proxy's event loop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._open: dict[str, float] = {}  # request id -> when it was opened
        self.ends: Counter[Outcome] = Counter()

    def open(self, request_id: str) -> None:
        self._open[request_id] = self._clock()

    def end(self, request_id: str, outcome: Outcome) -> None:
        """The request ended so; the first end of an open request counts, any later one is ignored."""
        if self._open.pop(request_id, None) is not None:
            self.ends[outcome] += 1

    @property
    def num_open(self) -> int:
        return len(self._open)

    def oldest_open(self, limit: int = 10) -> list[tuple[str, float]]:
        """(request id, seconds open) of the longest-open requests, oldest first."""
        now = self._clock()
        return [(request_id, now - opened) for request_id, opened in list(self._open.items())[:limit]]
