"""Bursts past the proxy's limits: how fast a refusal comes beside how long an admitted request
takes, in the same bursts.

`pdserve`'s processes (`tiny`, 1P+1D, loopback; nodes running at most --max-num-seqs requests at
once) behind a proxy with `--max-num-requests`. After a warm-up, --bursts bursts of --burst
completions (--output-len tokens, EOS ignored) go out at once, each over its own connection
opened beforehand (so the client's own connection set-up is not timed), one burst after the
previous one has drained. For each answer: the time from its first byte sent to the last byte of
its answer. Reports per burst the admitted and refused counts, the refusals' p50/p90/max, the
admitted requests' median and their first end, and the ratio refusal p90 / admitted median; over
all bursts the same; and the proxy's resident memory before and at its peak.

    .venv/bin/python benchmarks/overload.py [--bursts 5] [--burst 50] [--max-num-requests 8]

Ends with `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdserve.launcher import Deployment, start_local, wait_healthy  # noqa: E402
from pdserve.make_model import make_model  # noqa: E402

MODEL = "tiny-seed0"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bursts", type=int, default=5)
    parser.add_argument("--burst", type=int, default=50, help="requests sent at once in each burst")
    parser.add_argument("--max-num-requests", type=int, default=8, help="the proxy's limit")
    parser.add_argument("--max-num-seqs", type=int, default=2, help="the decode node's running batch")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--log-dir", default=None, help="keep the processes' logs here (default: a temporary folder)")
    return parser.parse_args()


@dataclass
class RawAnswer:
    status: int
    headers: dict[str, str]
    body: bytes
    elapsed_s: float  # from the first byte sent to the last byte of the answer
    ended_at: float  # time.monotonic() at the last byte of the answer

    def json(self) -> dict:
        return json.loads(self.body)


async def raw_post(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], body: dict) -> RawAnswer:
    """POST body to /v1/completions over an open connection (no client library's own time in it)."""
    reader, writer = connection
    payload = json.dumps(body).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(payload)) + payload
    started = time.monotonic()
    writer.write(request)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 120)
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
    content = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 120)
    ended = time.monotonic()
    return RawAnswer(int(status_line.split()[1]), headers, content, ended - started, ended)


async def burst(base_url: str, bodies: list[dict], sample: Callable[[], float]) -> tuple[list[RawAnswer], list]:
    """POST every body to /v1/completions at once, each over its own connection opened first;
    sample() is called every 5 ms meanwhile. Returns the answers and the samples."""
    url = urlsplit(base_url)
    connections = [await asyncio.open_connection(url.hostname, url.port) for _ in bodies]
    samples = [sample()]

    async def sample_every() -> None:
        while True:
            await asyncio.sleep(0.005)
            samples.append(sample())

    sampler = asyncio.create_task(sample_every())
    try:
        return list(await asyncio.gather(*(raw_post(conn, body) for conn, body in zip(connections, bodies)))), samples
    finally:
        sampler.cancel()
        for _, writer in connections:
            writer.close()


def rss_mb(pid: int) -> float:
    """The process's resident memory in MB (0 where /proc says none)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def prompts(num: int, seed: int) -> list[list[int]]:
    """num random prompts of 8-39 token ids in [8, 1500) (the tiny model's vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(8, 1500) for _ in range(rng.randrange(8, 40))] for _ in range(num)]


def _stats(answers: list[RawAnswer]) -> dict:
    admitted = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status == 429]
    row = {"admitted": len(admitted), "refused": len(refused),
           "other": sorted({a.status for a in answers} - {200, 429})}
    if refused:
        times = [a.elapsed_s for a in refused]
        row["refusal_ms"] = {"p50": round(1000 * statistics.median(times), 2), "p90": round(1000 * p90(times), 2),
                             "max": round(1000 * max(times), 2)}
    if admitted:
        first_end = min(a.ended_at for a in admitted)
        row["admitted_ms"] = {"median": round(1000 * statistics.median(a.elapsed_s for a in admitted), 1),
                              "first_end": round(1000 * min(a.elapsed_s for a in admitted), 1)}
        row["refused_after_first_admitted_end"] = sum(a.ended_at >= first_end for a in refused)
    if refused and admitted:
        row["refusal_p90_over_admitted_median"] = round(row["refusal_ms"]["p90"] / row["admitted_ms"]["median"], 4)
    return row


def _wait_drained(deployment: Deployment, at_most_s: float = 60.0) -> None:
    deadline = time.monotonic() + at_most_s
    while time.monotonic() < deadline:
        text = httpx.get(deployment.base_url + "/metrics", timeout=10).text
        if "pdserve_requests_in_flight 0.0" in text:
            return
        time.sleep(0.1)
    raise RuntimeError(f"requests still in flight {at_most_s:.0f} s after the burst")


def main() -> None:
    args = parse_args()
    model_dir = REPO / ".cache" / "models" / MODEL
    if not (model_dir / "model.safetensors").exists():
        make_model(model_dir, "tiny", seed=0, show_progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(args.log_dir) if args.log_dir else Path(tmp) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        deployment = start_local(model_dir, num_prefill=1, num_decode=1, log_dir=log_dir, pin_cpus=False,
                                 node_args=["--max-num-batched-tokens", "256", "--max-num-seqs",
                                            str(args.max_num_seqs)],
                                 proxy_args=["--max-num-requests", str(args.max_num_requests),
                                             "--local-prefill-min-wait-s", "-1"])
        try:
            wait_healthy(deployment, 180)
            model = httpx.get(deployment.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
            bodies = [{"model": model, "prompt": p, "max_tokens": args.output_len, "ignore_eos": True,
                       "temperature": 0} for p in prompts(args.burst, seed=1)]
            for body in bodies[:3]:  # warm-up: first steps, and the proxy's measured drain rate
                httpx.post(deployment.base_url + "/v1/completions", json=body, timeout=120).raise_for_status()
            pid = deployment.cluster.process("proxy").pid
            rss = [rss_mb(pid)]
            rss_before = rss[0]
            bursts, everything = [], []
            for i in range(args.bursts):
                answers, samples = asyncio.run(burst(deployment.base_url, bodies, lambda: rss_mb(pid)))
                rss += samples
                everything += answers
                bursts.append(_stats(answers))
                print(f"burst {i + 1}/{args.bursts}: {json.dumps(bursts[-1])}", flush=True)
                _wait_drained(deployment)
        finally:
            deployment.stop()
    late = sum(b.get("refused_after_first_admitted_end", 0) for b in bursts)  # times compare within a burst
    result = {"model": MODEL, "burst": args.burst, "bursts": args.bursts, "max_num_requests": args.max_num_requests,
              "max_num_seqs": args.max_num_seqs, "output_len": args.output_len, "per_burst": bursts,
              "all": {**_stats(everything), "refused_after_first_admitted_end": late},
              "proxy_rss_mb": {"before": round(rss_before, 1), "peak": round(max(rss), 1)}}
    from results_io import write_result

    write_result("overload", result)


if __name__ == "__main__":
    main()
