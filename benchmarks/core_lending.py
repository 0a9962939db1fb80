"""Core lending as `pdserve up` ships it, against `--no-lend-cores`, on an idle host and beside a
busy loop: alternated pairs on one machine.

Each run starts `pdserve up` on the default model (a 2-core host: prefill node on core 0, decode
node on core 1, core lending on by default for it), waits for ready, sends the README's chat
request --chats times one after another (their latencies: the first after ready, then the rest),
then --streams concurrent streams of --stream-tokens greedy tokens (output tokens/s), then stops
it. A condition `busy<N>` runs a bounded busy loop pinned to core N from before the start to the
end of the run (started and killed here), `busy<N>:<P>` one busy P% of each 10 ms (a bursty
neighbour). The decode node's counts of borrowed and preempted borrowed steps come from its
/metrics.

    .venv/bin/python benchmarks/core_lending.py [--pairs 2] [--conditions idle,busy0:30,busy0]

Ends with `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdserve.default_model import ensure_default_model  # noqa: E402
from pdserve.ports import free_port, wait_http_ok  # noqa: E402

MODES = {"default": [], "no-lend": ["--no-lend-cores"]}
README_CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
               "max_tokens": 32, "temperature": 0}
_HOG = """import time
end, duty = time.monotonic() + {s}, {duty}
while time.monotonic() < end:
    began = time.monotonic()
    while time.monotonic() - began < duty * 0.01:
        pass
    if duty < 1:
        time.sleep((1 - duty) * 0.01)
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the default model, made if missing)")
    parser.add_argument("--pairs", type=int, default=2, help="alternated pairs per condition")
    parser.add_argument("--conditions", default="idle,busy0", help="idle, busy<N> (a busy loop on core N), "
                        "busy<N>:<P> (busy P%% of each 10 ms on core N)")
    parser.add_argument("--chats", type=int, default=5)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--log-dir", default=None, help="keep each run's `pdserve up` output here")
    return parser.parse_args()


def start_hog(condition: str, seconds: float) -> subprocess.Popen | None:
    if condition == "idle":
        return None
    core, _, percent = condition.removeprefix("busy").partition(":")
    return subprocess.Popen([sys.executable, "-c", _HOG.format(s=seconds, duty=int(percent or 100) / 100)],
                            preexec_fn=lambda: os.sched_setaffinity(0, {int(core)}))


def decode_counts(url: str) -> dict[str, float]:
    wanted = {"pdserve_node_borrowed_core_steps": "borrowed_steps",
              "pdserve_node_preempted_borrowed_core_steps": "preempted_steps",
              "pdserve_node_decode_batch_size_count": "decode_steps"}
    counts = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name.removesuffix("_total") in wanted:
                counts[wanted[sample.name.removesuffix("_total")]] = sample.value
    return counts


def one_run(model: Path, mode: str, condition: str, args: argparse.Namespace, log: Path) -> dict:
    hog = start_hog(condition, 600)
    port = free_port()
    with open(log, "w") as out:
        up = subprocess.Popen([str(REPO / ".venv" / "bin" / "pdserve"), "up", "--model", str(model),
                               "--port", str(port), *MODES[mode]], stdout=out, stderr=subprocess.STDOUT,
                              start_new_session=True, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{base}/health", args.ready_timeout_s, check=lambda: _alive(up, log))
        chats = []
        with httpx.Client(base_url=base, timeout=120) as client:
            for _ in range(args.chats):
                started = time.monotonic()
                response = client.post("/v1/chat/completions", json=README_CHAT)
                response.raise_for_status()
                chats.append(time.monotonic() - started)
            text = response.json()["choices"][0]["message"]["content"]
            body = {**README_CHAT, "max_tokens": args.stream_tokens, "ignore_eos": True}
            started = time.monotonic()
            with ThreadPoolExecutor(args.streams) as pool:
                usages = list(pool.map(lambda _: client.post("/v1/chat/completions", json=body).json()["usage"],
                                       range(args.streams)))
            wall = time.monotonic() - started
        tok_s = sum(u["completion_tokens"] for u in usages) / wall
        rss_mb = _rss_mb(up.pid)
        decode_health = _decode_health_url(log)
        counts = decode_counts(decode_health) if decode_health else {}
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        if hog is not None:
            hog.kill()
            hog.wait()
    return {"mode": mode, "condition": condition, "chat_s": [round(c, 3) for c in chats], "text": text,
            "stream_tok_s": round(tok_s, 1), "rss_mb": rss_mb, **counts}


def _alive(up: subprocess.Popen, log: Path) -> None:
    if up.poll() is not None:
        raise RuntimeError(f"pdserve up exited {up.returncode}: {log.read_text()[-2000:]}")


def _rss_mb(pid: int) -> dict[str, int]:
    """Resident memory of each process pdserve up started (by role: up, proxy, prefill, decode), in MB."""
    found = {}
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            argv = Path(f"/proc/{current}/cmdline").read_text().split("\0")
            rss = next(int(line.split()[1]) for line in Path(f"/proc/{current}/status").read_text().splitlines()
                       if line.startswith("VmRSS:"))
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except (OSError, StopIteration):
            continue
        role = next((w for w in argv if w in ("up", "proxy", "prefill", "decode")), None)
        if role is not None and "pdserve.standby" not in argv:
            found[role] = found.get(role, 0) + rss // 1024
        pending += [int(c) for c in children]
    return found


def _decode_health_url(log: Path) -> str | None:
    for line in log.read_text().splitlines():
        if line.strip().startswith("decode0: http"):
            return line.split()[1].rstrip(",").removesuffix("/health")
    return None


def summary(runs: list[dict]) -> list[dict]:
    rows = []
    for condition in dict.fromkeys(r["condition"] for r in runs):
        row = {"condition": condition}
        for mode in MODES:
            mine = [r for r in runs if r["condition"] == condition and r["mode"] == mode]
            row[mode] = {"first_chat_s": [r["chat_s"][0] for r in mine],
                         "later_chat_median_s": round(statistics.median(c for r in mine for c in r["chat_s"][1:]), 3),
                         "stream_tok_s": [r["stream_tok_s"] for r in mine]}
        default, plain = row["default"], row["no-lend"]
        row["chat_ratio"] = round(default["later_chat_median_s"] / plain["later_chat_median_s"], 3)
        row["stream_ratio"] = round(statistics.median(default["stream_tok_s"])
                                    / statistics.median(plain["stream_tok_s"]), 3)
        rows.append(row)
    return rows


def main() -> None:
    args = parse_args()
    model = Path(args.model) if args.model else ensure_default_model(REPO / "models" / "smollm2")
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="pdserve-lending-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for condition in args.conditions.split(","):
        for pair in range(args.pairs):
            order = list(MODES) if pair % 2 == 0 else list(reversed(MODES))
            for mode in order:
                run = one_run(model, mode, condition, args, log_dir / f"{condition}-{pair}-{mode}.log")
                runs.append(run)
                print(json.dumps(run), flush=True)
    result = {"model": model.name, "cores": len(os.sched_getaffinity(0)), "chats": args.chats,
              "streams": args.streams, "stream_tokens": args.stream_tokens, "runs": runs, "summary": summary(runs)}
    from results_io import write_result

    write_result("core_lending", result)


if __name__ == "__main__":
    main()
