"""The numbers of `pdserve bench`, defined as vLLM's benchmark_serving defines them: latency
distributions (numpy.percentile, linear interpolation), throughputs over the run's duration,
SLO attainment and goodput, peak concurrency, and a sweep's goodput rate."""

from __future__ import annotations

import collections
import math

import numpy as np

from pdserve.bench_client import RequestRecord
from pdserve.bench_config import SloConfig

PERCENTILES = (50, 90, 95, 99)


def distribution_ms(values_s: list[float]) -> dict[str, float] | None:
    """Mean, standard deviation and PERCENTILES of values (seconds) in milliseconds; None if empty."""
    if not values_s:
        return None
    values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    stats = {"mean": float(values_ms.mean()), "std": float(values_ms.std())}
    return stats | {f"p{p}": float(np.percentile(values_ms, p)) for p in PERCENTILES}


def meets_slo(record: RequestRecord, slo: SloConfig) -> bool:
    """Succeeded, and TTFT and TPOT are within the targets that are set (a request with fewer
    than 2 output tokens has TPOT 0 here, as in vLLM's goodput)."""
    if not record.is_ok:
        return False
    if slo.ttft_ms is not None and record.ttft_s * 1000.0 > slo.ttft_ms:
        return False
    tpot_s = record.tpot_s or 0.0
    return slo.tpot_ms is None or tpot_s * 1000.0 <= slo.tpot_ms


def summarize(records: list[RequestRecord], duration_s: float, slo: SloConfig) -> dict:
    """The run's summary (a JSON-ready dict). Throughputs divide by duration_s; token counts
    and latencies are of completed requests; SLO figures are None when no target is set."""
    done = [r for r in records if r.is_ok]
    failed = [r for r in records if not r.is_ok]
    num_input_tokens = sum(r.num_prompt_tokens or 0 for r in done)
    num_output_tokens = sum(r.num_output_tokens for r in done)
    summary = {
        "num_requests": len(records), "num_completed": len(done), "num_failed": len(failed),
        "failures": [{"request_idx": r.request_idx, "error": r.error} for r in failed],
        "failure_reasons": dict(collections.Counter(_reason(r.error) for r in failed)),
        "duration_s": duration_s,
        "total_input_tokens": num_input_tokens, "total_output_tokens": num_output_tokens,
        "request_throughput": _per_s(len(done), duration_s),
        "output_throughput": _per_s(num_output_tokens, duration_s),
        "total_token_throughput": _per_s(num_input_tokens + num_output_tokens, duration_s),
        "ttft_ms": distribution_ms([r.ttft_s for r in done]),
        "tpot_ms": distribution_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in done]),
        "peak_concurrency": peak_concurrency(records),
        "output_tokens_source": dict(collections.Counter(r.output_tokens_source for r in done)),
    }
    return summary | slo_summary(records, duration_s, slo)


def slo_summary(records: list[RequestRecord], duration_s: float, slo: SloConfig) -> dict:
    """attainment: the share of all requests (failures count as misses) meeting the SLO;
    goodput_req_s: such requests per second of the run."""
    num_good = sum(1 for r in records if meets_slo(r, slo))
    is_set = slo.is_set and bool(records)
    return {"slo_ttft_ms": slo.ttft_ms, "slo_tpot_ms": slo.tpot_ms,
            "slo_attainment": num_good / len(records) if is_set else None,
            "goodput_req_s": _per_s(num_good, duration_s) if is_set else None}


def _per_s(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0


def _reason(error: str) -> str:
    """An error's kind for counting: its first line up to the first colon."""
    return error.splitlines()[0].split(":", 1)[0] if error else ""


def in_flight_steps(records: list[RequestRecord]) -> tuple[list[float], list[int]]:
    """Requests in flight over time: at times[i] the count becomes counts[i]. A request is in
    flight over [start_s, end_s) (sent to last chunk)."""
    return count_steps([(r.start_s, r.end_s) for r in records])


def waiting_steps(records: list[RequestRecord]) -> tuple[list[float], list[int]]:
    """Requests that arrived but wait for a --max-concurrency slot, over time (as in_flight_steps)."""
    return count_steps([(r.start_s - r.queue_s, r.start_s) for r in records if r.queue_s > 0])


def count_steps(intervals: list[tuple[float, float]]) -> tuple[list[float], list[int]]:
    """How many half-open [begin, end) intervals hold over time; at equal times ends come first."""
    events = sorted([(begin, 1) for begin, _ in intervals] + [(end, -1) for _, end in intervals])
    times, counts, current = [0.0], [0], 0
    for at_s, change in events:
        current += change
        times.append(at_s)
        counts.append(current)
    return times, counts


def peak_concurrency(records: list[RequestRecord]) -> int:
    return max(in_flight_steps(records)[1])


def goodput_rate(points: list[tuple[float, float | None]], target: float) -> float | None:
    """The highest swept request rate whose attainment is >= target; None if none is."""
    passing = [rate for rate, attainment in points if attainment is not None and attainment >= target]
    return max(passing) if passing else None


def is_attainment_monotone(points: list[tuple[float, float | None]]) -> bool:
    """Whether attainment never rises with the rate (it should not; a rise means noise)."""
    ordered = [a for _, a in sorted(points, key=lambda p: p[0]) if a is not None]
    return all(later <= earlier + 1e-12 for earlier, later in zip(ordered, ordered[1:]))


def parse_rates(text: str) -> list[float]:
    """"1,2,4.5,inf" -> [1.0, 2.0, 4.5, inf]; raises ValueError for a non-positive or bad rate."""
    rates = [float(part) for part in text.split(",") if part.strip()]
    if not rates or any(not rate > 0 or math.isnan(rate) for rate in rates):
        raise ValueError(f"--sweep needs positive rates separated by commas, got {text!r}")
    return rates
