"""Chaos run: 1 proxy, 2 prefill and 2 decode nodes of the tiny preset (pdserve.launcher), steady
greedy streaming load from the openai client, a random node SIGKILLed every --kill-every-s and
restarted by a Supervisor, and random client disconnects. Every completed answer is compared with
the same prompt's answer from before any kill.

Reports: sent / completed / failed / wrong / disconnected, leaked blocks (every node idle with all
blocks free at the end), RSS of every process at start and end, and per kill:
  serve_s    from the kill until the first probe request sent after it completes correctly (a
             probe thread sends a short greedy request every 0.2 s): how long new requests are
             not served normally; probes_after: the first probes sent after the kill (sent and
             done, seconds from the kill, and whether each came back right);
  stall_s    the longest pause of any stream in flight at the kill, from its last chunk before
             the kill to its next chunk after it (migration or retry included);
  recovery_s max(serve_s, stall_s), with its max and p50 over the kills;
  restart_s  until the restarted process answers a ping (the standby process, imports done, or
             with --no-standby a new process, loading the model), and
  rejoin_s   from then until the proxy's /health is 200 with every node up (the restarted node
             takes requests again); both reported apart from recovery; and
  blocks     the restarted node's KV blocks against its first start's (`pdserve up` pins them:
             pin_kv_capacity; nodes size their caches from free memory unless --num-blocks).
Target: >= 99.5% completed (of those not disconnected on purpose), 0 wrong, 0 leaked, recovery
<= 2 s.

    .venv/bin/python benchmarks/chaos.py [--duration-s 300] [--streams 4] [--kill-every-s 30]
        [--long-prompts 8 --chunk 128 --no-prefix-caching]   # prompts of several chunks: KV streamed

Ends with `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdserve.cluster import Supervisor  # noqa: E402
from pdserve.launcher import pin_kv_capacity, start_local, wait_healthy  # noqa: E402
from pdserve.make_model import make_model  # noqa: E402
from pdserve.ports import health_ok  # noqa: E402
from tests.e2e.conftest import node_load  # noqa: E402

MAX_TOKENS = 48
PROMPTS = [f"chaos prompt {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 5) for i in range(16)]
# Hundreds of tokens each: several chunks under --chunk 128, so their KV is streamed.
LONG_PROMPTS = [f"long chaos prompt {i}: " + "a lazy dog sleeps under the quick brown fox " * (12 + 4 * i)
                for i in range(8)]


@dataclass
class Counts:
    sent: int = 0
    completed: int = 0
    failed: int = 0
    wrong: int = 0
    disconnected: int = 0
    errors: list[str] = field(default_factory=list)
    # Per request: (started_at, chunk arrival times, ended_at), time.monotonic().
    timelines: list[tuple[float, list[float], float]] = field(default_factory=list)
    probes: list[tuple[float, float, bool]] = field(default_factory=list)  # (sent_at, done_at, correct)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, error: str | None = None) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + 1)
            if error is not None and len(self.errors) < 20:
                self.errors.append(error)


def _stream(client: openai.OpenAI, model: str, prompt: str, disconnect_after: int | None,
            chunk_times: list[float] | None = None) -> str | None:
    """The streamed text; None when this client hung up on purpose after disconnect_after chunks.
    chunk_times gets each chunk's arrival time."""
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    text = []
    for chunk in stream:
        if chunk_times is not None:
            chunk_times.append(time.monotonic())
        if chunk.choices:
            text.append(chunk.choices[0].text)
        if disconnect_after is not None and len(text) >= disconnect_after:
            stream.close()
            return None
    return "".join(text)


def _client_loop(client, model, expected, counts: Counts, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        prompt = rng.choice(PROMPTS)
        disconnect_after = rng.randint(1, MAX_TOKENS - 1) if rng.random() < 0.05 else None
        counts.add("sent")
        started_at, chunk_times = time.monotonic(), []
        try:
            text = _stream(client, model, prompt, disconnect_after, chunk_times)
        except Exception as exc:  # noqa: BLE001 - a failed request is what this counts
            counts.add("failed", f"{type(exc).__name__}: {exc}"[:300])
            continue
        finally:
            with counts.lock:
                counts.timelines.append((started_at, chunk_times, time.monotonic()))
        if text is None:
            counts.add("disconnected")
        elif text != expected[prompt]:
            counts.add("wrong", prompt)
        else:
            counts.add("completed")


PROBE_PROMPT = PROMPTS[0]
PROBE_TOKENS = 4
_PROBE_INTERVAL_S = 0.2
_PROBES_SHOWN = 6


def _probe_loop(client, model, expected: str, counts: Counts, stop: threading.Event) -> None:
    """A short greedy request every _PROBE_INTERVAL_S (one at a time), each recorded with whether
    it came back correct (its text is the start of the prompt's full answer)."""
    while not stop.is_set():
        sent_at = time.monotonic()
        try:
            response = client.completions.create(model=model, prompt=PROBE_PROMPT, max_tokens=PROBE_TOKENS,
                                                 temperature=0, extra_body={"ignore_eos": True}, timeout=30)
            correct = expected.startswith(response.choices[0].text)
        except Exception:  # noqa: BLE001 - a failed probe is what this records
            correct = False
        with counts.lock:
            counts.probes.append((sent_at, time.monotonic(), correct))
        stop.wait(max(0.0, _PROBE_INTERVAL_S - (time.monotonic() - sent_at)))


def _recovery(kill: dict, counts: Counts) -> None:
    """Fill kill with serve_s, stall_s and recovery_s (see the module docstring)."""
    killed_at = kill["killed_at"]
    served = [done for sent, done, ok in counts.probes if sent >= killed_at and ok]
    kill["serve_s"] = round(min(served) - killed_at, 2) if served else None
    # the first probes sent after the kill: (sent, done) from the kill, and whether each was right
    kill["probes_after"] = [(round(sent - killed_at, 2), round(done - killed_at, 2), ok)
                            for sent, done, ok in sorted(counts.probes) if sent >= killed_at][:_PROBES_SHOWN]
    stall = 0.0
    for started_at, chunk_times, ended_at in counts.timelines:
        if not started_at < killed_at < ended_at:
            continue
        before = max([started_at] + [t for t in chunk_times if t <= killed_at])
        after = [t for t in chunk_times if t > killed_at]
        stall = max(stall, (after[0] if after else ended_at) - before)
    kill["stall_s"] = round(stall, 2)
    kill["recovery_s"] = None if kill["serve_s"] is None else max(kill["serve_s"], kill["stall_s"])


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _rss_all(deployment) -> dict[str, float | None]:
    return {name: _rss_mb(proc.pid) for name, proc in deployment.cluster.procs}


def _tiny_model() -> Path:
    path = REPO / ".cache" / "models" / "tiny-seed0"
    if not (path / "model.safetensors").exists():
        make_model(path, "tiny", seed=0, show_progress=False)
    return path


def _chaos(deployment, supervisor: Supervisor, deadline: float, kill_every_s: float, rng: random.Random,
           blocks: dict[str, int]) -> list:
    """Kill a random node every kill_every_s until deadline; each kill's recovery record."""
    kills = []
    next_kill = time.monotonic() + kill_every_s
    while time.monotonic() < deadline:
        supervisor.tick()
        if time.monotonic() >= next_kill:
            name = rng.choice([n for n in deployment.node_addresses])
            killed_at = time.monotonic()
            deployment.cluster.process(name).kill()
            kills.append({"node": name, "killed_at": killed_at})
            _wait_recovered(deployment, supervisor, kills[-1])
            if kills[-1].get("rejoin_s") is not None:
                kills[-1]["blocks"] = [blocks.get(name), node_load(deployment.node_addresses[name]).num_total_blocks]
            next_kill = time.monotonic() + kill_every_s
        time.sleep(0.05)
    return kills


def _wait_recovered(deployment, supervisor: Supervisor, kill: dict, timeout_s: float = 120.0) -> None:
    """Fill kill with restart_s (until the new process answers a ping) and rejoin_s (from then
    until the proxy reports every node healthy again)."""
    address = deployment.node_addresses[kill["node"]]
    deadline = time.monotonic() + timeout_s
    up_at = None
    while time.monotonic() < deadline:
        supervisor.tick()
        if up_at is None and deployment.cluster.process(kill["node"]).poll() is None:
            try:
                node_load(address, timeout_s=0.2)
                up_at = time.monotonic()
            except TimeoutError:
                pass
        if up_at is not None and health_ok(deployment.base_url + "/health"):
            kill["restart_s"] = round(up_at - kill["killed_at"], 2)
            kill["rejoin_s"] = round(time.monotonic() - up_at, 2)
            return
        time.sleep(0.05)
    kill["rejoin_s"] = None


def _leaks(deployment) -> dict[str, int]:
    """Blocks not free per node once idle (waits up to 20 s for the last requests to end)."""
    leaks = {}
    for name, address in deployment.node_addresses.items():
        deadline = time.monotonic() + 20
        report = node_load(address)
        while report.num_free_blocks != report.num_total_blocks and time.monotonic() < deadline:
            time.sleep(0.2)
            report = node_load(address)
        leaks[name] = report.num_total_blocks - report.num_free_blocks + report.num_leases
    return leaks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=300.0, help="how long the load and the kills run")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--kill-every-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-blocks", type=int, default=None, help="per node (default: sized by each node)")
    parser.add_argument("--standby", action=argparse.BooleanOptionalAction, default=True,
                        help="restart nodes from a standby process (as pdserve up does)")
    parser.add_argument("--long-prompts", type=int, default=0, choices=range(len(LONG_PROMPTS) + 1),
                        help="add this many long prompts (hundreds of tokens) to the mix")
    parser.add_argument("--chunk", type=int, default=None, help="the nodes' --max-num-batched-tokens")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="the nodes' prefix caching (off: a repeated prompt is prefilled, and its KV "
                             "pulled, in full each time)")
    parser.add_argument("--kv-stream-min-tokens", type=int, default=None, help="the proxy's (default: its default)")
    args = parser.parse_args()
    PROMPTS.extend(LONG_PROMPTS[:args.long_prompts])
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    node_args = ["--max-num-seqs", "32"] + (["--num-blocks", str(args.num_blocks)] if args.num_blocks else [])
    node_args += ["--max-num-batched-tokens", str(args.chunk)] if args.chunk else []
    node_args += [] if args.prefix_caching else ["--no-enable-prefix-caching"]
    proxy_args = [] if args.kv_stream_min_tokens is None else ["--kv-stream-min-tokens", str(args.kv_stream_min_tokens)]
    deployment = start_local(_tiny_model(), num_prefill=2, num_decode=2, log_dir=log_dir, pin_cpus=False,
                             node_args=node_args, proxy_args=proxy_args)
    try:
        wait_healthy(deployment, 180)
        blocks = pin_kv_capacity(deployment) or {n: node_load(a).num_total_blocks
                                                 for n, a in deployment.node_addresses.items()}
        client = openai.OpenAI(base_url=deployment.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        expected = {p: _stream(client, model, p, None) for p in PROMPTS}
        rss_start = _rss_all(deployment)
        counts, stop = Counts(), threading.Event()
        threads = [threading.Thread(target=_client_loop, args=(client, model, expected, counts, stop, args.seed + i),
                                    daemon=True) for i in range(args.streams)]
        threads.append(threading.Thread(target=_probe_loop, args=(client, model, expected[PROBE_PROMPT], counts,
                                                                  stop), daemon=True))
        for thread in threads:
            thread.start()
        supervisor = Supervisor(deployment.cluster, initial_backoff_s=0.1, max_backoff_s=1.0,
                                keep_standby=args.standby)
        supervisor.tick()  # the standby starts now, not at the first kill
        kills = _chaos(deployment, supervisor, time.monotonic() + args.duration_s, args.kill_every_s,
                       random.Random(args.seed), blocks)
        stop.set()
        for thread in threads:
            thread.join(timeout=150)
        for kill in kills:
            _recovery(kill, counts)
        wait_healthy(deployment, 120)
        result = _result(counts, kills, _leaks(deployment), rss_start, _rss_all(deployment), log_dir)
        # NOTE: counted by each node since its last start (a restarted node starts from 0).
        result["streamed_kv_since_restarts"] = {name: node_load(address).num_kv_streamed
                                                for name, address in deployment.node_addresses.items()}
        result["long_prompts"], result["chunk"], result["prefix_caching"] = (args.long_prompts, args.chunk,
                                                                             args.prefix_caching)
        result["kv_stream_min_tokens"] = args.kv_stream_min_tokens
    finally:
        deployment.stop()
    print(json.dumps({k: v for k, v in result.items() if k != "errors"}, indent=1))  # noqa: T201 - the CLI's output
    from results_io import write_result

    write_result("chaos", result)
    return 0


def _result(counts: Counts, kills, leaks, rss_start, rss_end, log_dir: Path) -> dict:
    answered = counts.sent - counts.disconnected
    recoveries = sorted(k["recovery_s"] for k in kills if k.get("recovery_s") is not None)
    return {
        "sent": counts.sent, "completed": counts.completed, "failed": counts.failed, "wrong": counts.wrong,
        "disconnected": counts.disconnected,
        "completed_pct": round(100 * counts.completed / answered, 2) if answered else None,
        "kills": [{k: v for k, v in kill.items() if k != "killed_at"} for kill in kills],
        "max_recovery_s": max(recoveries) if recoveries else None,
        "max_back_s": max((k["restart_s"] + k["rejoin_s"] for k in kills if k.get("rejoin_s") is not None),
                          default=None),
        "same_blocks_after_restart": all("blocks" in k and k["blocks"][0] == k["blocks"][1] for k in kills),
        "p50_recovery_s": statistics.median(recoveries) if recoveries else None,
        "probes": len(counts.probes), "probes_failed": sum(not ok for _, _, ok in counts.probes),
        "leaked_blocks": leaks, "rss_mb_start": rss_start, "rss_mb_end": rss_end,
        "errors": counts.errors, "log_dir": str(log_dir),
    }


if __name__ == "__main__":
    raise SystemExit(main())
