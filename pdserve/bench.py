"""`pdserve bench`: drive any OpenAI-compatible endpoint (pdserve's, vLLM's, ...) and report
latency, throughput, SLO attainment and goodput, one rate or a sweep; run_benchmark() is the same
from Python. Parts: bench_config, bench_datasets, bench_client, bench_load, bench_metrics, bench_report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import uvloop

from engine.protocol import default_of
from pdserve.bench_client import RequestRecord, first_model, token_counter
from pdserve.bench_config import (
    ARRIVALS,
    DATASETS,
    ENDPOINTS,
    BenchConfig,
    DatasetConfig,
    EndpointConfig,
    LoadConfig,
    SloConfig,
)
from pdserve.bench_datasets import Dataset, TokenCounter, build_dataset, warmup_dataset
from pdserve.bench_load import run_load
from pdserve.bench_metrics import goodput_rate, is_attainment_monotone, parse_rates, summarize
from pdserve.bench_report import format_sweep, format_table, jsonable, plot_run, plot_sweep, write_json

# NOTE: warm-up prompts come from seed + this, far from the measured runs' seeds (a sweep's rate
# i uses seed + i), so no warm-up prompt is a prefix-cache hit in a measured run.
_WARMUP_SEED_OFFSET = 10_000
_RESULT_FAILURES = 10  # failures listed on the RESULT line (all are in --result-json)

DEFINITIONS = """\
definitions (those of vLLM's benchmark_serving, `vllm bench serve`):
  TTFT      sending a request -> its first streamed chunk with choices
  E2E       sending a request -> its last chunk with choices (the usage chunk and [DONE] do not count)
  TPOT      per request (E2E - TTFT) / (output tokens - 1); requests with < 2 output tokens left out
  ITL       every gap between consecutive chunks with choices, pooled over all requests
  output tokens  the server's usage.completion_tokens (stream_options.include_usage is asked for); if it
            sends no usage, the chunks with text are counted (output_tokens_source says which)
  stats     mean, p50, p90, p95, p99 (numpy.percentile, linear interpolation) over completed requests
  duration  first arrival's scheduling -> last answer; throughputs = completed requests (their input /
            output tokens, from usage) / duration
  SLO attainment  share of ALL requests (a failure is a miss) that succeeded with TTFT <= --slo-ttft-ms
            and TPOT <= --slo-tpot-ms (only the targets given; TPOT is 0 below 2 output tokens)
  goodput   requests meeting the SLO per second of duration; --sweep: the goodput rate is the highest
            swept rate whose attainment is >= --slo-target
  arrivals  gaps gamma(shape=burstiness, scale=1/(rate*burstiness)) (poisson: burstiness 1; constant:
            1/rate), summed and scaled so the last arrival is at N/rate (multiturn: a user's first turn;
            later turns follow the answer at once). --max-concurrency holds a request until a slot is
            free; TTFT and E2E start when it is sent.
The last stdout line is `RESULT {json summary}`. Exit status 1 when any request failed."""


@dataclass
class BenchResult:
    """One run: every request's record, the duration and the summary (bench_metrics.summarize)."""

    model: str
    records: list[RequestRecord]
    duration_s: float
    summary: dict
    notes: dict[str, str]


def _run(coroutine):
    """Run the load on uvloop: the load generator often shares the cores it measures, so its CPU
    per streamed token counts (docs/slo-tuning.md, benchmarks/load_client.py)."""
    return uvloop.run(coroutine)


def run_benchmark(config: BenchConfig) -> BenchResult:
    """Warm up (if asked), then run config's load against its endpoint; blocks until done.
    Raises httpx.HTTPError / ValueError when the model or dataset cannot be had; a failed
    request is a record with an error, not an exception."""
    model = config.endpoint.model or first_model(config.endpoint)
    dataset, warmup = prepare_datasets(config, model)
    return _run(measure(config, model, dataset, warmup))


def prepare_datasets(config: BenchConfig, model: str) -> tuple[Dataset, Dataset | None]:
    """The measured dataset and the warm-up one (None without warm-up requests). Only ShareGPT
    counts tokens (the endpoint's /tokenize, else characters / 4)."""
    if config.dataset.name != "sharegpt":
        return _datasets(config, None, "")
    with token_counter(config.endpoint, model) as (count_tokens, source):
        return _datasets(config, count_tokens, source)


def _datasets(config: BenchConfig, count_tokens: TokenCounter | None, source: str) -> tuple[Dataset, Dataset | None]:
    dataset = build_dataset(config.dataset, config.endpoint.endpoint, count_tokens, source)
    if not config.load.num_warmup_requests:
        return dataset, None
    warm_config = replace(config.dataset, seed=config.dataset.seed + _WARMUP_SEED_OFFSET)
    return dataset, warmup_dataset(warm_config, config.endpoint.endpoint, config.load.num_warmup_requests,
                                   count_tokens, source)


async def measure(config: BenchConfig, model: str, dataset: Dataset, warmup: Dataset | None) -> BenchResult:
    """Send warmup (all at once, not measured; failures only noted on stderr), then dataset on
    config's schedule, and summarize the latter."""
    if warmup is not None:
        warm_config = replace(config, load=replace(config.load, request_rate=math.inf))
        warm = await run_load(warm_config, model, warmup, desc="warm-up")
        num_failed = sum(1 for r in warm.records if not r.is_ok)
        if num_failed:
            print(f"pdserve bench: {num_failed} of {len(warm.records)} warm-up requests failed", file=sys.stderr)
    result = await run_load(config, model, dataset)
    summary = summarize(result.records, result.duration_s, config.slo)
    return BenchResult(model, result.records, result.duration_s, summary, dataset.notes)


def run_sweep(config: BenchConfig, rates: list[float]) -> tuple[list[dict], float | None]:
    """One fresh run per rate (its own prompts: dataset seed + rate index, so no run is a cache
    hit of another); returns the points ({"request_rate", "summary", "result"}) and the goodput
    rate (None if no rate reaches config.slo.target)."""
    model = config.endpoint.model or first_model(config.endpoint)
    points = []
    for rate_idx, rate in enumerate(rates):
        rate_config = replace(config, load=replace(config.load, request_rate=rate),
                              dataset=replace(config.dataset, seed=config.dataset.seed + rate_idx))
        dataset, warmup = prepare_datasets(rate_config, model)
        result = _run(measure(rate_config, model, dataset, warmup))
        points.append({"request_rate": rate, "summary": result.summary, "result": result})
    return points, goodput_rate([(p["request_rate"], p["summary"]["slo_attainment"]) for p in points],
                                config.slo.target)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = DEFINITIONS
    _endpoint_arguments(parser.add_argument_group("endpoint"))
    _dataset_arguments(parser.add_argument_group("dataset"))
    _load_arguments(parser.add_argument_group("load"))
    _output_arguments(parser.add_argument_group("SLO and output"))


def _endpoint_arguments(group: argparse._ArgumentGroup) -> None:
    d = EndpointConfig
    group.add_argument("--base-url", default=default_of(d, "base_url"), help="endpoint root, without /v1")
    group.add_argument("--model", default=None, help="model name (default: the endpoint's first model)")
    group.add_argument("--endpoint", choices=ENDPOINTS, default=default_of(d, "endpoint"),
                       help="/v1/completions or /v1/chat/completions")
    group.add_argument("--stream", action=argparse.BooleanOptionalAction, default=default_of(d, "is_stream"),
                       help="stream the answers (without: TTFT = E2E, TPOT 0, no ITL)")
    group.add_argument("--temperature", type=float, default=default_of(d, "temperature"))
    group.add_argument("--logprobs", type=int, default=default_of(d, "logprobs"), metavar="N",
                       help="ask for N log probabilities a token: each token then comes in a chunk of its own, "
                            "even one without text")
    group.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    group.add_argument("--timeout-s", type=float, default=default_of(d, "timeout_s"), help="per request")


def _dataset_arguments(group: argparse._ArgumentGroup) -> None:
    d = DatasetConfig
    group.add_argument("--dataset", choices=DATASETS, default=default_of(d, "name"),
                       help="random: token ids (chat: words); jsonl: {'prompt', 'max_tokens'?} per line; sharegpt: "
                            "first human turn, answer length as max_tokens; multiturn: users sharing a system prompt")
    group.add_argument("--dataset-path", default=None)
    group.add_argument("--num-requests", type=int, default=default_of(d, "num_requests"))
    group.add_argument("--input-len", type=int, default=default_of(d, "input_len"),
                       help="random: prompt tokens; multiturn: words per user message")
    group.add_argument("--input-len-range", default=None,
                       help="R: uniform in [L(1-R), L(1+R)] (vLLM's --random-range-ratio); LOW:HIGH: uniform in those")
    group.add_argument("--output-len", type=int, default=default_of(d, "output_len"), help="max_tokens")
    group.add_argument("--output-len-range", default=None, help="as --input-len-range")
    group.add_argument("--sharegpt-output-len", type=int, default=None, help="sharegpt: fixed max_tokens")
    group.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                       help="ask for exactly max_tokens (default: on for random, off otherwise)")
    group.add_argument("--vocab-low", type=int, default=default_of(d, "vocab_low"))
    group.add_argument("--vocab-high", type=int, default=default_of(d, "vocab_high"),
                       help="random token ids are drawn in [vocab-low, vocab-high)")
    group.add_argument("--system-prompt-len", type=int, default=default_of(d, "system_prompt_len"),
                       help="multiturn: words of the shared system prompt")
    group.add_argument("--turns", type=int, default=default_of(d, "turns"), help="multiturn: turns per user")
    group.add_argument("--num-users", type=int, default=None, help="multiturn (default: num-requests // turns)")
    group.add_argument("--seed", type=int, default=default_of(d, "seed"), help="prompts and arrival times")


def _load_arguments(group: argparse._ArgumentGroup) -> None:
    d = LoadConfig
    group.add_argument("--request-rate", type=float, default=default_of(d, "request_rate"),
                       help="requests (multiturn: users) per second; inf: all at once")
    group.add_argument("--arrival", choices=ARRIVALS, default=default_of(d, "arrival"))
    group.add_argument("--burstiness", type=float, default=default_of(d, "burstiness"),
                       help="gamma shape (--arrival gamma): 1 Poisson, < 1 burstier, > 1 steadier")
    group.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    group.add_argument("--warmup-requests", type=int, default=default_of(d, "num_warmup_requests"),
                       help="sent all at once before the run, not measured")
    group.add_argument("--progress", action=argparse.BooleanOptionalAction, default=default_of(d, "show_progress"),
                       help="progress bar on stderr")
    group.add_argument("--sweep", default=None, metavar="RATES",
                       help="comma list of request rates: one fresh run each, and the goodput rate")


def _output_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--slo-ttft-ms", type=float, default=None)
    group.add_argument("--slo-tpot-ms", type=float, default=None)
    group.add_argument("--slo-target", type=float, default=default_of(SloConfig, "target"),
                       help="attainment a swept rate needs to count for the goodput rate")
    group.add_argument("--result-json", default=None, metavar="PATH", help="config, every request, summary")
    group.add_argument("--plot-dir", default=None, help="PNG plots (needs matplotlib)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig of parsed arguments; raises ValueError naming a bad value."""
    endpoint = EndpointConfig(base_url=args.base_url.rstrip("/"), model=args.model, endpoint=args.endpoint,
                              is_stream=args.stream, temperature=args.temperature, logprobs=args.logprobs,
                              api_key=args.api_key,
                              timeout_s=args.timeout_s)
    dataset = DatasetConfig(
        name=args.dataset, path=args.dataset_path, num_requests=args.num_requests, input_len=args.input_len,
        input_len_range=args.input_len_range, output_len=args.output_len, output_len_range=args.output_len_range,
        sharegpt_output_len=args.sharegpt_output_len, ignore_eos=args.ignore_eos, vocab_low=args.vocab_low,
        vocab_high=args.vocab_high, system_prompt_len=args.system_prompt_len, turns=args.turns,
        num_users=args.num_users, seed=args.seed,
    )
    load = LoadConfig(request_rate=args.request_rate, arrival=args.arrival, burstiness=args.burstiness,
                      max_concurrency=args.max_concurrency, num_warmup_requests=args.warmup_requests,
                      seed=args.seed, show_progress=args.progress)
    slo = SloConfig(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms, target=args.slo_target)
    return BenchConfig(endpoint, dataset, load, slo)


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        rates = parse_rates(args.sweep) if args.sweep else None
        if rates and not config.slo.is_set:
            raise ValueError("--sweep needs --slo-ttft-ms and/or --slo-tpot-ms")
    except ValueError as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    try:
        if rates:
            return _main_sweep(config, rates, args)
        return _main_single(config, args)
    except (httpx.HTTPError, ValueError, OSError, RuntimeError) as exc:
        print(f"pdserve bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


def _header(config: BenchConfig, model: str, notes: dict[str, str]) -> list[str]:
    e, d, load = config.endpoint, config.dataset, config.load
    path = "/v1/chat/completions" if e.endpoint == "chat" else "/v1/completions"
    lines = [f"Endpoint: {e.base_url}{path}, model {model}, {'streaming' if e.is_stream else 'not streaming'}",
             f"Dataset: {d.name}" + (f" ({d.path})" if d.path else "") + f", seed {d.seed}",
             f"Load: rate {load.request_rate:g}/s, {load.arrival} arrivals"
             + (f" (burstiness {load.burstiness:g})" if load.arrival == "gamma" else "")
             + f", max concurrency {load.max_concurrency or 'unlimited'}, {load.num_warmup_requests} warm-up"]
    return lines + [f"Note: {key}: {value}" for key, value in notes.items()]


def _main_single(config: BenchConfig, args: argparse.Namespace) -> int:
    result = run_benchmark(config)
    print(format_table(result.summary, _header(config, result.model, result.notes)), flush=True)
    if args.result_json:
        write_json(Path(args.result_json), {
            "config": _config_json(config), "model": result.model, "notes": result.notes,
            "summary": result.summary, "records": [r.to_json() for r in result.records]})
    if args.plot_dir:
        plot_run(Path(args.plot_dir), result.records, result.summary, config.load.max_concurrency)
    line = {**result.summary, "failures": result.summary["failures"][:_RESULT_FAILURES], "model": result.model}
    print("RESULT " + _dumps(line), flush=True)
    return 1 if result.summary["num_failed"] else 0


def _main_sweep(config: BenchConfig, rates: list[float], args: argparse.Namespace) -> int:
    points, rate = run_sweep(config, rates)
    is_monotone = is_attainment_monotone([(p["request_rate"], p["summary"]["slo_attainment"]) for p in points])
    print(format_sweep(points, config.slo.target, rate), flush=True)
    if not is_monotone:
        print("Note: attainment rose with the rate somewhere: the runs are noisy; use more requests",
              flush=True)
    sweep = {"rates": rates, "target": config.slo.target, "goodput_rate": rate,
             "is_attainment_monotone": is_monotone,
             "attainment": [p["summary"]["slo_attainment"] for p in points]}
    if args.result_json:
        runs = [{"request_rate": p["request_rate"], "summary": p["summary"],
                 "records": [r.to_json() for r in p["result"].records]} for p in points]
        write_json(Path(args.result_json), {"config": _config_json(config), "sweep": sweep, "runs": runs})
    if args.plot_dir:
        plot_sweep(Path(args.plot_dir), points, config.slo.target, rate)
        for p in points:
            plot_run(Path(args.plot_dir), p["result"].records, p["summary"], config.load.max_concurrency,
                     prefix=f"rate{p['request_rate']:g}_")
    print("RESULT " + _dumps({**sweep, "runs": [{"request_rate": p["request_rate"], **_brief(p["summary"])}
                                                   for p in points]}), flush=True)
    return 1 if any(p["summary"]["num_failed"] for p in points) else 0


def _brief(summary: dict) -> dict:
    keys = ("num_completed", "num_failed", "slo_attainment", "goodput_req_s", "request_throughput",
            "output_throughput", "ttft_ms", "tpot_ms")
    return {key: summary[key] for key in keys}


def _dumps(value: object) -> str:
    return json.dumps(jsonable(value))


def _config_json(config: BenchConfig) -> object:
    """The config as JSON, without the API key."""
    return jsonable(dataclasses.asdict(replace(config, endpoint=replace(config.endpoint, api_key=None))))
