"""`pdserve bench`: drive any OpenAI-compatible endpoint and report latency and throughput.

Requests go to /v1/completions with streaming on, as token-id prompts (so prompt lengths are
exact), all at once, at a fixed rate, or as a Poisson process. Reported: output tokens/s,
TTFT / TPOT / e2e percentiles, and the share of requests meeting both SLO targets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class RequestRecord:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    num_output_tokens: int = 0
    token_times_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first."""
        if self.num_output_tokens < 2:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass
class BenchConfig:
    base_url: str
    model: str
    num_requests: int = 64
    prompt_len: int = 256
    output_len: int = 64
    request_rate: float = float("inf")  # requests/s; inf: all at once
    poisson: bool = True
    vocab_low: int = 8
    vocab_high: int = 2000
    seed: int = 0
    ttft_slo_ms: float = 1000.0
    tpot_slo_ms: float = 100.0
    timeout_s: float = 600.0


def make_prompts(config: BenchConfig) -> list[list[int]]:
    rng = random.Random(config.seed)
    return [[rng.randrange(config.vocab_low, config.vocab_high) for _ in range(config.prompt_len)]
            for _ in range(config.num_requests)]


async def _one_request(client: httpx.AsyncClient, config: BenchConfig, prompt: list[int]) -> RequestRecord:
    body = {"model": config.model, "prompt": prompt, "max_tokens": config.output_len,
            "min_tokens": config.output_len, "temperature": 0.0, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    record = RequestRecord(ok=False)
    try:
        async with client.stream("POST", config.base_url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    record.error = str(chunk["error"])
                    return record
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    now = time.perf_counter() - start
                    if not record.token_times_s:
                        record.ttft_s = now
                    record.token_times_s.append(now)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.e2e_s = time.perf_counter() - start
    record.num_output_tokens = config.output_len
    record.ok = True
    return record


async def run_load(config: BenchConfig) -> tuple[list[RequestRecord], float]:
    """Send every request on the schedule; returns the records and the wall time."""
    prompts = make_prompts(config)
    rng = random.Random(config.seed + 1)
    limits = httpx.Limits(max_connections=config.num_requests + 8, max_keepalive_connections=config.num_requests + 8)
    async with httpx.AsyncClient(timeout=config.timeout_s, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(_one_request(client, config, prompt)))
            if config.request_rate != float("inf"):
                gap = rng.expovariate(config.request_rate) if config.poisson else 1.0 / config.request_rate
                await asyncio.sleep(gap)
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - start


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[idx]


def summarize(records: list[RequestRecord], wall_s: float, config: BenchConfig) -> dict:
    ok = [r for r in records if r.ok]
    ttft_ms = [r.ttft_s * 1000 for r in ok]
    tpot_ms = [r.tpot_s * 1000 for r in ok]
    e2e_s = [r.e2e_s for r in ok]
    meets = [r for r in ok if r.ttft_s * 1000 <= config.ttft_slo_ms and r.tpot_s * 1000 <= config.tpot_slo_ms]
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "errors": [r.error for r in records if not r.ok][:5],
        "wall_s": wall_s,
        "output_tok_s": sum(r.num_output_tokens for r in ok) / wall_s if wall_s else 0.0,
        "request_s": len(ok) / wall_s if wall_s else 0.0,
        "ttft_ms_p50": _percentile(ttft_ms, 50), "ttft_ms_p99": _percentile(ttft_ms, 99),
        "tpot_ms_p50": _percentile(tpot_ms, 50), "tpot_ms_p99": _percentile(tpot_ms, 99),
        "e2e_s_p50": _percentile(e2e_s, 50), "e2e_s_p99": _percentile(e2e_s, 99),
        "slo_attainment": len(meets) / len(records) if records else 0.0,
        "goodput_req_s": len(meets) / wall_s if wall_s else 0.0,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: the endpoint's first model)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    parser.add_argument("--fixed-rate", action="store_true", help="evenly spaced instead of Poisson arrivals")
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=100.0)
    parser.add_argument("--vocab-high", type=int, default=2000, help="prompt token ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    model = args.model or httpx.get(args.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    config = BenchConfig(
        base_url=args.base_url, model=model, num_requests=args.num_requests, prompt_len=args.prompt_len,
        output_len=args.output_len, request_rate=args.request_rate, poisson=not args.fixed_rate,
        vocab_high=args.vocab_high, seed=args.seed, ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms,
    )
    print(f"pdserve bench: {config.num_requests} requests x {config.prompt_len} prompt / "
          f"{config.output_len} output tokens -> {config.base_url}", flush=True)
    records, wall_s = asyncio.run(run_load(config))
    summary = summarize(records, wall_s, config)
    for key, value in summary.items():
        print(f"  {key:>16}: {value:.3f}" if isinstance(value, float) else f"  {key:>16}: {value}")
    print("RESULT " + json.dumps({"config": {k: v for k, v in asdict(config).items() if k != "base_url"}, **summary}))
    return 0 if summary["num_ok"] == summary["num_requests"] else 1
