"""GrammarGate: structured requests wait here, off the step loop, while worker threads compile
their grammars.

A grammar's cost is the client's to choose: compiled on the node's loop, one schema held every
other request (and the node's progress, so the proxy judged the node stuck). Here a request whose
grammar is neither compiled nor refused yet is parked; a bounded pool of threads compiles each
distinct spec once (xgrammar works without the GIL), and the loop, polling each iteration, admits
the parked requests whose grammar is ready. A compile past its time budget is a 400 for every request that
asked for it, and for every later one with its schema while it runs on (its thread cannot be
stopped); should it finish after all, its grammar is kept and serves later requests. A request
whose compile no thread took up within the budget (every one busy) is refused with QueueFull,
which the proxy retries on another node. The budget counts the compile alone: the first one's
set-up (loading the tokenizer, once per node) is not the schema's cost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from engine import protocol
from engine.grammar import GrammarKey, GrammarRefused, Grammars
from engine.protocol import StructuredOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Refusal:
    """A parked request the gate gives up on: answer it with an ErrorReply of this kind."""

    message: protocol.PrefillRequest | protocol.DecodeRequest
    kind: str
    text: str
    is_client_error: bool


@dataclass
class _Compile:
    spec: StructuredOutput
    future: Future
    submitted_at: float
    picked_at: float | None = None  # set by the worker thread when it takes the job
    started_at: float | None = None  # set by the worker thread when the compile itself starts
    request_ids: list[str] = field(default_factory=list)


# NOTE: the niceness of a grammar thread (Linux sets it per thread): where cores are short the
# model's threads get about three times its share. At 19 a busy 2-core node took 15 s instead of 5
# for its first compile's set-up, which would push legitimate schemas past their budget.
_GRAMMAR_NICENESS = 5


def _yield_cpu() -> None:
    """Run this (grammar) thread at low priority, where the OS allows it."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _GRAMMAR_NICENESS)


class GrammarGate:
    """Owned by a node's loop (not thread-safe apart from what the workers set)."""

    def __init__(self, grammars: Grammars, threads: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.grammars = grammars
        self.threads = threads  # compiles at once; each uses a core beside the model's
        self.timeout_s = timeout_s  # longest one compile may take, and longest one may wait to start
        self._clock = clock
        self._pool: ThreadPoolExecutor | None = None  # started on the first structured request
        self._compiles: dict[GrammarKey, _Compile] = {}
        self._parked: dict[str, tuple[protocol.PrefillRequest | protocol.DecodeRequest, GrammarKey]] = {}
        self.num_timeouts = 0  # compiles refused past the budget
        self.num_busy_refusals = 0  # requests refused because no worker started their compile in time
        self._runaway: set[Future] = set()  # compiles past the budget still running on a worker
        self._late: list[tuple[StructuredOutput, object]] = []  # runaway compiles that finished after all

    @property
    def num_runaway(self) -> int:
        """Compiles past their budget still running on a worker thread."""
        return len(self._runaway)

    def __len__(self) -> int:
        """Requests parked here."""
        return len(self._parked)

    def park_if_compiling(self, message: protocol.PrefillRequest | protocol.DecodeRequest) -> bool:
        """True when message waits here for its grammar (the caller admits it later, from
        poll); False when it needs no wait (no grammar, or its grammar is compiled or refused:
        admitting it answers at once)."""
        spec = message.sampling.structured
        if spec is None or self.grammars.is_ready(spec):
            return False
        key = Grammars.key(spec)
        job = self._compiles.get(key)
        if job is None:
            job = _Compile(spec, Future(), self._clock())
            job.future = self._workers().submit(self._build, job)
            self._compiles[key] = job
        job.request_ids.append(message.request_id)
        self._parked[message.request_id] = (message, key)
        return True

    def discard(self, request_id: str) -> None:
        """Forget a parked request (aborted, or its proxy gone); no-op for others."""
        self._parked.pop(request_id, None)

    def poll(self) -> tuple[list[protocol.PrefillRequest | protocol.DecodeRequest], list[Refusal]]:
        """The parked requests whose grammar is now compiled or refused (to admit: the engine
        answers them from its caches), and those the gate refuses itself (over the budget)."""
        while self._late:  # NOTE: appended by worker threads; pop is atomic
            spec, compiled = self._late.pop()
            self.grammars.store(spec, compiled)
        if not self._compiles:
            return [], []
        ready: list = []
        refused: list[Refusal] = []
        now = self._clock()
        for key, job in list(self._compiles.items()):
            if job.future.done():
                del self._compiles[key]
                exc = job.future.exception()
                if exc is None:
                    self.grammars.store(job.spec, job.future.result())
                elif isinstance(exc, GrammarRefused):
                    self.grammars.refuse(job.spec, str(exc))
                else:  # not the schema's fault (no tokenizer, ...): the requests fail, nothing is kept
                    refused.extend(Refusal(m, type(exc).__name__, str(exc), False) for m in self._take(job))
                    continue
                ready.extend(self._take(job))  # admitting them answers from the engine's caches
            elif job.picked_at is None and now - job.submitted_at > self.timeout_s and job.future.cancel():
                del self._compiles[key]
                self.num_busy_refusals += len(job.request_ids)
                text = (f"every grammar worker was busy for {self.timeout_s:g} s (--grammar-compile-timeout-s);"
                        " the request can be retried")
                refused.extend(Refusal(m, protocol.QUEUE_FULL_ERROR_KIND, text, False) for m in self._take(job))
            elif job.started_at is not None and now - job.started_at > self.timeout_s:
                del self._compiles[key]
                self.num_timeouts += 1
                self._runaway.add(job.future)
                job.future.add_done_callback(lambda future, spec=job.spec: self._runaway_done(spec, future))
                what = protocol.STRUCTURED_FIELDS.get(job.spec.kind, "the structured output")
                why = (f"{what} is too costly to enforce: its grammar took over {self.timeout_s:g} s "
                       "to compile (--grammar-compile-timeout-s)")
                self.grammars.refuse(job.spec, why)
                logger.warning("a grammar compile passed its %.1f s budget: refused from now on (%d requests)",
                               self.timeout_s, len(job.request_ids))
                ready.extend(self._take(job))  # admitting them answers the refusal
        return ready, refused

    def wait(self, timeout_s: float) -> None:
        """Block until every compile under way has finished, or timeout_s passed (for callers
        that turn a loop by hand, as tests do; the node's loop never waits here)."""
        if self._compiles:
            wait([job.future for job in self._compiles.values()], timeout_s)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _workers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="grammar", initializer=_yield_cpu)
        return self._pool

    def _build(self, job: _Compile):
        job.picked_at = self._clock()
        self.grammars.prepare()
        job.started_at = self._clock()
        return self.grammars.build(job.spec)

    def _take(self, job: _Compile) -> list:
        """The still-parked requests of job, unparked."""
        taken = []
        for request_id in job.request_ids:
            parked = self._parked.pop(request_id, None)
            if parked is not None:
                taken.append(parked[0])
        return taken

    def _runaway_done(self, spec: StructuredOutput, future: Future) -> None:
        """On the worker thread: a compile past its budget ended; its grammar, if it made one,
        goes to the engine's cache on the loop's next poll."""
        if not future.cancelled() and future.exception() is None:
            self._late.append((spec, future.result()))
        self._runaway.discard(future)
