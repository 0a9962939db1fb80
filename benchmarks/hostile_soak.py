"""Hostile soak: `pdserve up`'s processes (tiny preset, --prefill/--decode nodes, loopback) under
hostile traffic beside a canary, the greedy stream of an innocent client.

Phases: quiet (the canary alone: its answers are the expected ones, its TTFT the baseline), then
hostile for --duration-s: the canary goes on while
  - schemas whose grammar would cost a node seconds or more ((a|b){10007}, ^(a+)+$, a{100000},
    [a-z]{1,200000}, (a|b){5000}, ...) arrive at --schema-rate per second (each must get a 400
    within --answer-within-s);
  - costly schemas the proxy lets through (distinct patterns near the grammar budget, compiled on
    the nodes' grammar threads) at --costly-rate per second (0: none);
  - malformed bodies (tests/proxy/fuzzing.hostile_bodies, those under 64 KiB) at --garbage-rate
    per second (each must get a 4xx);
  - clients that send half a body and hang up, at --disconnect-rate per second.
Reports the canary's success (exact text) and TTFT p50/p99 quiet and under attack, the hostile
answers by status, how many nodes the proxy marked stuck, the proxy's log size, and the proxy's
request ledger at the end (no request open, none unanswered).

    .venv/bin/python benchmarks/hostile_soak.py [--duration-s 30] [--prefill 1] [--decode 1]

Ends with `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdserve.launcher import start_local, wait_healthy  # noqa: E402
from pdserve.make_model import make_model  # noqa: E402
from tests.proxy.fuzzing import hostile_bodies  # noqa: E402

MODEL = "tiny-seed0"
CANARY_PROMPTS = [f"canary {i}: the quick brown fox jumps over the lazy dog" for i in range(4)]
CANARY_TOKENS = 16
HOSTILE_PATTERNS = ["(a|b){10007}", "^(a+)+$", "a{100000}", "[a-z]{1,200000}", "(a|b){5000}", "(a|b){8017}",
                    "(a|b){5001}"]
MAX_GARBAGE_BYTES = 64 << 10


@dataclass
class Tally:
    statuses: dict[str, Counter] = field(default_factory=dict)  # kind -> status -> count
    slow: Counter = field(default_factory=Counter)  # kind -> answers later than answer_within_s
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, status: str, seconds: float, within_s: float) -> None:
        with self.lock:
            self.statuses.setdefault(kind, Counter())[status] += 1
            if seconds > within_s:
                self.slow[kind] += 1

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.statuses.values())


@dataclass
class Canary:
    expected: dict[str, str] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    ok: int = 0
    failed: list[str] = field(default_factory=list)


def canary_run(client: httpx.Client, deadline: float, canary: Canary, learn: bool) -> None:
    """Sequential greedy streams until deadline; learn: their texts are the expected ones."""
    i = 0
    while time.monotonic() < deadline:
        prompt = CANARY_PROMPTS[i % len(CANARY_PROMPTS)]
        i += 1
        body = {"model": MODEL, "prompt": prompt, "max_tokens": CANARY_TOKENS, "temperature": 0, "stream": True,
                "ignore_eos": True}
        started, first, text = time.monotonic(), None, []
        try:
            with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    canary.failed.append(f"{response.status_code}: {response.read()[:200]!r}")
                    continue
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"error event: {event['error']}")
                    piece = event["choices"][0]["text"]
                    if piece and first is None:
                        first = time.monotonic()
                    text.append(piece)
        except (httpx.HTTPError, RuntimeError) as exc:
            canary.failed.append(f"{type(exc).__name__}: {exc}")
            continue
        got = "".join(text)
        if learn:
            canary.expected.setdefault(prompt, got)
        if canary.expected.get(prompt) != got:
            canary.failed.append(f"wrong text for {prompt!r}: {got!r}")
            continue
        canary.ok += 1
        canary.ttft_s.append((first or time.monotonic()) - started)


def paced(rate: float, deadline: float, send) -> None:
    """Call send(i) rate times a second until deadline (never faster; slower when send is)."""
    if rate <= 0:
        return
    i, start = 0, time.monotonic()
    while time.monotonic() < deadline:
        send(i)
        i += 1
        pause = start + i / rate - time.monotonic()
        if pause > 0:
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))


def schema_body(pattern: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "s", "schema": {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}},
                                        "required": ["s"]}}}}


def post(client: httpx.Client, tally: Tally, kind: str, path: str, within_s: float, **request) -> None:
    started = time.monotonic()
    try:
        status = str(client.post(path, **request).status_code)
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    tally.add(kind, status, time.monotonic() - started, within_s)


def half_body_and_hang_up(host: str, port: int) -> None:
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": \"tiny")


def metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == (labels or {}):
                return sample.value
    return float("nan")


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, 100 * q)) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--quiet-s", type=float, default=10.0)
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--schema-rate", type=float, default=5.0)
    parser.add_argument("--costly-rate", type=float, default=0.0)
    parser.add_argument("--garbage-rate", type=float, default=90.0)
    parser.add_argument("--disconnect-rate", type=float, default=5.0)
    parser.add_argument("--answer-within-s", type=float, default=5.0)
    parser.add_argument("--log-dir", default=None, help="keep the processes' logs here (default: a temporary folder)")
    args = parser.parse_args()

    model_dir = REPO / ".cache" / "models" / MODEL
    if not (model_dir / "model.safetensors").exists():
        make_model(model_dir, "tiny", seed=0, show_progress=False)
    garbage = [(name, path, content, ctype) for name, path, content, ctype in hostile_bodies(MODEL)
               if len(content) <= MAX_GARBAGE_BYTES]
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(args.log_dir) if args.log_dir else Path(tmp) / "logs"
        deployment = start_local(model_dir, num_prefill=args.prefill, num_decode=args.decode, log_dir=log_dir,
                                 pin_cpus=False)
        try:
            wait_healthy(deployment, 180)
            host, port = deployment.base_url.removeprefix("http://").rsplit(":", 1)
            canary, quiet, tally = Canary(), Canary(), Tally()
            with httpx.Client(base_url=deployment.base_url, timeout=60.0) as client:
                print(f"quiet: the canary alone for {args.quiet_s:.0f} s", flush=True)
                canary_run(client, time.monotonic() + args.quiet_s, quiet, learn=True)
            canary.expected = quiet.expected
            deadline = time.monotonic() + args.duration_s

            def hostile(rate: float, send) -> threading.Thread:
                def run() -> None:
                    with httpx.Client(base_url=deployment.base_url, timeout=60.0) as client:
                        paced(rate, deadline, lambda i: send(client, i))
                return threading.Thread(target=run, daemon=True)

            threads = [
                hostile(args.schema_rate, lambda c, i: post(
                    c, tally, "schema", "/v1/chat/completions", args.answer_within_s,
                    json=schema_body(HOSTILE_PATTERNS[i % len(HOSTILE_PATTERNS)]))),
                hostile(args.costly_rate, lambda c, i: post(
                    c, tally, "costly_schema", "/v1/chat/completions", args.answer_within_s,
                    json=schema_body(f"[a-z]{{{1900 + i % 100}}}x{i}"))),
                hostile(args.garbage_rate, lambda c, i: post(
                    c, tally, "garbage", garbage[i % len(garbage)][1], args.answer_within_s,
                    content=garbage[i % len(garbage)][2],
                    headers={"Content-Type": garbage[i % len(garbage)][3]} if garbage[i % len(garbage)][3] else {})),
                hostile(args.disconnect_rate, lambda _c, _i: half_body_and_hang_up(host, int(port))),
            ]
            print(f"hostile: {args.duration_s:.0f} s beside the canary", flush=True)
            for thread in threads:
                thread.start()
            with httpx.Client(base_url=deployment.base_url, timeout=60.0) as client:
                canary_run(client, deadline, canary, learn=False)
            for thread in threads:
                thread.join(timeout=120)
            time.sleep(1.0)  # the ends under way
            metrics = httpx.get(deployment.base_url + "/metrics", timeout=10).text
        finally:
            deployment.stop()
        proxy_log = (log_dir / "proxy.log").read_text(errors="replace")
        node_logs = {p.stem: p.stat().st_size for p in log_dir.glob("*.log") if p.stem != "proxy"}
    quiet_p99, hostile_p99 = percentile(quiet.ttft_s, 0.99), percentile(canary.ttft_s, 0.99)
    result = {
        "nodes": f"{args.prefill}P+{args.decode}D", "duration_s": args.duration_s,
        "requests_sent": tally.total + len(canary.ttft_s) + len(canary.failed) + len(quiet.ttft_s),
        "canary_ok": canary.ok, "canary_failed": len(canary.failed), "canary_errors": canary.failed[:5],
        "canary_ttft_quiet_p50_ms": 1e3 * statistics.median(quiet.ttft_s) if quiet.ttft_s else None,
        "canary_ttft_quiet_p99_ms": 1e3 * quiet_p99 if quiet_p99 is not None else None,
        "canary_ttft_hostile_p50_ms": 1e3 * statistics.median(canary.ttft_s) if canary.ttft_s else None,
        "canary_ttft_hostile_p99_ms": 1e3 * hostile_p99 if hostile_p99 is not None else None,
        "ttft_p99_ratio": hostile_p99 / quiet_p99 if quiet_p99 and hostile_p99 else None,
        "hostile_statuses": {kind: dict(c) for kind, c in tally.statuses.items()},
        "hostile_answered_late": dict(tally.slow),
        "nodes_marked_stuck": proxy_log.count("is stuck (no progress)"),
        "proxy_log_bytes": len(proxy_log.encode()), "node_log_bytes": node_logs,
        "requests_open_at_end": metric(metrics, "pdserve_requests_open"),
        "requests_unanswered": metric(metrics, "pdserve_request_ends_total", {"outcome": "unanswered"}),
    }
    sys.path.insert(0, str(REPO / "benchmarks"))
    from results_io import write_result

    write_result("hostile_soak", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
