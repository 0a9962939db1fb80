"""The proxy's cost per streamed token: how many tokens a second one proxy process carries when the
nodes are never the limit (nodes at GPU speed).

Fake prefill and decode nodes (tests/proxy/fake_node.py: the node protocol, a fake model, a decode
step every --step-ms for every running request) run in a process of their own, `pdserve proxy`
in another, and `pdserve bench` streams --num-requests completions of --input-len -> --output-len
tokens (EOS ignored) at rate inf, --rounds times. Each round reports the output tokens a second
delivered and the CPU seconds of the proxy, the fake nodes and the client, from /proc: the proxy's
microseconds of CPU per output token (request set-up included) is the figure, and one core over it
the most tokens a second one proxy process could carry.

    .venv/bin/python benchmarks/proxy_capacity.py [--rounds 3] [--num-requests 128] [--output-len 150]

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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.cpu_time import process_cpu_s  # noqa: E402
from pdserve.ports import free_port, wait_http_ok  # noqa: E402

NODES = """
import json, sys, time
from pathlib import Path
from engine.protocol import Role
from tests.proxy.conftest import _write_model_dir
from tests.proxy.fake_node import FakeNode, FakeNodeConfig
model_dir = _write_model_dir(Path(sys.argv[1]))
vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
nodes = [FakeNode(FakeNodeConfig(role=role, vocab_size=vocab, step_s=float(sys.argv[2]), prefill_s=0.001,
                                 max_model_len=256, num_total_blocks=100_000)).start()
         for role in (Role.PREFILL, Role.DECODE)]
print(json.dumps({"prefill": nodes[0].address, "decode": nodes[1].address, "vocab": vocab}), flush=True)
for line in sys.stdin:  # until the benchmark closes stdin
    pass
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=150, help="input + output stay within the fake model's 256")
    parser.add_argument("--step-ms", type=float, default=2.0, help="the fake decode node's step")
    return parser.parse_args()


def one_round(args: argparse.Namespace, base_url: str, vocab: int, pids: dict[str, int], out: Path) -> dict:
    before = {name: process_cpu_s(pid) for name, pid in pids.items()}
    argv = [str(REPO / ".venv" / "bin" / "pdserve"), "bench", "--base-url", base_url, "--num-requests",
            str(args.num_requests), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--ignore-eos", "--vocab-low", "10", "--vocab-high", str(vocab - 10), "--request-rate", "inf",
            "--no-progress", "--result-json", str(out)]
    with open(out.with_suffix(".log"), "w") as log:
        client = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(client.pid, 0)  # NOTE: waits for it; its own CPU from its rusage
    client.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    after = {name: process_cpu_s(pid) for name, pid in pids.items()}
    if client.returncode != 0 or not out.exists():
        raise RuntimeError(f"pdserve bench exited {client.returncode}: {out.with_suffix('.log').read_text()[-2000:]}")
    client_cpu = usage.ru_utime + usage.ru_stime
    result = json.loads(out.read_text())["summary"]
    tokens = result["total_output_tokens"]
    proxy_s = after["proxy"] - before["proxy"]
    return {"output_tok_s": round(result["output_throughput"], 1), "output_tokens": tokens,
            "completed": result["num_completed"], "failed": result["num_failed"],
            "duration_s": round(result["duration_s"], 3), "proxy_cpu_s": round(proxy_s, 4),
            "nodes_cpu_s": round(after["nodes"] - before["nodes"], 4), "client_cpu_s": round(client_cpu, 4),
            "proxy_us_per_token": round(1e6 * proxy_s / tokens, 1) if tokens else None}


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        nodes = subprocess.Popen([sys.executable, "-c", NODES, str(Path(tmp) / "model"), str(args.step_ms / 1000)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
        proxy = None
        try:
            hello = json.loads(nodes.stdout.readline())
            port = free_port()
            with open(Path(tmp) / "proxy.log", "w") as log:
                proxy = subprocess.Popen([str(REPO / ".venv" / "bin" / "pdserve"), "proxy", "--model",
                                          str(Path(tmp) / "model"), "--prefill", hello["prefill"], "--decode",
                                          hello["decode"], "--port", str(port), "--local-prefill-min-wait-s", "-1"],
                                         stdout=log, stderr=subprocess.STDOUT)
            base_url = f"http://127.0.0.1:{port}"
            wait_http_ok(base_url + "/health", 60)
            rounds = []
            for i in range(args.rounds):
                rounds.append(one_round(args, base_url, hello["vocab"], {"proxy": proxy.pid, "nodes": nodes.pid},
                                        Path(tmp) / f"bench-{i}.json"))
                print(f"round {i + 1}/{args.rounds}: {json.dumps(rounds[-1])}", flush=True)
        finally:
            if proxy is not None:
                proxy.send_signal(signal.SIGTERM)
                proxy.wait(timeout=30)
            nodes.stdin.close()
            nodes.wait(timeout=30)
    per_token = statistics.median(r["proxy_us_per_token"] for r in rounds)
    result = {"num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
              "step_ms": args.step_ms, "rounds": rounds, "proxy_us_per_token_median": per_token,
              "tok_s_per_proxy_core": round(1e6 / per_token), "output_tok_s_median":
              statistics.median(r["output_tok_s"] for r in rounds)}
    from benchmarks.results_io import write_result

    write_result("proxy_capacity", result)


if __name__ == "__main__":
    main()
