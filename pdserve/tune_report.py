"""What `pdserve tune` reports: each layout's predicted and measured goodput (Candidate), the
ranking (measured first), the table on stdout, the winner's `pdserve up` line and the RESULT JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.tune_measure import Crossing
from pdserve.tune_profile import Profile, Profiles
from pdserve.tune_space import Layout, Workload

if TYPE_CHECKING:
    from pdserve.tune import TuneConfig

_WIDTH = 104


@dataclass
class Candidate:
    """One layout for one workload. predicted_rate: the simulated goodput rate (attainment
    averaged over the arrival draws); replay_rate: simulated for the measured runs' own arrival
    times and size (before any loaded run); measured: read off the measured rates."""

    layout: Layout
    predicted_rate: float
    replay_rate: float | None = None
    measured: Crossing | None = None
    num_requests: int | None = None
    points: list[dict] = field(default_factory=list)
    single: dict | None = None  # one request alone on the deployment, beside its simulation
    note: str = ""

    @property
    def measured_rate(self) -> float | None:
        return None if self.measured is None else self.measured.rate

    @property
    def error_pct(self) -> float | None:
        """(replay - measured) / measured in %, where the measurement bracketed the crossing."""
        return self._error_pct(self.replay_rate)

    @property
    def predicted_error_pct(self) -> float | None:
        """(predicted - measured) / measured in %, as error_pct."""
        return self._error_pct(self.predicted_rate)

    def _error_pct(self, rate: float | None) -> float | None:
        if self.measured is None or self.measured.kind != "interpolated" or rate is None:
            return None
        return 100.0 * (rate - self.measured.rate) / self.measured.rate

    def to_json(self, model_dir: str) -> dict:
        layout = self.layout
        return {"layout": layout.name, "num_prefill": layout.num_prefill, "num_decode": layout.num_decode,
                "prefill_tp": layout.prefill_tp, "decode_tp": layout.decode_tp,
                "max_num_seqs": layout.max_num_seqs, "max_num_batched_tokens": layout.max_num_batched_tokens,
                "predicted_req_s": self.predicted_rate, "replay_req_s": self.replay_rate,
                "measured": None if self.measured is None else self.measured.to_json(),
                "error_pct": self.error_pct, "predicted_error_pct": self.predicted_error_pct,
                "num_requests": self.num_requests, "single_request": self.single,
                "points": self.points, "note": self.note, "up_command": layout.up_command(model_dir)}


def ranked(candidates: list[Candidate]) -> list[Candidate]:
    """Measured layouts first (by measured goodput; one that passed at no rate last among them),
    then the rest by predicted goodput."""
    measured = [c for c in candidates if c.measured is not None]
    others = [c for c in candidates if c.measured is None]
    measured.sort(key=lambda c: -(c.measured_rate or 0.0))
    others.sort(key=lambda c: (-c.predicted_rate, c.layout.num_non_default_limits))
    return measured + others


def winner(candidates: list[Candidate]) -> tuple[Candidate, str]:
    """The top of the ranking and what it rests on ("measured", "predicted", or a warning)."""
    top = ranked(candidates)[0]
    if top.measured is None:
        return top, "predicted"
    return top, "measured" if top.measured_rate else "measured, but no layout met the SLO at the rates run"


def format_table(config: TuneConfig, profiles: Profiles, workload: Workload, candidates: list[Candidate]) -> str:
    slo, profile = config.slo, profiles.base
    lines = [f" pdserve tune: {workload.name} ".center(_WIDTH, "="),
             f"Model {config.model_dir} ({profile.model_name}), {config.num_units} units of {profile.num_threads} "
             f"core(s); SLO TTFT <= {1000 * slo.ttft_s:g} ms and TPOT <= {1000 * slo.tpot_s:g} ms for "
             f">= {100 * slo.target:g}% of requests",
             f"predicted: simulated goodput rate over {config.num_sim_seeds} Poisson draws of {config.num_requests} "
             "requests; replay: simulated for the measured runs' arrivals; both with the serving cost measured",
             "by requests alone (served calibration); measured: interpolated where attainment crosses the target",
             "between the rates run; errors: replay and predicted vs measured (req/s throughout)",
             "-" * _WIDTH,
             f"{'rank':>4}  {'layout':<36} {'predicted':>9} {'replay':>8} {'measured':>10} {'err':>6} "
             f"{'err pred':>8} {'reqs':>5}  note"]
    for rank, candidate in enumerate(ranked(candidates), 1):
        lines.append(_row(rank, candidate))
        if candidate.single:
            s = candidate.single
            lines.append(" " * 6 + f"alone: TTFT {s['ttft_ms']:.0f} ms (pred {s['predicted_ttft_ms']:.0f}), "
                         f"TPOT {s['tpot_ms']:.1f} ms (pred {s['predicted_tpot_ms']:.1f})")
        if candidate.points:
            lines.append(" " * 6 + "rates run: " + ", ".join(
                f"{p['request_rate']:.3g} -> {100 * p['attainment']:.0f}% (pred {100 * p['predicted_attainment']:.0f}%)"
                for p in sorted(candidate.points, key=lambda p: p["request_rate"])))
    top, basis = winner(candidates)
    lines += ["-" * _WIDTH, f"Winner ({basis}): {top.layout.name}",
              f"  {top.layout.up_command(str(config.model_dir))}", "=" * _WIDTH]
    return "\n".join(lines)


def _row(rank: int, c: Candidate) -> str:
    measured = _measured_text(c)
    error, predicted_error = _pct(c.error_pct), _pct(c.predicted_error_pct)
    replay = "-" if c.replay_rate is None else f"{c.replay_rate:.3g}"
    note = c.note or ("off by more than 15%" if c.error_pct is not None and abs(c.error_pct) > 15 else "")
    return (f"{rank:>4}  {c.layout.name:<36} {c.predicted_rate:>9.3g} {replay:>8} {measured:>10} {error:>6} "
            f"{predicted_error:>8} {c.num_requests or '-':>5}  {note}")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0f}%"


def _measured_text(c: Candidate) -> str:
    if c.measured is None:
        return "-"
    if c.measured.kind == "below":
        return "<" + (f"{min(p['request_rate'] for p in c.points):.3g}" if c.points else "?")
    prefix = ">=" if c.measured.kind == "at least" else ""
    return f"{prefix}{c.measured.rate:.3g}"


def result_json(config: TuneConfig, profiles: Profiles, results: list[tuple[Workload, list[Candidate]]],
                elapsed_s: float) -> dict:
    model_dir = str(config.model_dir)
    workloads = []
    for workload, candidates in results:
        top, basis = winner(candidates)
        workloads.append({"workload": workload.name, "winner": {"layout": top.layout.name, "basis": basis,
                                                                "up_command": top.layout.up_command(model_dir)},
                          "ranking": [c.to_json(model_dir) for c in ranked(candidates)]})
    return {"model": model_dir, "units": config.num_units, "dry_run": config.is_dry_run,
            "slo": {"ttft_ms": 1000 * config.slo.ttft_s, "tpot_ms": 1000 * config.slo.tpot_s,
                    "target": config.slo.target},
            "num_requests": config.num_requests, "sim_seeds": config.num_sim_seeds, "elapsed_s": elapsed_s,
            "workloads": workloads, "tp_sizes": list(config.tp_sizes),
            "profile": _without_points(profiles.base),
            "profiles": [_without_points(profiles[size]) for size in sorted(profiles.by_tp)]}


def _without_points(profile: Profile) -> dict:
    return {k: v for k, v in profile.to_json().items() if k != "points"}
