"""`pdserve tune`, part 2: a discrete-event simulation of a Layout serving a workload on a Profile's
step times (arrivals -> prefill queue -> KV pull -> decode batch; colocated: one engine doing both
with chunked prefill), SLO attainment at a rate, and the goodput rate found by bisection."""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pdserve.bench_config import LoadConfig
from pdserve.bench_load import arrival_offsets
from pdserve.tune_profile import Profile, Profiles, attention_pairs
from pdserve.tune_space import Layout, Slo, Workload

# NOTE: what the simulation keeps and leaves out. Kept: each node's step loop as engine.scheduler
# runs it (running requests first, a decode token or the next prompt chunk each, under
# max_num_batched_tokens; then waiting prompts FCFS while max_num_seqs and KV room last), so batched
# prefills finish together and colocated prefill chunks stall the decodes they share a step with;
# step times from the profile (prefill by tokens and attention pairs, decode by sequences and
# context tokens, a mixed step as their sum with one fixed cost), times the profile's contention
# factor for a step started while another node is mid-step; the proxy's routing (prefill: fewest queued prompt tokens;
# decode/colocated: most free KV, then fewest requests); a decode node starting pulls only between
# steps and below max_num_seqs, each pull lasting profile.transfer_s of the prompt's last chunk (the
# rest streamed while it was prefilled: streamed_tail), the request joining at the next step.
# Left out: preemption (a request reserves its whole KV at admission), a streamed prompt's decode
# blocks taken from its first chunk on and chunks shared with other prompts in a step, the proxy's, HTTP's and the
# node loop's own CPU time apart from the fixed per-step cost the served calibration adds (tune.py),
# the proxy's conditional disaggregation (layouts run with it off), report staleness, EOS (the
# workload asks for exactly output_len tokens), and other load on the machine.

# NOTE: past this many times the units' prefill capacity the arrivals of one run are a burst;
# an SLO still met there holds at any rate.
_UNBOUNDED_FACTOR = 1e3


@dataclass
class _Job:
    """One request's progress; num_computed counts tokens whose KV exists."""

    idx: int
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed: int = 0
    num_generated: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.num_prompt_tokens

    @property
    def is_done(self) -> bool:
        return self.num_generated >= self.num_output_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_generated

    @property
    def num_reserved_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


class _Engine:
    """One node's engine as the real Scheduler runs it: running requests first (a decode token
    each, or their next prompt chunk) under the token budget, then waiting ones FCFS while
    budget, max_num_seqs and KV room last. Decode role: pulls start while running + joined +
    pulling < max_num_seqs and KV room lasts; a pulled request joins at the next step."""

    def __init__(self, role: str, layout: Layout, profile: Profile) -> None:
        self.role = role  # "prefill", "decode" or "colocated"
        self.layout, self.profile = layout, profile
        self.waiting: deque[_Job] = deque()
        self.admission: deque[_Job] = deque()  # decode role: prefilled elsewhere, waiting for a pull
        self.joined: list[_Job] = []
        self.running: list[_Job] = []
        self.assigned: set[int] = set()  # every job routed here and not finished (the proxy's view)
        self.num_pulls = 0
        self.num_held_tokens = 0
        self.batch: list[tuple[_Job, int]] = []
        self.is_busy = False

    def reserved_tokens(self, job: _Job) -> int:
        """KV a job holds here: its whole length, reserved at admission (no preemption is
        modelled); a prefill node holds the prompt only."""
        return job.num_prompt_tokens if self.role == "prefill" else job.num_reserved_tokens

    def has_room(self, job: _Job) -> bool:
        return self.num_held_tokens + self.reserved_tokens(job) <= self.profile.kv_capacity_tokens

    def schedule(self) -> list[tuple[_Job, int]]:
        self.running.extend(self.joined)
        self.joined.clear()
        budget, batch = self.layout.max_num_batched_tokens, []
        for job in self.running:
            if budget <= 0:
                break
            num_new = min(job.num_prompt_tokens - job.num_computed, budget) if job.is_prefilling else 1
            batch.append((job, num_new))
            budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.layout.max_num_seqs:
            job = self.waiting[0]
            if not self.has_room(job):
                break
            self.waiting.popleft()
            self.num_held_tokens += self.reserved_tokens(job)
            self.running.append(job)
            num_new = min(job.num_prompt_tokens - job.num_computed, budget)
            batch.append((job, num_new))
            budget -= num_new
        return batch

    def step_s(self, batch: list[tuple[_Job, int]]) -> float:
        decodes = [job for job, _ in batch if not job.is_prefilling]
        chunks = [(job, n) for job, n in batch if job.is_prefilling]
        return self.profile.step_s(len(decodes), sum(job.num_computed + 1 for job in decodes),
                                   sum(n for _, n in chunks),
                                   sum(attention_pairs(n, job.num_computed) for job, n in chunks))

    def finish_step(self, now_s: float) -> list[_Job]:
        """Apply the step's tokens; returns the jobs leaving this engine (finished, or prefilled
        on a prefill node)."""
        leaving = []
        for job, num_new in self.batch:
            if job.is_prefilling:
                job.num_computed += num_new
                if not job.is_prefilling:
                    job.num_generated, job.first_token_s = 1, now_s
            else:
                job.num_computed += 1
                job.num_generated += 1
            if job.is_done:
                job.last_token_s = now_s
            if job.is_done or (self.role == "prefill" and not job.is_prefilling):
                leaving.append(job)
        for job in leaving:
            self.running.remove(job)
            self.assigned.discard(job.idx)
            self.num_held_tokens -= self.reserved_tokens(job)
        self.batch, self.is_busy = [], False
        return leaving

    def queued_prompt_tokens(self) -> int:
        return sum(j.num_prompt_tokens - j.num_computed for j in [*self.waiting, *self.running] if j.is_prefilling)


class _Simulation:
    """The event loop: arrivals, step ends and pull completions, in time order. Each node runs on
    the profile of its tensor-parallel size."""

    def __init__(self, layout: Layout, profiles: Profiles) -> None:
        self.prefill = [_Engine("prefill", layout, profiles[layout.prefill_tp]) for _ in range(layout.num_prefill)]
        decode_role = "colocated" if layout.is_colocated else "decode"
        self.decode = [_Engine(decode_role, layout, profiles[layout.decode_tp]) for _ in range(layout.num_decode)]
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = 0
        self.jobs: dict[int, _Job] = {}

    def at(self, time_s: float, action: Callable[[float], None]) -> None:
        self._seq += 1
        heapq.heappush(self.events, (time_s, self._seq, action))

    def run(self, jobs: list[_Job]) -> None:
        for job in jobs:
            self.jobs[job.idx] = job
            self.at(job.arrival_s, lambda now, job=job: self.arrive(job, now))
        while self.events:
            now_s, _, action = heapq.heappop(self.events)
            action(now_s)

    def arrive(self, job: _Job, now_s: float) -> None:
        engine = min(self.prefill, key=_Engine.queued_prompt_tokens) if self.prefill else self.pick_decode()
        engine.assigned.add(job.idx)
        engine.waiting.append(job)
        self.kick(engine, now_s)

    def pick_decode(self) -> _Engine:
        """As the proxy: most free KV (everything routed there and unfinished counts), then fewest requests."""
        def score(engine: _Engine) -> tuple[int, int]:
            held = sum(self.jobs[idx].num_tokens for idx in engine.assigned)
            return engine.profile.kv_capacity_tokens - held, -len(engine.assigned)
        return max(self.decode, key=score)

    def kick(self, engine: _Engine, now_s: float) -> None:
        if engine.is_busy:
            return
        batch = engine.schedule()
        if batch:
            engine.batch, engine.is_busy = batch, True
            shared = any(e.is_busy for e in (*self.prefill, *self.decode) if e is not engine)
            step_s = engine.step_s(batch) * (engine.profile.contention if shared else 1.0)
            self.at(now_s + step_s, lambda now: self.step_end(engine, now))

    def step_end(self, engine: _Engine, now_s: float) -> None:
        for job in engine.finish_step(now_s):
            if engine.role == "prefill" and not job.is_done:
                self.hand_over(job, now_s)
        if engine.role == "decode":
            self.start_pulls(engine, now_s)
        self.kick(engine, now_s)

    def hand_over(self, job: _Job, now_s: float) -> None:
        engine = self.pick_decode()
        engine.assigned.add(job.idx)
        engine.admission.append(job)
        if not engine.is_busy:
            self.start_pulls(engine, now_s)

    def start_pulls(self, engine: _Engine, now_s: float) -> None:
        limit = engine.layout.max_num_seqs
        while (engine.admission and len(engine.running) + len(engine.joined) + engine.num_pulls < limit
               and engine.has_room(engine.admission[0])):
            job = engine.admission.popleft()
            engine.num_held_tokens += engine.reserved_tokens(job)
            engine.num_pulls += 1
            self.at(now_s + engine.profile.transfer_s(streamed_tail(job.num_prompt_tokens, engine.layout)),
                    lambda now, job=job: self.pulled(engine, job, now))

    def pulled(self, engine: _Engine, job: _Job, now_s: float) -> None:
        engine.num_pulls -= 1
        engine.joined.append(job)
        if not engine.is_busy:
            self.start_pulls(engine, now_s)
            self.kick(engine, now_s)


def streamed_tail(num_prompt_tokens: int, layout: Layout) -> int:
    """The prompt tokens whose KV a decode node still reads once the prompt is prefilled: the
    proxy streams by default (--kv-stream-min-tokens 0), so a prompt of several chunks has had
    all but its last chunk read while the prefill ran (architecture.md, KV streaming)."""
    budget = layout.max_num_batched_tokens
    return num_prompt_tokens - budget * ((num_prompt_tokens - 1) // budget)


@dataclass(frozen=True)
class SimOutcome:
    """Per request (in arrival order): TTFT, TPOT (0 with one output token), end-to-end; and the
    run's duration as pdserve bench counts it (from time 0, before the first arrival, to the
    last token)."""

    ttft_s: list[float]
    tpot_s: list[float]
    e2e_s: list[float]
    duration_s: float

    def attainment(self, slo: Slo) -> float:
        return sum(1 for t, p in zip(self.ttft_s, self.tpot_s) if slo.is_met(t, p)) / len(self.ttft_s)

    def p99_ms(self) -> dict[str, float]:
        return {name: float(np.percentile(np.asarray(values) * 1000.0, 99))
                for name, values in (("ttft", self.ttft_s), ("tpot", self.tpot_s))}


def simulate(layout: Layout, profile: Profile | Profiles, workload: Workload, arrivals_s: list[float]) -> SimOutcome:
    """Serve one request of workload's shape per arrival time, each node on the profile of its
    tensor-parallel size. Raises ValueError when one request cannot fit a node's KV cache (it
    would never be served) or a size was not profiled."""
    profiles = Profiles.of(profile)
    capacity = min(profiles[size].kv_capacity_tokens for size in layout.tp_sizes)
    if workload.input_len + workload.output_len > capacity:
        raise ValueError(f"a {workload.name} request needs {workload.input_len + workload.output_len} tokens of KV; "
                         f"a node holds {capacity}")
    jobs = [_Job(idx, at_s, workload.input_len, workload.output_len) for idx, at_s in enumerate(arrivals_s)]
    _Simulation(layout, profiles).run(jobs)
    assert all(j.last_token_s is not None for j in jobs), "simulation ended with unfinished requests"
    ttft = [j.first_token_s - j.arrival_s for j in jobs]
    tpot = [(j.last_token_s - j.first_token_s) / (j.num_output_tokens - 1) if j.num_output_tokens > 1 else 0.0
            for j in jobs]
    return SimOutcome(ttft, tpot, [j.last_token_s - j.arrival_s for j in jobs], max(j.last_token_s for j in jobs))


def bench_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """The arrival times `pdserve bench` uses for this many Poisson requests at rate with seed."""
    return arrival_offsets(num_requests, LoadConfig(request_rate=rate, seed=seed, show_progress=False))


@dataclass(frozen=True)
class SimPlan:
    """How runs are simulated: as many requests as a measured run, with the bench's arrival
    seeds (attainment is the mean over seeds)."""

    num_requests: int = 16
    seeds: tuple[int, ...] = (0,)
    rel_tol: float = 0.01  # the bisection stops when hi / lo < 1 + rel_tol


def attainment_at(layout: Layout, profile: Profile | Profiles, workload: Workload, slo: Slo, rate: float,
                  plan: SimPlan) -> float:
    outcomes = [simulate(layout, profile, workload, bench_arrivals(plan.num_requests, rate, s)) for s in plan.seeds]
    return sum(o.attainment(slo) for o in outcomes) / len(outcomes)


def predict_goodput(layout: Layout, profile: Profile | Profiles, workload: Workload, slo: Slo, plan: SimPlan) -> float:
    """The highest rate (req/s) whose simulated attainment is >= slo.target, by bisection between
    a rate where requests never overlap and one where attainment fails (doubling up from the
    units' prefill capacity); 0.0 if even lone requests miss the SLO; workload.rate_max caps it;
    math.inf when plan.num_requests requests all arriving at once still meet it (too few to
    load the layout)."""
    def passes(rate: float) -> bool:
        return attainment_at(layout, profile, workload, slo, rate, plan) >= slo.target

    capacity = layout.num_units / Profiles.of(profile).base.prefill_s(workload.input_len)
    hi = workload.rate_max if workload.rate_max is not None else capacity
    while passes(hi):
        if workload.rate_max is not None:
            return hi
        if hi > _UNBOUNDED_FACTOR * capacity:
            return math.inf
        hi *= 2.0
    lo = min(hi, capacity) / 1e3
    if not passes(lo):
        return 0.0
    while hi / lo > 1.0 + plan.rel_tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if passes(mid) else (lo, mid)
    return lo
