"""`pdserve tune`, part 3 (also used by benchmarks/disagg_vs_colocated.py): start a deployment on
this machine, measure single-request latencies and SLO attainment at a rate with `pdserve bench`
(run_sweep), search rates for the one where attainment crosses the target, and read the goodput
off the measured points."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.bench import run_benchmark, run_sweep
from pdserve.bench_config import BenchConfig, DatasetConfig, EndpointConfig, LoadConfig, SloConfig
from pdserve.launcher import Deployment, start_local, wait_healthy
from pdserve.tune_space import Slo, Workload

# NOTE: random prompts draw token ids below this (pdserve bench's default vocab_high): every
# preset's vocabulary is at least this large.
_VOCAB_HIGH = 2000


@contextlib.contextmanager
def deployed(model_dir: Path, num_prefill: int, num_decode: int, node_args: list[str], proxy_args: list[str],
             log_dir: Path | None, tensor_parallel: tuple[int, int] = (1, 1),
             ready_timeout_s: float = 300.0) -> Iterator[Deployment]:
    """Start the nodes (one core per rank where the machine has enough: start_local pins them;
    tensor_parallel: the prefill and the decode nodes' sizes) and the proxy, wait for health,
    yield, and stop them all. Raises RuntimeError / TimeoutError (with the logs) when they do
    not come up."""
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    deployment = start_local(model_dir, num_prefill=num_prefill, num_decode=num_decode, node_args=node_args,
                             proxy_args=proxy_args, log_dir=log_dir, pin_cpus=True, tensor_parallel=tensor_parallel)
    try:
        wait_healthy(deployment, ready_timeout_s)
        yield deployment
    finally:
        deployment.stop()


def bench_config(base_url: str, workload: Workload, num_requests: int, slo: Slo | None, seed: int = 0,
                 arrival_seed: int = LoadConfig.seed) -> BenchConfig:
    """Poisson arrivals (drawn from arrival_seed; pdserve bench's default) of random token-id
    prompts (drawn from seed) of exactly workload.input_len tokens asking for exactly
    workload.output_len tokens (ignore_eos), streamed; the rate is set per run."""
    slo_config = SloConfig(slo.ttft_s * 1000.0, slo.tpot_s * 1000.0, slo.target) if slo else SloConfig()
    return BenchConfig(EndpointConfig(base_url=base_url),
                       DatasetConfig(num_requests=num_requests, input_len=workload.input_len,
                                     output_len=workload.output_len, vocab_high=_VOCAB_HIGH, seed=seed),
                       LoadConfig(seed=arrival_seed, show_progress=False), slo_config)


def warm_up(base_url: str, workload: Workload) -> None:
    """One request of the workload's prompt length and two output tokens (not measured), so
    first-use costs on the nodes and the proxy are paid before any measured run."""
    config = bench_config(base_url, replace(workload, output_len=2), 1, None, seed=90_000)
    run_benchmark(config)


@dataclass(frozen=True)
class SingleLatency:
    """Medians over requests sent one at a time into an idle deployment."""

    ttft_s: float
    tpot_s: float
    e2e_s: float
    num_requests: int

    def to_json(self) -> dict:
        return {"ttft_ms": 1000 * self.ttft_s, "tpot_ms": 1000 * self.tpot_s, "e2e_ms": 1000 * self.e2e_s,
                "num_requests": self.num_requests}


def single_latency(base_url: str, workload: Workload, num_requests: int = 2) -> SingleLatency:
    """Send num_requests one after another (max concurrency 1); raises RuntimeError if any fails."""
    config = bench_config(base_url, workload, num_requests, None, seed=80_000)
    config = replace(config, load=replace(config.load, max_concurrency=1))
    records = run_benchmark(config).records
    failed = [r.error for r in records if not r.is_ok]
    if failed:
        raise RuntimeError(f"single-request run failed: {failed[0]}")
    return SingleLatency(statistics.median(r.ttft_s for r in records),
                         statistics.median(r.tpot_s or 0.0 for r in records),
                         statistics.median(r.e2e_s for r in records), len(records))


@dataclass(frozen=True)
class BurstLatency:
    """Requests sent all at once into an idle deployment: when each was sent (from the run's
    start) and its TTFT and TPOT, in request order."""

    start_s: list[float]
    ttft_s: list[float]
    tpot_s: list[float]

    def to_json(self) -> dict:
        return {"num_requests": len(self.start_s), "ttft_ms": 1000 * statistics.mean(self.ttft_s),
                "tpot_ms": 1000 * statistics.mean(self.tpot_s)}


def burst_latency(base_url: str, workload: Workload, num_requests: int) -> BurstLatency:
    """Send num_requests at once (rate inf); raises RuntimeError if any fails."""
    config = bench_config(base_url, workload, num_requests, None, seed=70_000)
    records = sorted(run_benchmark(config).records, key=lambda r: r.request_idx)
    failed = [r.error for r in records if not r.is_ok]
    if failed:
        raise RuntimeError(f"burst run failed: {failed[0]}")
    return BurstLatency([r.start_s for r in records], [r.ttft_s for r in records],
                        [r.tpot_s or 0.0 for r in records])


def measure_rate(config: BenchConfig, rate: float, point_idx: int) -> dict:
    """One pdserve bench run at rate (run_sweep of one rate); its prompts come from dataset seed +
    point_idx, so no run repeats another's. Returns {"request_rate", "summary"}."""
    point_config = replace(config, dataset=replace(config.dataset, seed=config.dataset.seed + point_idx))
    points, _ = run_sweep(point_config, [rate])
    return {"request_rate": rate, "summary": points[0]["summary"]}


@dataclass(frozen=True)
class Crossing:
    """Where attainment crosses the target, read off measured (rate, attainment) points:
    "interpolated" between the highest passing rate and the next failing one above it;
    "at least" when every measured rate above the highest passing one is missing; "below"
    when none passes (rate is then None). grid_rate is pdserve bench's goodput rate (the
    highest passing rate)."""

    rate: float | None
    kind: str
    grid_rate: float | None

    def to_json(self) -> dict:
        return {"rate": self.rate, "kind": self.kind, "grid_rate": self.grid_rate}


def crossing(points: list[tuple[float, float]], target: float) -> Crossing:
    passing = [(r, a) for r, a in points if a >= target]
    if not passing:
        return Crossing(None, "below", None)
    low_rate, low_att = max(passing)
    above = [(r, a) for r, a in points if r > low_rate and a < target]
    if not above:
        return Crossing(low_rate, "at least", low_rate)
    high_rate, high_att = min(above)
    share = (low_att - target) / (low_att - high_att)
    return Crossing(low_rate + share * (high_rate - low_rate), "interpolated", low_rate)


def bracket_search(attainment_at: Callable[[float], float], start_rate: float, target: float, *, factor: float,
                   max_points: int, close_ratio: float, can_afford: Callable[[float], bool],
                   rate_max: float | None = None) -> list[tuple[float, float]]:
    """Measure rates until a passing rate and a failing one above it are within close_ratio:
    up by factor while all pass, down while all fail, then the geometric middle of the bracket.
    Stops at max_points, or before a rate can_afford refuses (the budget), or when the next
    rate would pass rate_max. Returns the (rate, attainment) points in measured order."""
    points: list[tuple[float, float]] = []
    rate: float | None = min(start_rate, rate_max) if rate_max else start_rate
    while rate is not None and len(points) < max_points and can_afford(rate):
        points.append((rate, attainment_at(rate)))
        rate = _next_rate(points, target, factor, close_ratio, rate_max)
    return points


def _next_rate(points: list[tuple[float, float]], target: float, factor: float, close_ratio: float,
               rate_max: float | None) -> float | None:
    passing = [r for r, a in points if a >= target]
    if not passing:
        return min(r for r, _ in points) / factor
    low = max(passing)
    failing = [r for r, a in points if a < target and r > low]
    if not failing:
        up = low * factor
        return None if rate_max is not None and low >= rate_max else min(up, rate_max or math.inf)
    high = min(failing)
    return None if high / low <= close_ratio else math.sqrt(low * high)


class Clock:
    """Seconds since start and left before a deadline."""

    def __init__(self, budget_s: float) -> None:
        self.started = time.monotonic()
        self.deadline = self.started + budget_s

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def left_s(self) -> float:
        return self.deadline - time.monotonic()
