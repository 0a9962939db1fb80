"""Disaggregated 1 prefill + 1 decode node against 2 colocated replicas, one core each, on this
2-core machine: the same Poisson load of long prompts and outputs, SLOs set from single-request
latencies, a rate search on each setup -> goodput, p99 TTFT/TPOT at a common rate, one plot.

Setups (start_local, pin_cpus=True: one core per node; the proxy and this client are unpinned):
  colocated  num_prefill=0, num_decode=2: two colocated nodes behind the same proxy.
  1P+1D      num_prefill=1, num_decode=1, with the proxy's conditional disaggregation OFF
             (--local-prefill-min-wait-s -1), so every prompt is prefilled on the prefill node:
             this compares pure disaggregation with colocation, and is what `pdserve tune`
             models. With the default (on), a prefill queue >= 1 s sends prompts to the decode
             node, a hybrid of the two; --with-conditional adds it as a third setup.
Workload: random token-id prompts of exactly --input-len (1,024) tokens, exactly --output-len
  (128) output tokens (ignore_eos), streamed, Poisson arrivals, --num-requests (10) per rate.
SLO rule: first, on the colocated setup, --single-requests (2) requests one at a time: TTFT_1 and
  TPOT_1 (medians). SLO: TTFT <= 3 x TTFT_1 and TPOT <= 1.5 x TPOT_1 for >= 90% of requests
  (--ttft-factor, --tpot-factor). 1P+1D's own single-request latencies are measured and shown.
Rates: every setup starts at r0 = 0.4 / TTFT_1 (0.4 of one core's prefill rate for these
  prompts; the common rate where the p99s are compared), steps x1.5 up while the rates run all
  pass and /1.5 down while all fail, then takes the geometric middle of the bracket until its
  ends are within 1.25x; at most --max-points (4) rates. Each rate is one pdserve.bench run_sweep
  run with fresh prompts. Goodput: pdserve bench's goodput rate (the highest passing rate) and
  the rate where attainment crosses 90%, interpolated between the bracketing rates.
Budget: --max-minutes (20) for everything; a setup's search keeps back what the setups after it
  need at least (start-up, single requests, two rates); a rate whose estimated run (N / rate +
  1.5 x E2E_1 + 5 s) does not fit is not run. Default settings take ~17 minutes here.

    .venv/bin/python benchmarks/disagg_vs_colocated.py [--max-minutes 20] [--with-conditional]

Prints progress lines, the tables, writes benchmarks/out/disagg_vs_colocated/ (plot, JSON, logs)
and ends with `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdserve.bench_report import jsonable  # noqa: E402
from pdserve.default_model import ensure_model  # noqa: E402
from pdserve.tune_measure import (  # noqa: E402
    Clock,
    SingleLatency,
    bench_config,
    bracket_search,
    crossing,
    deployed,
    measure_rate,
    single_latency,
    warm_up,
)
from pdserve.tune_space import NO_LOCAL_PREFILL, Slo, Workload  # noqa: E402

START_RATE_SHARE = 0.4  # r0 = this / TTFT_1
STEP_FACTOR = 1.5
CLOSE_RATIO = 1.25
START_ESTIMATE_S = 30.0  # start-up and warm-up of one deployment of the small preset (measured 25-35 s)


@dataclass(frozen=True)
class Setup:
    name: str
    num_prefill: int
    num_decode: int
    proxy_args: tuple[str, ...] = ()


COLOCATED = Setup("colocated 2x1", 0, 2)
DISAGGREGATED = Setup("1P+1D", 1, 1, NO_LOCAL_PREFILL)
CONDITIONAL = Setup("1P+1D conditional", 1, 1)


@dataclass
class SetupResult:
    setup: Setup
    single: SingleLatency | None = None
    points: list[dict] = field(default_factory=list)
    local_prefills: float | None = None

    def attainments(self) -> list[tuple[float, float]]:
        return [(p["request_rate"], p["attainment"]) for p in self.points]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-requests", type=int, default=10, help="requests per rate")
    parser.add_argument("--single-requests", type=int, default=2)
    parser.add_argument("--ttft-factor", type=float, default=3.0)
    parser.add_argument("--tpot-factor", type=float, default=1.5)
    parser.add_argument("--slo-target", type=float, default=0.9)
    parser.add_argument("--max-points", type=int, default=4, help="rates per setup")
    parser.add_argument("--max-minutes", type=float, default=20.0)
    parser.add_argument("--with-conditional", action="store_true",
                        help="also 1P+1D with the proxy's default conditional disaggregation")
    parser.add_argument("--out-dir", default=str(REPO / "benchmarks" / "out" / "disagg_vs_colocated"))
    return parser.parse_args()


def say(clock: Clock, message: str) -> None:
    print(f"[{clock.elapsed_s:6.0f} s] {message}", flush=True)


def main() -> None:
    args = parse_args()
    clock = Clock(args.max_minutes * 60.0)
    out_dir = Path(args.out_dir)
    model_dir = ensure_model(REPO / ".cache" / "models" / f"{args.preset}-seed0", args.preset)
    workload = Workload(args.input_len, args.output_len)
    setups = [COLOCATED, DISAGGREGATED] + ([CONDITIONAL] if args.with_conditional else [])
    results = [SetupResult(s) for s in setups]
    state: dict = {}  # slo, r0, e2e_1: fixed by the first setup's single requests
    for idx, result in enumerate(results):
        run_setup(result, len(results) - idx - 1, model_dir, workload, args, state, clock, out_dir)
    report(results, workload, state, args, clock, out_dir)


def run_setup(result: SetupResult, num_after: int, model_dir: Path, workload: Workload, args: argparse.Namespace,
              state: dict, clock: Clock, out_dir: Path) -> None:
    setup = result.setup
    say(clock, f"{setup.name}: starting {setup.num_prefill} prefill + {setup.num_decode} decode node(s)")
    with deployed(model_dir, setup.num_prefill, setup.num_decode, [], list(setup.proxy_args),
                  out_dir / "logs" / setup.name.replace(" ", "_")) as deployment:
        warm_up(deployment.base_url, workload)
        result.single = single_latency(deployment.base_url, workload, args.single_requests)
        say(clock, f"{setup.name}: one at a time: TTFT_1 {1000 * result.single.ttft_s:.0f} ms, "
                   f"TPOT_1 {1000 * result.single.tpot_s:.1f} ms, E2E_1 {result.single.e2e_s:.1f} s")
        if "slo" not in state:
            state.update(choose_slo(result.single, args))
            say(clock, f"SLO: TTFT <= {1000 * state['slo'].ttft_s:.0f} ms, TPOT <= {1000 * state['slo'].tpot_s:.1f} "
                       f"ms for >= {100 * args.slo_target:g}%; start rate r0 = {state['r0']:.3g} req/s")
        before = local_prefills(deployment.base_url)
        sweep(result, deployment.base_url, workload, args, state, clock, reserve_s=num_after * min_cost_s(args, state))
        after = local_prefills(deployment.base_url)
        result.local_prefills = None if before is None or after is None else after - before
    say(clock, f"{setup.name}: stopped")


def choose_slo(single: SingleLatency, args: argparse.Namespace) -> dict:
    slo = Slo(args.ttft_factor * single.ttft_s, args.tpot_factor * single.tpot_s, args.slo_target)
    return {"slo": slo, "r0": START_RATE_SHARE / single.ttft_s, "e2e_1_s": single.e2e_s}


def point_cost_s(args: argparse.Namespace, state: dict, rate: float) -> float:
    return args.num_requests / rate + 1.5 * state["e2e_1_s"] + 5.0


def min_cost_s(args: argparse.Namespace, state: dict) -> float:
    """What one more setup needs at least: start-up, its single requests, two rates."""
    singles = args.single_requests * state["e2e_1_s"]
    return START_ESTIMATE_S + singles + point_cost_s(args, state, state["r0"]) + point_cost_s(
        args, state, state["r0"] * STEP_FACTOR)


def sweep(result: SetupResult, base_url: str, workload: Workload, args: argparse.Namespace, state: dict,
          clock: Clock, reserve_s: float) -> None:
    config = bench_config(base_url, workload, args.num_requests, state["slo"], seed=100)

    def attainment_at(rate: float) -> float:
        summary = measure_rate(config, rate, len(result.points))["summary"]
        point = {"request_rate": rate, "attainment": summary["slo_attainment"], "num_failed": summary["num_failed"],
                 "goodput_req_s": summary["goodput_req_s"], "duration_s": summary["duration_s"],
                 "ttft_ms": summary["ttft_ms"], "tpot_ms": summary["tpot_ms"]}
        result.points.append(point)
        say(clock, f"{result.setup.name} @ {rate:.3g} req/s: attainment {100 * point['attainment']:.0f}%, "
                   f"p99 TTFT {p99(point, 'ttft_ms'):.0f} ms, p99 TPOT {p99(point, 'tpot_ms'):.1f} ms, "
                   f"{point['num_failed']} failed")
        return point["attainment"]

    def can_afford(rate: float) -> bool:
        is_affordable = point_cost_s(args, state, rate) <= clock.left_s - reserve_s
        if not is_affordable:
            say(clock, f"{result.setup.name}: not running {rate:.3g} req/s: over the --max-minutes budget")
        return is_affordable

    bracket_search(attainment_at, state["r0"], args.slo_target, factor=STEP_FACTOR, max_points=args.max_points,
                   close_ratio=CLOSE_RATIO, can_afford=can_afford)


def p99(point: dict, key: str) -> float:
    stats = point[key]
    return math.nan if stats is None else stats["p99"]


def local_prefills(base_url: str) -> float | None:
    """The proxy's count of prompts prefilled on a decode node (None if not exported)."""
    try:
        text = httpx.get(base_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("pdserve_local_prefills_total")]
    return sum(values) if values else None


def summarize_setup(result: SetupResult, state: dict, target: float) -> dict:
    cross = crossing(result.attainments(), target)
    at_r0 = next((p for p in result.points if p["request_rate"] == state["r0"]), None)
    return {"single": None if result.single is None else result.single.to_json(),
            "goodput_rate": cross.grid_rate, "goodput_crossing": cross.rate, "crossing_kind": cross.kind,
            "at_common_rate": None if at_r0 is None else {
                "attainment": at_r0["attainment"], "ttft_p99_ms": p99(at_r0, "ttft_ms"),
                "tpot_p99_ms": p99(at_r0, "tpot_ms")},
            "local_prefills": result.local_prefills, "points": result.points}


def report(results: list[SetupResult], workload: Workload, state: dict, args: argparse.Namespace, clock: Clock,
           out_dir: Path) -> None:
    slo, r0 = state["slo"], state["r0"]
    summaries = {r.setup.name: summarize_setup(r, state, args.slo_target) for r in results}
    print_tables(results, summaries, workload, state, args)
    plot_path = plot(results, summaries, slo, r0, out_dir)
    colocated, disaggregated = summaries[COLOCATED.name], summaries[DISAGGREGATED.name]
    ratio = None
    if colocated["goodput_crossing"] and disaggregated["goodput_crossing"]:
        ratio = disaggregated["goodput_crossing"] / colocated["goodput_crossing"]
    result = {"preset": args.preset, "input_len": workload.input_len, "output_len": workload.output_len,
              "num_requests": args.num_requests, "slo": {"ttft_ms": 1000 * slo.ttft_s, "tpot_ms": 1000 * slo.tpot_s,
                                                         "target": slo.target},
              "slo_rule": f"{args.ttft_factor:g} x colocated TTFT_1, {args.tpot_factor:g} x colocated TPOT_1",
              "common_rate": r0, "goodput_ratio_disagg_over_colocated": ratio, "setups": summaries,
              "plot": str(plot_path) if plot_path else None, "elapsed_s": clock.elapsed_s}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "result.json").write_text(json.dumps(jsonable(result), indent=1))
    from results_io import write_result

    write_result("disagg_vs_colocated", jsonable(result))


def print_tables(results: list[SetupResult], summaries: dict, workload: Workload, state: dict,
                 args: argparse.Namespace) -> None:
    slo, r0 = state["slo"], state["r0"]
    print(f"\nWorkload: {workload.input_len}-token prompts, {workload.output_len} output tokens, Poisson, "
          f"{args.num_requests} requests per rate. SLO: TTFT <= {1000 * slo.ttft_s:.0f} ms, TPOT <= "
          f"{1000 * slo.tpot_s:.1f} ms for >= {100 * slo.target:g}% ({args.ttft_factor:g}x / {args.tpot_factor:g}x "
          "the colocated single-request latencies)")
    print(f"\n| setup | TTFT_1 | TPOT_1 | goodput rate (grid) | goodput (crossing) | at r0 = {r0:.3g} req/s: "
          "attainment | p99 TTFT | p99 TPOT | local prefills |")
    print("|---|---|---|---|---|---|---|---|---|")
    for result in results:
        s = summaries[result.setup.name]
        single, common = s["single"], s["at_common_rate"] or {}
        cross = "-" if s["goodput_crossing"] is None else f"{s['goodput_crossing']:.3g}"
        cross = (">=" if s["crossing_kind"] == "at least" else "") + cross
        print(f"| {result.setup.name} | {single['ttft_ms']:.0f} ms | {single['tpot_ms']:.1f} ms | "
              f"{_num(s['goodput_rate'])} | {cross} | {_pct(common.get('attainment'))} | "
              f"{_num(common.get('ttft_p99_ms'), '.0f')} ms | {_num(common.get('tpot_p99_ms'), '.1f')} ms | "
              f"{_num(s['local_prefills'], '.0f')} |")
    print("\n| setup | rate (req/s) | attainment | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | failed |")
    print("|---|---|---|---|---|---|")
    for result in results:
        for p in sorted(result.points, key=lambda p: p["request_rate"]):
            ttft, tpot = p["ttft_ms"] or {}, p["tpot_ms"] or {}
            print(f"| {result.setup.name} | {p['request_rate']:.3g} | {_pct(p['attainment'])} | "
                  f"{_num(ttft.get('p50'), '.0f')} / {_num(ttft.get('p99'), '.0f')} | "
                  f"{_num(tpot.get('p50'), '.1f')} / {_num(tpot.get('p99'), '.1f')} | {p['num_failed']} |")
    print(flush=True)


def _num(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def plot(results: list[SetupResult], summaries: dict, slo: Slo, r0: float, out_dir: Path) -> Path | None:
    try:
        import matplotlib
    except ModuleNotFoundError:
        print("no matplotlib: no plot", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.3))
    for result, color in zip(results, ("tab:orange", "tab:blue", "tab:green")):
        points = sorted(result.attainments())
        ax.plot([r for r, _ in points], [100 * a for _, a in points], "o-", color=color, label=result.setup.name)
        crossing_rate = summaries[result.setup.name]["goodput_crossing"]
        if crossing_rate:
            ax.axvline(crossing_rate, color=color, linestyle=":", alpha=0.8)
    ax.axhline(100 * slo.target, color="tab:red", linestyle="--", label=f"target {100 * slo.target:g}%")
    ax.axvline(r0, color="tab:gray", linestyle="-.", alpha=0.5, label=f"common rate {r0:.3g}")
    ax.set(title=f"SLO attainment (TTFT <= {1000 * slo.ttft_s:.0f} ms, TPOT <= {1000 * slo.tpot_s:.1f} ms)",
           xlabel="request rate (req/s)", ylabel="attainment (%)", ylim=(0, 102))
    ax.legend(loc="lower left")
    ax.grid(alpha=0.3)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "attainment_vs_rate.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
