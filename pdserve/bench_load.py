"""The load of `pdserve bench`: when each session starts (Poisson, constant or gamma arrivals, as
vLLM's benchmark_serving schedules them), the --max-concurrency slots, warm-up, progress bar."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
from tqdm import tqdm

from pdserve.bench_client import RequestRecord, http_session, request_body, send
from pdserve.bench_config import BenchConfig, LoadConfig
from pdserve.bench_datasets import Dataset, Session


@dataclass
class LoadResult:
    """Every request's record (ordered by request_idx) and the run's length: from the first
    arrival's scheduling to the last answer (vLLM's benchmark duration)."""

    records: list[RequestRecord]
    duration_s: float


def arrival_offsets(num_arrivals: int, load: LoadConfig) -> list[float]:
    """Seconds from the run's start at which each arrival (request, or session's first turn)
    comes. As vLLM's: gaps are gamma(shape=b, scale=1/(rate*b)) (b = 1: exponential, Poisson;
    constant: 1/rate), summed, then scaled so the last arrival is at num_arrivals / rate, which
    makes the mean rate exact whatever the draw; an infinite rate sends all at once."""
    if math.isinf(load.request_rate):
        return [0.0] * num_arrivals
    if load.arrival == "constant":
        gaps = np.full(num_arrivals, 1.0 / load.request_rate)
    else:
        shape = load.burstiness if load.arrival == "gamma" else 1.0
        gaps = np.random.default_rng(load.seed).gamma(shape, 1.0 / (load.request_rate * shape), num_arrivals)
    offsets = np.cumsum(gaps)
    return (offsets * (num_arrivals / load.request_rate / offsets[-1])).tolist()


async def run_load(config: BenchConfig, model: str, dataset: Dataset, desc: str = "bench") -> LoadResult:
    """Run every session of dataset against config.endpoint on config.load's schedule; blocks
    until all are answered or failed (each request is bounded by endpoint.timeout_s)."""
    run = _Run(config, model, dataset, desc)
    async with run.client():
        return await run.go()


class _Run:
    """One run's shared state: the HTTP client, concurrency slots, progress bar and records."""

    def __init__(self, config: BenchConfig, model: str, dataset: Dataset, desc: str) -> None:
        self.config, self.model, self.dataset, self.desc = config, model, dataset, desc
        limit = config.load.max_concurrency
        self.slots = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()
        self.records: list[RequestRecord] = []
        self.http: aiohttp.ClientSession | None = None
        self.start = 0.0

    @contextlib.asynccontextmanager
    async def client(self):
        async with http_session(self.config.load.max_concurrency, self.config.endpoint.timeout_s) as http:
            self.http = http
            yield

    async def go(self) -> LoadResult:
        sessions = self.dataset.sessions
        offsets = arrival_offsets(len(sessions), self.config.load)
        first_idxs = np.cumsum([0] + [len(s.turns) for s in sessions]).tolist()
        with tqdm(total=self.dataset.num_requests, desc=self.desc, file=sys.stderr,
                  disable=not self.config.load.show_progress) as progress:
            self.start = time.perf_counter()
            tasks = []
            for session_idx, session in enumerate(sessions):
                await asyncio.sleep(max(0.0, self.start + offsets[session_idx] - time.perf_counter()))
                tasks.append(asyncio.create_task(self._session(session_idx, session, first_idxs[session_idx],
                                                               progress)))
            await asyncio.gather(*tasks)
            duration_s = time.perf_counter() - self.start
        return LoadResult(sorted(self.records, key=lambda r: r.request_idx), duration_s)

    async def _session(self, session_idx: int, session: Session, first_idx: int, progress: tqdm) -> None:
        """The session's turns in order, each sent once the previous one is answered; after a
        failed turn the rest are recorded as failed, not sent (they have no history to send)."""
        answers: list[str] = []
        for turn_idx, turn in enumerate(session.turns):
            record = RequestRecord(first_idx + turn_idx, session_idx, turn_idx,
                                   num_prompt_tokens=turn.num_prompt_tokens)
            if len(answers) < turn_idx:
                record.error = f"not sent: turn {turn_idx - 1} of session {session_idx} failed"
                record.start_s = record.end_s = time.perf_counter() - self.start
            else:
                await self._send(record, request_body(self.config.endpoint, self.model, session, turn_idx, answers,
                                                      self.config.dataset.is_ignore_eos))
                if record.is_ok:
                    answers.append(record.text)
            self.records.append(record)
            progress.update(1)

    async def _send(self, record: RequestRecord, body: dict) -> None:
        queued_at = time.perf_counter()
        async with self.slots:
            record.queue_s = time.perf_counter() - queued_at
            await send(self.http, self.config.endpoint, body, record, self.start)
