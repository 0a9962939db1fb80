"""pdserve tune without deployments: the simulator on hand-made linear profiles, the layouts for
K units, the profile fit, the rate search and crossing, and the CLI's dry run on the tiny model."""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import replace

import pytest
import torch

from pdserve import cli, tune
from pdserve.tune import calibrated, per_seq_calibrated
from pdserve.tune_measure import BurstLatency, Clock, bracket_search, crossing
from pdserve.tune_profile import (
    DECODE_FEATURES,
    PREFILL_FEATURES,
    LinearModel,
    Profile,
    Profiles,
    attention_pairs,
    fit_linear,
)
from pdserve.tune_sim import SimPlan, attainment_at, bench_arrivals, predict_goodput, simulate, streamed_tail
from pdserve.tune_space import Layout, Slo, Workload, enumerate_layouts


def make_profile(prefill=(0.0, 1e-3, 0.0), decode=(0.02, 0.0, 0.0), capacity: int = 1 << 20,
                 tensor_parallel_size: int = 1) -> Profile:
    """A unit whose prefill costs 1 ms per token and whose decode step is a flat 20 ms."""
    return Profile("fake", 1, LinearModel(PREFILL_FEATURES, prefill), LinearModel(DECODE_FEATURES, decode),
                   kv_bytes_per_token=1, copy_bytes_per_s=1e12, kv_capacity_tokens=capacity,
                   tensor_parallel_size=tensor_parallel_size)


def scaled(profile: Profile, factor: float) -> Profile:
    """The same unit factor times slower."""
    return make_profile(tuple(factor * c for c in profile.prefill.coefs),
                        tuple(factor * c for c in profile.decode.coefs), profile.kv_capacity_tokens)


COLOCATED_1 = Layout(0, 1)
DISAGG_1_1 = Layout(1, 1)


# ---- the simulator ------------------------------------------------------------------------------

def test_lone_colocated_request_has_ttft_of_its_prefill_and_tpot_of_a_decode_step():
    profile, workload = make_profile(), Workload(500, 11)
    outcome = simulate(COLOCATED_1, profile, workload, [1.0])
    assert outcome.ttft_s[0] == pytest.approx(0.5)
    assert outcome.tpot_s[0] == pytest.approx(0.02)
    assert outcome.e2e_s[0] == pytest.approx(0.5 + 10 * 0.02)
    assert outcome.duration_s == pytest.approx(1.0 + 0.7)


def test_lone_disaggregated_request_pays_the_pull_once_in_its_tpot():
    profile, workload = make_profile(), Workload(500, 11)
    outcome = simulate(DISAGG_1_1, profile, workload, [0.0])
    assert outcome.ttft_s[0] == pytest.approx(0.5)
    assert outcome.tpot_s[0] == pytest.approx((profile.transfer_s(500) + 10 * 0.02) / 10)


def test_a_chunked_prompts_pull_after_its_prefill_is_only_its_last_chunks_the_rest_was_streamed():
    profile = replace(make_profile(), copy_bytes_per_s=1e4)  # a slow pull: 1 byte of KV per token
    layout = Layout(1, 1, max_num_batched_tokens=256)
    assert [streamed_tail(n, layout) for n in (100, 256, 257, 600, 768)] == [100, 256, 1, 88, 256]
    outcome = simulate(layout, profile, Workload(600, 11), [0.0])
    assert outcome.tpot_s[0] == pytest.approx((profile.transfer_s(88) + 10 * 0.02) / 10)


def test_chunked_prefill_takes_one_step_per_chunk_with_attention_to_earlier_chunks():
    profile = make_profile(prefill=(0.01, 1e-3, 1e-6))
    outcome = simulate(Layout(0, 1, max_num_batched_tokens=256), profile, Workload(512, 2), [0.0])
    first = profile.step_s(0, 0, 256, attention_pairs(256, 0))
    second = profile.step_s(0, 0, 256, attention_pairs(256, 256))
    assert second > first
    assert outcome.ttft_s[0] == pytest.approx(first + second)


def test_a_step_started_while_another_node_computes_takes_the_contention_factor_longer():
    profile, workload = replace(make_profile(), contention=1.5), Workload(500, 2)
    lone = simulate(Layout(0, 2), profile, workload, [0.0])
    assert lone.ttft_s[0] == pytest.approx(0.5)  # nothing else computing: as profiled
    pair = simulate(Layout(0, 2), profile, workload, [0.0, 0.0])
    assert sorted(pair.ttft_s) == pytest.approx([0.5, 0.75])  # the second node started mid-step of the first


def test_each_node_runs_on_the_profile_of_its_tensor_parallel_size():
    one = make_profile()
    two = make_profile(prefill=(0.0, 0.4e-3, 0.0), decode=(0.012, 0.0, 0.0), tensor_parallel_size=2)
    profiles, workload = Profiles({1: one, 2: two}), Workload(500, 11)
    split = simulate(Layout(1, 1, prefill_tp=2), profiles, workload, [0.0])
    assert split.ttft_s[0] == pytest.approx(0.2)  # the TP2 prefill node's prompt
    assert split.tpot_s[0] == pytest.approx((one.transfer_s(500) + 10 * 0.02) / 10)  # the TP1 decode node's steps
    colocated = simulate(Layout(0, 1, decode_tp=2), profiles, workload, [0.0])
    assert colocated.ttft_s[0] == pytest.approx(0.2) and colocated.tpot_s[0] == pytest.approx(0.012)
    with pytest.raises(ValueError, match="no profile of a 4-rank"):
        simulate(Layout(0, 1, decode_tp=4), profiles, workload, [0.0])


def test_requests_queue_behind_each_other_on_one_prefill_unit():
    profile, workload = make_profile(), Workload(1000, 1)  # 1 s of prefill each, one token: no decode
    outcome = simulate(Layout(0, 1, max_num_batched_tokens=1000), profile, workload, [0.0, 0.0, 0.0])
    assert sorted(outcome.ttft_s) == pytest.approx([1.0, 2.0, 3.0])


def test_max_num_seqs_one_makes_the_second_request_wait_for_the_first_to_finish():
    profile, workload = make_profile(), Workload(100, 6)
    outcome = simulate(Layout(0, 1, max_num_seqs=1), profile, workload, [0.0, 0.0])
    assert outcome.ttft_s[0] == pytest.approx(0.1)
    assert outcome.ttft_s[1] == pytest.approx(0.1 + 5 * 0.02 + 0.1)


def test_colocated_prefills_stall_running_decodes_but_disaggregated_ones_do_not():
    profile, workload = make_profile(), Workload(1000, 51)
    arrivals = [0.0, 1.5]  # the second prompt's 1 s prefill lands in the first request's decode
    colocated = simulate(COLOCATED_1, profile, workload, arrivals)
    disaggregated = simulate(DISAGG_1_1, profile, workload, arrivals)
    assert colocated.tpot_s[0] > 0.02 + 0.9 / 50
    assert disaggregated.tpot_s[0] < 0.021 + profile.transfer_s(1000) / 50


def test_a_rate_beyond_capacity_fails_the_slo_and_a_low_one_meets_it():
    profile, workload = make_profile(), Workload(1000, 1)  # one unit serves at most 1 req/s
    slo, plan = Slo(ttft_s=2.0, tpot_s=1.0), SimPlan(num_requests=32)
    assert attainment_at(COLOCATED_1, profile, workload, slo, 0.05, plan) >= 0.9
    assert attainment_at(COLOCATED_1, profile, workload, slo, 5.0, plan) < 0.2


def test_goodput_is_zero_when_a_lone_request_misses_the_slo():
    profile, workload = make_profile(), Workload(1000, 2)
    assert predict_goodput(COLOCATED_1, profile, workload, Slo(0.5, 1.0), SimPlan(8)) == 0.0


def test_goodput_grows_with_capacity():
    workload, slo, plan = Workload(500, 20), Slo(2.0, 0.05), SimPlan(16, (0, 1, 2))
    fast, slow = make_profile(), scaled(make_profile(), 1.5)
    goodputs = [predict_goodput(layout, profile, workload, slo, plan)
                for layout, profile in ((COLOCATED_1, slow), (COLOCATED_1, fast), (Layout(0, 2), fast))]
    assert 0 < goodputs[0] < goodputs[1] < goodputs[2]


def test_goodput_is_capped_by_rate_max_and_unbounded_when_a_burst_meets_the_slo():
    profile = make_profile()
    assert predict_goodput(COLOCATED_1, profile, Workload(100, 2, rate_max=0.5), Slo(5.0, 1.0), SimPlan(8)) == 0.5
    assert predict_goodput(COLOCATED_1, profile, Workload(100, 2), Slo(100.0, 100.0), SimPlan(8)) == math.inf


def test_a_request_larger_than_the_cache_is_refused():
    with pytest.raises(ValueError, match="KV"):
        simulate(COLOCATED_1, make_profile(capacity=100), Workload(100, 10), [0.0])


def test_bench_arrivals_scale_with_the_rate_for_one_seed():
    slow, fast = bench_arrivals(8, 1.0, 0), bench_arrivals(8, 2.0, 0)
    assert fast == pytest.approx([t / 2 for t in slow])
    assert slow[-1] == pytest.approx(8.0)


# ---- layouts, workloads --------------------------------------------------------------------------

def test_layouts_of_two_units_are_one_split_and_two_colocated_replicas():
    layouts = enumerate_layouts(2, [128], [2048])
    assert [(x.num_prefill, x.num_decode) for x in layouts] == [(1, 1), (0, 2)]
    assert [x.split_name for x in layouts] == ["1P+1D", "2x colocated"]


def test_layouts_of_four_units_cross_every_split_with_every_batch_limit():
    layouts = enumerate_layouts(4, [128, 8], [2048, 512])
    splits = sorted({(x.num_prefill, x.num_decode) for x in layouts})
    assert splits == [(0, 4), (1, 3), (2, 2), (3, 1)]
    assert len(layouts) == 4 * 2 * 2
    assert all(x.num_units == 4 for x in layouts)


def test_layouts_with_tensor_parallel_nodes_use_every_unit_once():
    assert [x.split_name for x in enumerate_layouts(2, [128], [2048], (1, 2))] == [
        "1P+1D", "2x colocated", "1x colocated(TP2)"]
    layouts = enumerate_layouts(4, [128], [2048], (1, 2))
    assert sorted(x.split_name for x in layouts) == sorted([
        "1P+3D", "2P+2D", "3P+1D", "2P+1D(TP2)", "1P(TP2)+2D", "1P(TP2)+1D(TP2)", "4x colocated",
        "2x colocated(TP2)"])
    assert all(x.num_units == 4 for x in layouts)
    assert [x.split_name for x in enumerate_layouts(3, [128], [2048], (2,))] == []  # no exact use of 3


def test_up_command_names_each_sides_tensor_parallel_size():
    line = Layout(1, 2, 8, 512, prefill_tp=2).up_command("m")
    assert line.startswith("pdserve up --model m --prefill 1 --decode 2 --prefill-tp 2 --max-num-seqs 8 ")
    assert "--decode-tp" not in line
    assert "--decode 1 --decode-tp 4 " in Layout(0, 1, decode_tp=4).up_command("m")


def test_up_command_turns_conditional_disaggregation_off_only_for_split_layouts():
    split, colocated = Layout(1, 1, 8, 512), Layout(0, 2)
    assert split.up_command("m") == ("pdserve up --model m --prefill 1 --decode 1 --max-num-seqs 8 "
                                     "--max-num-batched-tokens 512 --local-prefill-min-wait-s -1")
    assert "--local-prefill" not in colocated.up_command("m") and "--prefill 0 --decode 2" in colocated.up_command("m")


@pytest.mark.parametrize("bad", [dict(num_prefill=-1, num_decode=1), dict(num_prefill=1, num_decode=0),
                                 dict(num_prefill=1, num_decode=1, max_num_seqs=0),
                                 dict(num_prefill=1, num_decode=1, decode_tp=0),
                                 dict(num_prefill=0, num_decode=1, prefill_tp=2)])
def test_bad_layouts_are_refused(bad):
    with pytest.raises(ValueError):
        Layout(**bad)


def test_workload_parses_lengths_and_an_optional_rate_cap():
    assert Workload.parse("1024:128") == Workload(1024, 128)
    assert Workload.parse("64:8:2.5") == Workload(64, 8, 2.5)
    for bad in ("1024", "a:b", "0:5", "5:5:-1"):
        with pytest.raises(ValueError):
            Workload.parse(bad)


# ---- the profile fit ----------------------------------------------------------------------------

def test_fit_recovers_known_prefill_coefficients():
    truth = (0.004, 2.5e-3, 1.5e-6)
    rows = [[1.0, sum(b), sum(attention_pairs(n, 0) for n in b)]
            for b in ([128], [256], [512], [1024], [512, 512], [256] * 4)]
    fitted = fit_linear(rows, [sum(c * f for c, f in zip(truth, row)) for row in rows], PREFILL_FEATURES)
    assert fitted.coefs == pytest.approx(truth, rel=1e-6)
    assert fitted.max_rel_error < 1e-9


def test_fit_recovers_known_decode_coefficients():
    truth = (0.055, 3e-3, 8e-6)
    rows = [[1.0, b, b * c] for c in (128, 1152) for b in (1, 4, 16)]
    fitted = fit_linear(rows, [sum(c * f for c, f in zip(truth, row)) for row in rows], DECODE_FEATURES)
    assert fitted.coefs == pytest.approx(truth, rel=1e-6)


def test_fit_drops_a_term_that_would_come_out_negative():
    rows = [[1.0, n, n * n] for n in (100, 200, 400, 800)]
    targets = [0.01 + 1e-3 * n - 1e-8 * n * n for n in (100, 200, 400, 800)]  # a slightly concave curve
    fitted = fit_linear(rows, targets, PREFILL_FEATURES)
    assert all(c >= 0 for c in fitted.coefs) and fitted.coefs[2] == 0.0
    assert fitted.max_rel_error < 0.05


def test_fit_needs_as_many_points_as_features():
    with pytest.raises(ValueError):
        fit_linear([[1.0, 2.0, 3.0]], [1.0], PREFILL_FEATURES)


def test_profile_survives_a_json_round_trip():
    profile = make_profile(prefill=(0.01, 1e-3, 1e-7))
    assert Profile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    served = replace(profile, served_check={"ttft_ms": 500.0, "decode_extra_ms": 4.5})
    assert Profile.from_json(json.loads(json.dumps(served.to_json()))) == served


def test_profiles_of_several_sizes_survive_a_json_round_trip_and_a_single_profile_reads_as_one():
    profiles = Profiles({1: make_profile(), 2: make_profile(prefill=(0.0, 5e-4, 0.0), tensor_parallel_size=2)})
    assert Profiles.from_json(json.loads(json.dumps(profiles.to_json()))) == profiles
    assert Profiles.from_json(make_profile().to_json()) == Profiles({1: make_profile()})
    with pytest.raises(ValueError, match="filed under 1"):
        Profiles({1: make_profile(tensor_parallel_size=2)})


@pytest.fixture
def started(monkeypatch) -> list[tuple]:
    """The deployments tune asks for, (num_prefill, num_decode, tensor_parallel, log folder name);
    none comes up (tune.deployed raises RuntimeError)."""
    asked = []

    @contextlib.contextmanager
    def deployed(model_dir, num_prefill, num_decode, node_args, proxy_args, log_dir, tensor_parallel):
        asked.append((num_prefill, num_decode, tensor_parallel, log_dir.name))
        raise RuntimeError("not started in this test")
        yield

    monkeypatch.setattr(tune, "deployed", deployed)
    return asked


def test_each_size_is_calibrated_on_colocated_nodes_of_its_own_size(started, tmp_path):
    config = tune.TuneConfig(tmp_path, 4, Slo(2.0, 0.05), (Workload(500, 11),), log_dir=tmp_path, tp_sizes=(2,))
    profiles = Profiles({1: make_profile(), 2: make_profile(tensor_parallel_size=2)})
    assert tune._served_calibration(config, profiles, lambda _: None) == profiles  # none came up: unchanged
    assert started == [(0, 4, (1, 1), "served-calibration"), (0, 2, (1, 2), "served-calibration-tp2")]


def test_a_measured_layout_is_deployed_with_its_tensor_parallel_sizes(started, tmp_path):
    workload = Workload(500, 11)
    config = tune.TuneConfig(tmp_path, 3, Slo(2.0, 0.05), (workload,), log_dir=tmp_path, tp_sizes=(1, 2))
    profiles = Profiles({1: make_profile(), 2: make_profile(tensor_parallel_size=2)})
    candidate = tune.Candidate(Layout(1, 1, prefill_tp=2), 1.0)
    tune._measure(config, profiles, workload, candidate, 3600.0, Clock(3600.0), lambda _: None)
    assert started == [(1, 1, (2, 1), "500-11-1P_TP2_+1D_seqs=128_tokens=2048")]  # logs in a plain folder name
    assert candidate.note.startswith("failed: RuntimeError")


def test_mixed_step_counts_the_fixed_cost_once():
    profile = make_profile(prefill=(0.05, 1e-3, 0.0), decode=(0.02, 1e-3, 0.0))
    assert profile.step_s(4, 0, 100, 0) == pytest.approx(0.05 + 0.1 + 0.004)


def test_calibration_adds_the_deployments_per_step_cost_measured_alone_within_bounds():
    profile, workload = make_profile(prefill=(0.01, 1e-3, 1e-7), decode=(0.02, 1e-4, 1e-6)), Workload(500, 11)
    alone = simulate(COLOCATED_1, profile, workload, [0.0])
    single = {"ttft_ms": 1000 * alone.ttft_s[0] + 30, "predicted_ttft_ms": 1000 * alone.ttft_s[0],
              "tpot_ms": 1000 * alone.tpot_s[0] - 5, "predicted_tpot_ms": 1000 * alone.tpot_s[0]}
    fitted = calibrated(profile, single)
    again = simulate(COLOCATED_1, fitted, workload, [0.0])  # the calibrated profile reproduces the measurement
    assert 1000 * again.ttft_s[0] == pytest.approx(single["ttft_ms"])
    assert 1000 * again.tpot_s[0] == pytest.approx(single["tpot_ms"])
    assert single["prefill_extra_ms"] == pytest.approx(30) and single["decode_extra_ms"] == pytest.approx(-5)
    # Under load the cost stays per step: a step of 8 decodes pays it once, as a step of 1 does.
    assert fitted.step_s(8, 800, 0, 0) - profile.step_s(8, 800, 0, 0) == pytest.approx(-0.005)
    assert fitted.step_s(0, 0, 300, 0) - profile.step_s(0, 0, 300, 0) == pytest.approx(0.030)
    wild = {**single, "ttft_ms": 50 * single["predicted_ttft_ms"], "tpot_ms": 0.0}
    calibrated(profile, wild)  # past half the prediction it is the profile's fault: bounded; no figure: none
    assert wild["prefill_extra_ms"] == pytest.approx(0.5 * single["predicted_ttft_ms"])
    assert wild["decode_extra_ms"] == 0.0


def test_per_sequence_calibration_finds_the_cost_a_burst_measured_within_bounds():
    profile, workload = make_profile(prefill=(0.01, 1e-3, 0.0), decode=(0.02, 1e-3, 1e-6)), Workload(200, 11)
    layout = Layout(0, 2)
    starts = [0.001 * i for i in range(16)]  # sent within a few ms, as a burst at rate inf is
    measured = simulate(layout, profile.with_per_seq_extra(0.4e-3), workload, starts)
    burst = BurstLatency(starts, measured.ttft_s, measured.tpot_s)
    check: dict = {}
    fitted = per_seq_calibrated(profile, layout, workload, burst, check)
    assert fitted.decode.coefs == pytest.approx((0.02, 1.4e-3, 1e-6), rel=1e-4)  # only the per-sequence term moves
    assert fitted.prefill == profile.prefill
    assert check["decode_per_seq_extra_ms"] == pytest.approx(0.4, rel=1e-3)
    assert check["burst_predicted_tpot_ms"] < check["burst_tpot_ms"] == pytest.approx(
        1000 * sum(measured.tpot_s) / 16)
    # A step pays it once per decoding sequence: 8 decodes pay 8 times what 1 does.
    assert fitted.step_s(8, 0, 0, 0) - profile.step_s(8, 0, 0, 0) == pytest.approx(8 * 0.4e-3, rel=1e-3)
    # Bounded: past +1x the profile's per-sequence cost (plus a tenth of its fixed cost), or
    # below -0.5x, the profile is wrong, not the serving stack.
    slow = BurstLatency(starts, measured.ttft_s, [10 * t for t in measured.tpot_s])
    assert per_seq_calibrated(profile, layout, workload, slow, {}).decode.coefs[1] == pytest.approx(2e-3 + 2e-3)
    fast = BurstLatency(starts, measured.ttft_s, [t / 10 for t in measured.tpot_s])
    assert per_seq_calibrated(profile, layout, workload, fast, {}).decode.coefs[1] == pytest.approx(0.5e-3)


# ---- rate search and crossing -------------------------------------------------------------------

def test_crossing_interpolates_between_the_last_pass_and_the_first_fail():
    result = crossing([(1.0, 1.0), (2.0, 0.95), (3.0, 0.75)], 0.9)
    assert result.kind == "interpolated" and result.grid_rate == 2.0
    assert result.rate == pytest.approx(2.0 + (0.95 - 0.9) / (0.95 - 0.75))
    assert crossing([(1.0, 1.0)], 0.9).kind == "at least"
    assert crossing([(1.0, 0.5)], 0.9).rate is None


def test_bracket_search_closes_in_on_the_crossing_from_either_side():
    def attainment_at(rate: float) -> float:
        return 1.0 if rate <= 3.0 else 0.5

    for start in (1.0, 10.0):
        points = bracket_search(attainment_at, start, 0.9, factor=1.5, max_points=12, close_ratio=1.05,
                                can_afford=lambda _: True)
        low = max(r for r, a in points if a >= 0.9)
        high = min(r for r, a in points if a < 0.9)
        assert low <= 3.0 < high <= 1.05 * low


def test_bracket_search_stops_when_the_budget_refuses_a_rate_and_respects_rate_max():
    points = bracket_search(lambda r: 1.0, 1.0, 0.9, factor=2.0, max_points=10, close_ratio=1.1,
                            can_afford=lambda rate: rate < 5.0)
    assert [r for r, _ in points] == [1.0, 2.0, 4.0]
    capped = bracket_search(lambda r: 1.0, 1.0, 0.9, factor=2.0, max_points=10, close_ratio=1.1,
                            can_afford=lambda _: True, rate_max=3.0)
    assert [r for r, _ in capped] == [1.0, 2.0, 3.0]


# ---- the command line ---------------------------------------------------------------------------

def test_dry_run_on_the_tiny_model_profiles_predicts_and_ranks(tiny_model_dir, capsys):
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    code = cli.main(["tune", "--model", str(tiny_model_dir), "--units", "2", "--slo-ttft-ms", "60",
                     "--slo-tpot-ms", "8", "--workload", "128:8", "--dry-run", "--num-requests", "16",
                     "--sim-seeds", "2", "--max-num-seqs", "128", "--max-num-batched-tokens", "2048,64",
                     "--tp-sizes", "1,2"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "profile: prefill" in err and "profile: decode" in err
    assert "profile: prefill TP2" in err and "profile: TP2 decode_step_s" in err  # a two-rank engine timed
    assert "1P+1D seqs=128 tokens=2048" in out and "2x colocated seqs=128 tokens=64" in out
    assert "1x colocated(TP2) seqs=128 tokens=64" in out
    assert "Winner (predicted)" in out and "pdserve up --model" in out
    result = json.loads(out.strip().splitlines()[-1].removeprefix("RESULT "))
    ranking = result["workloads"][0]["ranking"]
    assert result["dry_run"] and len(ranking) == 6
    assert [p["tensor_parallel_size"] for p in result["profiles"]] == [1, 2]
    split = next(r for r in ranking if r["decode_tp"] == 2)
    assert "--prefill 0 --decode 1 --decode-tp 2 " in split["up_command"]
    # NOTE: a layout that meets the SLO even with all 16 requests at once predicts goodput inf,
    # written "inf" (JSON has no infinity): on a fast CPU the tiny model's can.
    predicted = [float(r["predicted_req_s"]) for r in ranking]
    assert predicted == sorted(predicted, reverse=True)
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads


def test_dry_run_with_a_saved_profile_needs_no_profiling(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(make_profile().to_json()))
    code = cli.main(["tune", "--model", str(tiny_model_dir), "--units", "4", "--slo-ttft-ms", "3000",
                     "--slo-tpot-ms", "30", "--workload", "500:20", "--dry-run", "--load-profile", str(path),
                     "--sim-seeds", "1", "--max-num-seqs", "128", "--max-num-batched-tokens", "2048"])
    out, err = capsys.readouterr()
    assert code == 0 and "profile: prefill" not in err
    ranking = json.loads(out.strip().splitlines()[-1].removeprefix("RESULT "))["workloads"][0]["ranking"]
    assert sorted(r["layout"].split(" seqs")[0] for r in ranking) == ["1P+3D", "2P+2D", "3P+1D", "4x colocated"]


@pytest.mark.parametrize("bad", [["--workload", "1024"], ["--workload", "8:8", "--units", "0"],
                                 ["--workload", "8:8", "--max-num-seqs", "x"],
                                 ["--workload", "8:8", "--units", "2", "--tp-sizes", "1,4"],
                                 ["--workload", "8:8", "--units", "3", "--tp-sizes", "3"]])
def test_bad_arguments_exit_with_2(tiny_model_dir, bad, capsys):
    args = ["tune", "--model", str(tiny_model_dir), "--slo-ttft-ms", "100", "--slo-tpot-ms", "10", "--dry-run"]
    assert cli.main(args + bad) == 2
    assert "pdserve tune:" in capsys.readouterr().err
