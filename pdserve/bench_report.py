"""What `pdserve bench` shows: the human table (stdout), the result JSON, and PNG plots (latency
CDFs, requests in flight over time, SLO attainment against request rate)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from pdserve.bench_client import RequestRecord
from pdserve.bench_metrics import PERCENTILES, in_flight_steps, waiting_steps

_WIDTH = 60
_MAX_FAILURES_SHOWN = 10
_LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def format_table(summary: dict, header: list[str]) -> str:
    """The summary as aligned lines (header lines first)."""
    lines = [" pdserve bench ".center(_WIDTH, "="), *header, "-" * _WIDTH]
    sources = ", ".join(f"{src}: {n} requests" for src, n in summary["output_tokens_source"].items()) or "none"
    rows = [
        ("Successful requests", summary["num_completed"]), ("Failed requests", summary["num_failed"]),
        ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total output tokens", f"{summary['total_output_tokens']} (counted from {sources})"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
        ("Peak concurrent requests", summary["peak_concurrency"]),
    ]
    if summary["slo_attainment"] is not None:
        rows += [(f"SLO attainment ({_slo_text(summary)})", f"{100 * summary['slo_attainment']:.1f}%"),
                 ("Goodput (req/s)", f"{summary['goodput_req_s']:.2f}")]
    lines += [f"{name + ':':<40} {value}" for name, value in rows]
    lines += ["-" * _WIDTH, f"{'latency (ms)':<13}" + "".join(f"{h:>9}" for h in _stat_names())]
    for key, name in _LATENCIES:
        stats = summary[key]
        cells = [f"{stats[h]:9.1f}" for h in _stat_names()] if stats else [f"{'-':>9}"] * len(_stat_names())
        lines.append(f"{name:<13}" + "".join(cells))
    lines += _failure_lines(summary)
    return "\n".join(lines + ["=" * _WIDTH])


def _stat_names() -> list[str]:
    return ["mean", *(f"p{p}" for p in PERCENTILES)]


def _slo_text(summary: dict) -> str:
    parts = [f"{name} <= {summary[key]:g} ms" for key, name in (("slo_ttft_ms", "TTFT"), ("slo_tpot_ms", "TPOT"))
             if summary[key] is not None]
    return ", ".join(parts)


def _failure_lines(summary: dict) -> list[str]:
    if not summary["failures"]:
        return []
    lines = ["-" * _WIDTH, "Failures by reason: " + ", ".join(f"{reason or '?'} x{n}"
                                                             for reason, n in summary["failure_reasons"].items())]
    for failure in summary["failures"][:_MAX_FAILURES_SHOWN]:
        lines.append(f"  request {failure['request_idx']}: {failure['error'].splitlines()[0][:200]}")
    if len(summary["failures"]) > _MAX_FAILURES_SHOWN:
        lines.append(f"  ... {len(summary['failures']) - _MAX_FAILURES_SHOWN} more in the result JSON")
    return lines


def format_sweep(points: list[dict], target: float, rate: float | None) -> str:
    lines = [" pdserve bench sweep ".center(_WIDTH, "="),
             f"{'rate (req/s)':>12} {'attainment':>11} {'goodput':>9} {'TTFT p99':>9} {'TPOT p99':>9} {'failed':>7}"]
    for point in points:
        s = point["summary"]
        attainment = None if s["slo_attainment"] is None else 100 * s["slo_attainment"]
        cells = [_number(attainment, "%"), _number(s["goodput_req_s"]), _number(_p99(s["ttft_ms"])),
                 _number(_p99(s["tpot_ms"]))]
        lines.append(f"{point['request_rate']:>12g} {cells[0]:>11} {cells[1]:>9} {cells[2]:>9} {cells[3]:>9} "
                     f"{s['num_failed']:>7}")
    verdict = f"{rate:g} req/s" if rate is not None else "none of the rates"
    lines += [f"Goodput rate (highest rate with attainment >= {100 * target:g}%): {verdict}", "=" * _WIDTH]
    return "\n".join(lines)


def _p99(stats: dict | None) -> float | None:
    return None if stats is None else stats["p99"]


def _number(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.1f}{unit}"


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(result), indent=1))


def jsonable(value: object) -> object:
    """value with infinite floats as the string "inf" (JSON has no infinity)."""
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend; raises RuntimeError naming the extra."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise RuntimeError("--plot-dir needs matplotlib (pip install -e '.[bench]')") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(plot_dir: Path, records: list[RequestRecord], summary: dict, max_concurrency: int | None,
             prefix: str = "") -> list[Path]:
    """latency_cdf.png (TTFT, TPOT, E2E) and in_flight.png; returns the files written."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    return [_plot_cdfs(plot_dir / f"{prefix}latency_cdf.png", records, summary),
            _plot_in_flight(plot_dir / f"{prefix}in_flight.png", records, max_concurrency)]


def _plot_cdfs(path: Path, records: list[RequestRecord], summary: dict) -> Path:
    plt = _pyplot()
    done = [r for r in records if r.is_ok]
    series = (("TTFT", [r.ttft_s for r in done], summary["slo_ttft_ms"]),
              ("TPOT", [r.tpot_s for r in done if r.tpot_s is not None], summary["slo_tpot_ms"]),
              ("E2E", [r.e2e_s for r in done], None))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (name, values_s, slo_ms) in zip(axes, series):
        values_ms = sorted(v * 1000.0 for v in values_s)
        if values_ms:
            ax.step(values_ms, [(i + 1) / len(values_ms) for i in range(len(values_ms))], where="post")
        if slo_ms is not None:
            ax.axvline(slo_ms, color="tab:red", linestyle="--", label=f"SLO {slo_ms:g} ms")
            ax.legend(loc="lower right")
        ax.set(title=f"{name} CDF ({len(values_ms)} requests)", xlabel=f"{name} (ms)", ylabel="share of requests",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def _plot_in_flight(path: Path, records: list[RequestRecord], max_concurrency: int | None) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.2))
    ax.step(*in_flight_steps(records), where="post", label="in flight (sent, not finished)")
    if max_concurrency is not None:
        ax.step(*waiting_steps(records), where="post", color="tab:orange", label="waiting for a slot")
        ax.axhline(max_concurrency, color="tab:red", linestyle="--", label=f"--max-concurrency {max_concurrency}")
    ax.plot([r.start_s for r in records], [0] * len(records), "|", color="tab:gray", label="sent")
    ax.set(title="Requests in flight", xlabel="time since start (s)", ylabel="requests")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, frameon=False)
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def plot_sweep(plot_dir: Path, points: list[dict], target: float, rate: float | None) -> Path:
    """attainment_vs_rate.png: attainment per swept rate, the target, the goodput rate."""
    plt = _pyplot()
    plot_dir.mkdir(parents=True, exist_ok=True)
    finite = [p for p in points if not math.isinf(p["request_rate"]) and p["summary"]["slo_attainment"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p["request_rate"] for p in finite], [100 * p["summary"]["slo_attainment"] for p in finite], "o-",
            label="SLO attainment")
    ax.axhline(100 * target, color="tab:red", linestyle="--", label=f"target {100 * target:g}%")
    if rate is not None and not math.isinf(rate):
        ax.axvline(rate, color="tab:green", linestyle=":", label=f"goodput rate {rate:g} req/s")
    ax.set(title="SLO attainment vs request rate", xlabel="request rate (req/s)", ylabel="attainment (%)",
           ylim=(0, 102))
    ax.legend(loc="lower left")
    ax.grid(alpha=0.3)
    return _save(plt, fig, plot_dir / "attainment_vs_rate.png")


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
