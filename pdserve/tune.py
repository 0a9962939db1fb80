"""`pdserve tune`: choose the P:D split of K units (one core each), the nodes' tensor-parallel sizes
and batch limits that maximize goodput for a workload under TTFT/TPOT SLOs. Profiles a node of
each size in-process (tune_profile),
predicts every layout's goodput with a queue simulation (tune_sim), starts the best layouts and
measures them with pdserve bench (tune_measure), and ranks them (tune_report)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from engine.config import ModelConfig
from engine.protocol import default_of
from engine.tp_shard import check_tensor_parallel
from pdserve.bench_report import jsonable
from pdserve.tune_measure import (
    BurstLatency,
    Clock,
    bench_config,
    bracket_search,
    burst_latency,
    crossing,
    deployed,
    measure_rate,
    single_latency,
    warm_up,
)
from pdserve.tune_profile import Profile, ProfilePlan, Profiles, profile_model, tp_prefix
from pdserve.tune_report import Candidate, format_table, result_json
from pdserve.tune_sim import SimPlan, bench_arrivals, predict_goodput, simulate
from pdserve.tune_space import Layout, Slo, Workload, enumerate_layouts, scheduler_default

_PROFILE_SHARE = 0.2  # of --max-minutes, at most, for the prefill profile points
_START_ESTIMATE_S = 55.0  # start-up, warm-up and three requests alone (measured 30-35 s with one, small preset)
_STOP_RESERVE_S = 15.0  # kept back at the end: stopping a deployment, the table
_STEP_FACTOR = 1.25  # the rate search's step away from the prediction
_CLOSE_RATIO = 1.12  # the search stops once a passing and a failing rate are this close
_POINT_SLACK = 1.15  # a measured run lasts about its simulated duration times this, plus a few s
_NUM_SINGLE = 3  # requests alone on a deployment, for the calibration (their medians)
_CALIBRATION_SHARE = 0.5
_BURST_PER_UNIT = 8  # requests per node sent at once for the per-sequence calibration

Say = Callable[[str], None]


@dataclass(frozen=True)
class TuneConfig:
    """Everything one `pdserve tune` run is built from (the command line, once)."""

    model_dir: Path
    num_units: int
    slo: Slo
    workloads: tuple[Workload, ...]
    max_minutes: float = 20.0
    is_dry_run: bool = False
    num_requests: int = 16
    min_requests: int = 8
    max_num_seqs: tuple[int, ...] = ()
    max_num_batched_tokens: tuple[int, ...] = ()
    measure_top: int = 2
    max_points: int = 4
    num_sim_seeds: int = 8
    arrival_seed: int = 0  # the measured runs' Poisson draw (pdserve bench's --seed); the replay uses it
    log_dir: Path | None = None
    load_profile: Path | None = None
    save_profile: Path | None = None
    tp_sizes: tuple[int, ...] = (1,)  # a node's tensor-parallel sizes considered; a node of size t takes t units

    def __post_init__(self) -> None:
        for name in ("num_units", "num_requests", "min_requests", "measure_top", "max_points", "num_sim_seeds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.tp_sizes or min(self.tp_sizes) < 1:
            raise ValueError(f"tensor-parallel sizes must be >= 1, got {list(self.tp_sizes)}")
        if max(self.tp_sizes) > self.num_units:
            raise ValueError(f"a tensor-parallel node of {max(self.tp_sizes)} ranks needs as many units; "
                             f"there are {self.num_units}")

    @property
    def profiled_tp_sizes(self) -> tuple[int, ...]:
        """One rank always (the served calibration runs on it), and every size considered."""
        return tuple(sorted({1, *self.tp_sizes}))
        if self.min_requests > self.num_requests:
            raise ValueError(f"min_requests {self.min_requests} exceeds num_requests {self.num_requests}")
        if not self.max_minutes > 0:
            raise ValueError(f"max_minutes must be > 0, got {self.max_minutes}")
        if not self.workloads:
            raise ValueError("need at least one workload")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--units", type=int, default=len(os.sched_getaffinity(0)),
                        help="units (cores) to split between nodes (default: this process's cores)")
    parser.add_argument("--slo-ttft-ms", type=float, required=True)
    parser.add_argument("--slo-tpot-ms", type=float, required=True)
    parser.add_argument("--slo-target", type=float, default=default_of(Slo, "target"),
                        help="share of requests that must meet both targets")
    parser.add_argument("--workload", nargs="+", required=True, metavar="IN:OUT[:RATE_MAX]",
                        help="prompt tokens:output tokens[:highest rate to consider]; each is tuned on its own")
    parser.add_argument("--max-minutes", type=float, default=default_of(TuneConfig, "max_minutes"),
                        help="time budget, all included")
    parser.add_argument("--dry-run", action="store_true", help="profile and predict only; start nothing")
    parser.add_argument("--num-requests", type=int, default=default_of(TuneConfig, "num_requests"),
                        help="requests per measured (and simulated) run; lowered to fit the budget")
    parser.add_argument("--min-requests", type=int, default=default_of(TuneConfig, "min_requests"))
    parser.add_argument("--max-num-seqs", default=f"{scheduler_default('max_num_seqs')},8",
                        help="comma list of node max_num_seqs to consider")
    parser.add_argument("--max-num-batched-tokens", default=None,
                        help="comma list (default: the node's default, the longest prompt, half of it)")
    parser.add_argument("--tp-sizes", default="1", metavar="T[,T...]",
                        help="comma list of tensor-parallel sizes to consider for each node (a node of size T "
                             "takes T units; each size is profiled)")
    parser.add_argument("--measure-top", type=int, default=default_of(TuneConfig, "measure_top"),
                        help="measure the best layout of this many P:D splits")
    parser.add_argument("--max-points", type=int, default=default_of(TuneConfig, "max_points"),
                        help="measured rates per layout")
    parser.add_argument("--sim-seeds", type=int, default=default_of(TuneConfig, "num_sim_seeds"),
                        help="arrival draws averaged for the predicted goodput")
    parser.add_argument("--arrival-seed", type=int, default=default_of(TuneConfig, "arrival_seed"),
                        help="seed of the measured runs' arrival times (the simulations start from it)")
    parser.add_argument("--log-dir", default=None, help="node and proxy logs (default: a new temporary folder)")
    parser.add_argument("--load-profile", default=None, metavar="PATH", help="reuse a saved profile (no profiling)")
    parser.add_argument("--save-profile", default=None, metavar="PATH")
    parser.add_argument("--result-json", default=None, metavar="PATH")


def config_from_args(args: argparse.Namespace) -> TuneConfig:
    """Raises ValueError naming a bad value."""
    workloads = tuple(Workload.parse(text) for text in args.workload)
    longest = max(w.input_len for w in workloads)
    tokens_text = args.max_num_batched_tokens or (
        f"{scheduler_default('max_num_batched_tokens')},{longest},{max(16, longest // 2)}")
    return TuneConfig(
        model_dir=Path(args.model), num_units=args.units,
        slo=Slo(args.slo_ttft_ms / 1000.0, args.slo_tpot_ms / 1000.0, args.slo_target), workloads=workloads,
        max_minutes=args.max_minutes, is_dry_run=args.dry_run, num_requests=args.num_requests,
        min_requests=args.min_requests, max_num_seqs=_int_list(args.max_num_seqs, "--max-num-seqs"),
        max_num_batched_tokens=_int_list(tokens_text, "--max-num-batched-tokens"), measure_top=args.measure_top,
        max_points=args.max_points, num_sim_seeds=args.sim_seeds, arrival_seed=args.arrival_seed,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        load_profile=Path(args.load_profile) if args.load_profile else None,
        save_profile=Path(args.save_profile) if args.save_profile else None,
        tp_sizes=tuple(sorted(_int_list(args.tp_sizes, "--tp-sizes"))))


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    except ValueError:
        raise ValueError(f"{flag} needs integers separated by commas, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag} is empty")
    return values


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        enumerate_layouts(config.num_units, list(config.max_num_seqs), list(config.max_num_batched_tokens),
                          config.tp_sizes)
    except ValueError as exc:
        print(f"pdserve tune: {exc}", file=sys.stderr)
        return 2
    if not (config.model_dir / "config.json").exists():
        print(f"pdserve tune: no checkpoint in {config.model_dir}", file=sys.stderr)
        return 2
    try:
        model = ModelConfig.from_pretrained(str(config.model_dir))
        for size in config.tp_sizes:
            check_tensor_parallel(model, size)
    except ValueError as exc:
        print(f"pdserve tune: {exc}", file=sys.stderr)
        return 2
    if config.log_dir is None and not config.is_dry_run:
        config = replace(config, log_dir=Path(tempfile.mkdtemp(prefix="pdserve-tune-")))
    clock = Clock(config.max_minutes * 60.0)
    say = _progress(clock)
    _warn_about_cores(config, say)
    try:
        profile = _profile(config, clock, say)
    except (ValueError, OSError) as exc:
        print(f"pdserve tune: profiling failed: {exc}", file=sys.stderr)
        return 1
    if not config.is_dry_run and profile.base.served_check is None:
        profile = _served_calibration(config, profile, say)
    if config.save_profile is not None:
        config.save_profile.parent.mkdir(parents=True, exist_ok=True)
        config.save_profile.write_text(json.dumps(profile.to_json(), indent=1))
    results = [_tune_workload(config, profile, w, clock, idx, say) for idx, w in enumerate(config.workloads)]
    for workload, candidates in zip(config.workloads, results):
        print(format_table(config, profile, workload, candidates), flush=True)
    result = result_json(config, profile, list(zip(config.workloads, results)), clock.elapsed_s)
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(jsonable(result), indent=1))
    print("RESULT " + json.dumps(jsonable(result)), flush=True)
    return 1 if any(c.note.startswith("failed") for cs in results for c in cs) else 0


def _progress(clock: Clock) -> Say:
    def say(message: str) -> None:
        print(f"tune [{clock.elapsed_s:6.0f} s] {message}", file=sys.stderr, flush=True)
    return say


def _warn_about_cores(config: TuneConfig, say: Say) -> None:
    num_cores = len(os.sched_getaffinity(0))
    if config.num_units > num_cores:
        say(f"warning: {config.num_units} units on {num_cores} cores: nodes will share cores, "
            "so the one-core profile overstates each node's speed")
    elif num_cores % config.num_units:
        say(f"note: {num_cores} cores do not split evenly into {config.num_units} units; "
            f"each node gets {num_cores // config.num_units}")


def _threads_per_unit(config: TuneConfig) -> int:
    """Cores per node as start_local pins them (all cores split evenly; shared if too few)."""
    return max(1, len(os.sched_getaffinity(0)) // config.num_units)


def _profile(config: TuneConfig, clock: Clock, say: Say) -> Profiles:
    """A profile of a node of each size considered (loaded, or timed here). Raises ValueError
    when a loaded one lacks a size."""
    if config.load_profile is not None:
        say(f"profile: loading {config.load_profile}")
        profiles = Profiles.from_json(json.loads(config.load_profile.read_text()))
        for size in config.profiled_tp_sizes:
            profiles[size]  # noqa: B018 - raises ValueError naming the size
        return profiles
    sizes = config.profiled_tp_sizes
    plan = ProfilePlan(max_prompt_len=max(w.input_len for w in config.workloads),
                       max_context_len=max(w.input_len + w.output_len for w in config.workloads),
                       budget_s=_PROFILE_SHARE * clock.left_s / len(sizes))
    threads = _threads_per_unit(config)
    by_tp = {}
    for size in sizes:
        ranks = f", {size} tensor-parallel ranks of" if size > 1 else " on"
        say(f"profile: {config.model_dir.name}{ranks} {threads} core(s), prompts up to {plan.max_prompt_len} "
            f"tokens, contexts up to {plan.max_context_len}")
        profile = profile_model(str(config.model_dir), plan, threads, say, tensor_parallel_size=size)
        p, d, m = profile.prefill.to_json(), profile.decode.to_json(), profile.mixed_check
        tag = tp_prefix(size)
        say(f"profile: {tag}prefill_s = {p['fixed_s']:.4f} + {p['per_token_s']:.3g} * tokens + "
            f"{p['per_attention_pair_s']:.3g} * pairs (worst point {100 * p['max_rel_error']:.0f}% off)")
        say(f"profile: {tag}decode_step_s = {d['fixed_s']:.4f} + {d['per_seq_s']:.3g} * batch + "
            f"{d['per_context_token_s']:.3g} * context tokens (worst point {100 * d['max_rel_error']:.0f}% off)")
        say(f"profile: {tag}mixed step predicted {1000 * m['predicted_s']:.1f} ms, measured "
            f"{1000 * m['seconds']:.1f} ms; KV pull of {plan.max_prompt_len} tokens "
            f"~{1000 * profile.transfer_s(plan.max_prompt_len):.1f} ms")
        by_tp[size] = profile
    return Profiles(by_tp)


def _served_calibration(config: TuneConfig, profiles: Profiles, say: Say) -> Profiles:
    """profiles, each with the serving stack's costs measured on colocated nodes of its own
    size (_calibrated_on_served_nodes): a node of several ranks has serving costs of its own, not
    a one-rank node's."""
    return Profiles({size: _calibrated_on_served_nodes(config, profile, say)
                     for size, profile in profiles.by_tp.items()})


def _calibrated_on_served_nodes(config: TuneConfig, profile: Profile, say: Say) -> Profile:
    """profile with the serving stack's own per-step cost added: calibrated() on requests alone
    through the proxy to colocated nodes of the profile's size using the K units (a lone node
    would get every core). So every layout's prediction, and the choice of what to measure,
    carries it. Unchanged, with a warning, if the nodes do not come up. Measured deployments are
    not calibrated again: two requests alone vary by up to 15% in TTFT between deployments of
    one layout, and re-calibrating on them put a replay 45% off where this one calibration was
    10% off; a deployment's own costs (the KV pull, routing) are the simulation's to model."""
    workload = max(config.workloads, key=lambda w: w.input_len)
    size = profile.tensor_parallel_size
    # one node per unit (or per size units): each pinned to its units' cores, as profiled
    layout = Layout(0, config.num_units // size, decode_tp=size)
    log_dir = config.log_dir / ("served-calibration" + (f"-tp{size}" if size > 1 else ""))
    say(f"profile: requests alone through the proxy to one of {layout.name} ({workload.name}; logs {log_dir})")
    try:
        with deployed(config.model_dir, 0, layout.num_decode, layout.node_args(), layout.proxy_args(),
                      log_dir, (1, size)) as deployment:
            warm_up(deployment.base_url, workload)
            single = _single_check(deployment.base_url, layout, profile, workload, say, "profile")
            burst = burst_latency(deployment.base_url, workload, _BURST_PER_UNIT * layout.num_units)
    except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:
        say(f"profile: warning: the served calibration failed ({type(exc).__name__}: {exc}); predicting without it")
        return profile
    served = calibrated(profile, single)
    say(f"profile: serving adds {single['prefill_extra_ms']:+.1f} ms per prefill step and "
        f"{single['decode_extra_ms']:+.1f} ms per decode step")
    served = per_seq_calibrated(served, layout, workload, burst, single)
    say(f"profile: {len(burst.start_s)} requests at once: TPOT {single['burst_tpot_ms']:.1f} ms (predicted "
        f"{single['burst_predicted_tpot_ms']:.1f}); serving adds {single['decode_per_seq_extra_ms']:+.3f} ms "
        "per sequence in a decode step")
    return replace(served, served_check=single)


def _tune_workload(config: TuneConfig, profile: Profiles, workload: Workload, clock: Clock, workload_idx: int,
                   say: Say) -> list[Candidate]:
    candidates = _predict(config, profile, workload, say)
    if config.is_dry_run:
        return candidates
    chosen = _to_measure(candidates, config.measure_top)
    num_workloads_left = len(config.workloads) - workload_idx
    workload_deadline = time.monotonic() + (clock.left_s - _STOP_RESERVE_S) / num_workloads_left
    for idx, candidate in enumerate(chosen):
        share_s = (workload_deadline - time.monotonic()) / (len(chosen) - idx)
        _measure(config, profile, workload, candidate, share_s, clock, say)
    return candidates


def _predict(config: TuneConfig, profile: Profiles, workload: Workload, say: Say) -> list[Candidate]:
    layouts = enumerate_layouts(config.num_units, list(config.max_num_seqs), list(config.max_num_batched_tokens),
                                config.tp_sizes)
    seeds = tuple(range(config.arrival_seed, config.arrival_seed + config.num_sim_seeds))
    plan = SimPlan(config.num_requests, seeds)
    started = time.monotonic()
    candidates = [Candidate(layout, predict_goodput(layout, profile, workload, config.slo, plan))
                  for layout in layouts]
    candidates.sort(key=lambda c: (-c.predicted_rate, c.layout.num_non_default_limits))
    if any(math.isinf(c.predicted_rate) for c in candidates):
        say(f"predict {workload.name}: warning: some layouts meet the SLO even with all {config.num_requests} "
            "requests at once (goodput inf, not measured): raise --num-requests or tighten the SLO")
    say(f"predict {workload.name}: {len(layouts)} layouts simulated in {time.monotonic() - started:.1f} s; best "
        + ", ".join(f"{c.layout.name}: {c.predicted_rate:.3g} req/s" for c in candidates[:3]))
    return candidates


def _to_measure(candidates: list[Candidate], measure_top: int) -> list[Candidate]:
    """The best-predicted layout of each P:D split, for the measure_top best splits."""
    best: dict[str, Candidate] = {}
    for candidate in candidates:  # already best first
        best.setdefault(candidate.layout.split_name, candidate)
    return [c for c in best.values() if 0 < c.predicted_rate < math.inf][:measure_top]


def _measure(config: TuneConfig, profile: Profiles, workload: Workload, candidate: Candidate, share_s: float,
             clock: Clock, say: Say) -> None:
    """Start candidate's layout, run rates around its goodput as simulated for the measured runs'
    own size and arrivals, and record the points and the crossing on candidate."""
    layout = candidate.layout
    plan = _plan_run(config, profile, workload, candidate, share_s)
    deadline = time.monotonic() + share_s
    if plan is None or clock.left_s < _START_ESTIMATE_S + _STOP_RESERVE_S:
        candidate.note, candidate.replay_rate = "not measured: out of time", None
        say(f"measure {layout.name}: skipped, out of time")
        return
    num_requests, start_rate = plan
    candidate.num_requests = num_requests
    # a name a shell takes unquoted: "256-64-1P_TP2_+1D_seqs=128_tokens=2048"
    log_dir = config.log_dir / re.sub(r"[^\w.=+-]", "_", f"{workload.name.replace(':', '-')}-{layout.name}")
    say(f"measure {layout.name}: starting ({num_requests} requests per rate, from {start_rate:.3g} req/s; "
        f"logs {log_dir})")

    def can_afford(rate: float) -> bool:
        left = min(deadline - time.monotonic(), clock.left_s - _STOP_RESERVE_S)
        return _point_estimate_s(layout, profile, workload, num_requests, rate, config.arrival_seed) <= left

    try:
        with deployed(config.model_dir, layout.num_prefill, layout.num_decode, layout.node_args(),
                      layout.proxy_args(), log_dir, (layout.prefill_tp, layout.decode_tp)) as deployment:
            warm_up(deployment.base_url, workload)
            candidate.single = _single_check(deployment.base_url, layout, profile, workload, say)
            base = bench_config(deployment.base_url, workload, num_requests, config.slo, seed=1000,
                                arrival_seed=config.arrival_seed)
            points = bracket_search(_point_measurer(base, layout, profile, workload, config.slo, candidate, say),
                                    start_rate, config.slo.target, factor=_STEP_FACTOR, max_points=config.max_points,
                                    close_ratio=_CLOSE_RATIO, can_afford=can_afford, rate_max=workload.rate_max)
    except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:
        candidate.note = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        say(f"measure {layout.name}: {candidate.note}")
        return
    if points:
        candidate.measured = crossing(points, config.slo.target)
    else:
        candidate.note = "not measured: out of time"


def _single_check(base_url: str, layout: Layout, profile: Profile | Profiles, workload: Workload, say: Say,
                  stage: str = "measure") -> dict:
    """Requests alone (one after another), beside their simulated latency: what the profile
    leaves out (HTTP, the proxy, the node loop, the deployment's own processes and pinning)
    shows here (the served calibration has added it to the profile: see _served_calibration)."""
    alone = single_latency(base_url, workload, num_requests=_NUM_SINGLE)
    sim = simulate(layout, profile, workload, [0.0])
    check = {**alone.to_json(), "predicted_ttft_ms": 1000 * sim.ttft_s[0], "predicted_tpot_ms": 1000 * sim.tpot_s[0]}
    say(f"{stage} {layout.name}: requests alone: TTFT {check['ttft_ms']:.0f} ms (predicted "
        f"{check['predicted_ttft_ms']:.0f}), TPOT {check['tpot_ms']:.1f} ms "
        f"(predicted {check['predicted_tpot_ms']:.1f})")
    return check


def calibrated(profile: Profile, single: dict) -> Profile:
    """profile with the deployment's own per-step cost added: measured minus predicted TTFT alone
    on the prefill step's fixed time, and measured minus predicted TPOT alone on the decode
    step's (what the in-process profile leaves out: HTTP, the proxy, the node loop's messages and
    streaming). Added, not scaled: under load that cost stays per step while the batch's compute
    grows (scaling the whole step by the alone ratio over-predicted loaded TPOT by 5-8%). Each
    correction is kept within +-_CALIBRATION_SHARE of the predicted latency: past it the profile,
    not the deployment, is wrong."""
    def delta_s(measured_ms: float, predicted_ms: float) -> float:
        if not (predicted_ms > 0 and measured_ms > 0):
            return 0.0
        bound = _CALIBRATION_SHARE * predicted_ms
        return min(max(measured_ms - predicted_ms, -bound), bound) / 1000.0

    prefill = delta_s(single["ttft_ms"], single["predicted_ttft_ms"])
    decode = delta_s(single["tpot_ms"], single["predicted_tpot_ms"])
    single.update(prefill_extra_ms=1000 * prefill, decode_extra_ms=1000 * decode)
    return profile.with_fixed_extra(prefill, decode)


def per_seq_calibrated(profile: Profile, layout: Layout, workload: Workload, burst: BurstLatency,
                       check: dict) -> Profile:
    """profile with a per-sequence decode cost added so that the burst, simulated on layout with
    its own send times, has the measured mean TPOT: the serving stack's per-token work (the
    node's token messages, the proxy's streaming on the same cores), which grows with the batch
    and which requests alone cannot show. Mean TPOT grows with the cost, so bisection finds it,
    within [-0.5, +1] times the profile's own per-sequence cost plus a tenth of its fixed step
    cost. Records the figures in check."""
    fixed, per_seq = profile.decode.coefs[:2]
    measured = statistics.mean(burst.tpot_s)

    def mean_tpot(extra_s: float) -> float:
        return statistics.mean(simulate(layout, profile.with_per_seq_extra(extra_s), workload, burst.start_s).tpot_s)

    lo, hi = -0.5 * per_seq, per_seq + 0.1 * fixed
    if mean_tpot(hi) <= measured:
        extra = hi
    elif mean_tpot(lo) >= measured:
        extra = lo
    else:
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if mean_tpot(mid) < measured else (lo, mid)
        extra = (lo + hi) / 2
    check.update(burst=burst.to_json(), burst_tpot_ms=1000 * measured,
                 burst_predicted_tpot_ms=1000 * mean_tpot(0.0), decode_per_seq_extra_ms=1000 * extra)
    return profile.with_per_seq_extra(extra)


def _point_measurer(base, layout: Layout, profile: Profiles, workload: Workload, slo: Slo, candidate: Candidate,
                    say: Say) -> Callable[[float], float]:
    """attainment_at(rate) for bracket_search: one bench run, recorded beside the simulation of
    the same arrivals."""
    def attainment_at(rate: float) -> float:
        started = time.monotonic()
        point = measure_rate(base, rate, len(candidate.points))
        summary = point["summary"]
        sim = simulate(layout, profile, workload, bench_arrivals(base.dataset.num_requests, rate, base.load.seed))
        record = {"request_rate": rate, "attainment": summary["slo_attainment"],
                  "predicted_attainment": sim.attainment(slo), "num_failed": summary["num_failed"],
                  "ttft_p99_ms": _p99(summary["ttft_ms"]), "tpot_p99_ms": _p99(summary["tpot_ms"]),
                  "predicted_p99_ms": sim.p99_ms(), "duration_s": summary["duration_s"],
                  "predicted_duration_s": sim.duration_s, "wall_s": time.monotonic() - started}
        candidate.points.append(record)
        say(f"measure {layout.name} @ {rate:.3g} req/s: attainment {100 * record['attainment']:.0f}% "
            f"(predicted {100 * record['predicted_attainment']:.0f}%), p99 TTFT {_ms(record['ttft_p99_ms'])} "
            f"(predicted {_ms(sim.p99_ms()['ttft'])}), p99 TPOT {_ms(record['tpot_p99_ms'])} "
            f"(predicted {_ms(sim.p99_ms()['tpot'])}), {record['wall_s']:.0f} s")
        return summary["slo_attainment"]
    return attainment_at


def _p99(stats: dict | None) -> float | None:
    return None if stats is None else stats["p99"]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _point_estimate_s(layout: Layout, profile: Profiles, workload: Workload, num_requests: int, rate: float,
                      arrival_seed: int) -> float:
    """Seconds a measured run should take: its simulated duration, with slack."""
    sim = simulate(layout, profile, workload, bench_arrivals(num_requests, rate, arrival_seed))
    return _POINT_SLACK * sim.duration_s + 3.0


def _plan_run(config: TuneConfig, profile: Profiles, workload: Workload, candidate: Candidate,
              share_s: float) -> tuple[int, float] | None:
    """The most requests per run (num_requests down to min_requests) for which a start and three
    runs (at the goodput simulated for runs of that size and the measured arrivals, or the
    predicted one if that is 0 or unbounded, and a step either side) fit share_s, with the
    starting rate; else min_requests if two runs fit; else None. Sets candidate.replay_rate."""
    layout = candidate.layout

    def start_rate(num_requests: int) -> float:
        replay = predict_goodput(layout, profile, workload, config.slo, SimPlan(num_requests, (config.arrival_seed,)))
        candidate.replay_rate = replay
        return replay if 0 < replay < math.inf else candidate.predicted_rate

    def cost_s(num_requests: int, rates: list[float]) -> float:
        return _START_ESTIMATE_S + sum(_point_estimate_s(layout, profile, workload, num_requests, r,
                                                         config.arrival_seed) for r in rates)

    for num_requests in range(config.num_requests, config.min_requests - 1, -1):
        rate = start_rate(num_requests)
        if cost_s(num_requests, [rate / _STEP_FACTOR, rate, rate * _STEP_FACTOR]) <= share_s:
            return num_requests, rate
    # NOTE: two runs still bracket the crossing when the prediction is close; try with those.
    rate = start_rate(config.min_requests)
    return (config.min_requests, rate) if cost_s(config.min_requests, [rate, rate * _STEP_FACTOR]) <= share_s else None



