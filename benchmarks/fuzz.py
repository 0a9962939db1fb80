"""Fuzz the proxy's HTTP API for a long while: the proxy (in this process) in front of fast fake
nodes, Schemathesis cases from its /openapi.json (positive and negative) and the hostile bodies
of tests/proxy/fuzzing.py. Prints the answers counted by source and status, the problems found
(a 5xx, a hang, an error that is not an OpenAI error object) and `RESULT {json}` last; exits 1
if any problem was found.

    .venv/bin/python benchmarks/fuzz.py [--time-s 240] [--max-examples 100000] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.protocol import Role  # noqa: E402
from proxy.app import create_app  # noqa: E402
from proxy.config import ProxyConfig  # noqa: E402
from tests.conftest import UvicornServer  # noqa: E402
from tests.proxy.conftest import MODEL_NAME, _write_model_dir  # noqa: E402
from tests.proxy.fake_node import FakeNode, FakeNodeConfig  # noqa: E402
from tests.proxy.fuzzing import FuzzReport, check_still_serving, fuzz_schema, send_hostile  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-s", type=float, default=240.0, help="time for the Schemathesis cases (half each mode)")
    parser.add_argument("--max-examples", type=int, default=100_000, help="cases per mode at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=20.0, help="longest wait for one answer")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _write_model_dir(Path(tmp) / "model")
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        nodes = [FakeNode(FakeNodeConfig(role=role, vocab_size=vocab_size, step_s=0.001, prefill_s=0.001)).start()
                 for role in (Role.PREFILL, Role.DECODE)]
        config = ProxyConfig(model_dir=str(model_dir), served_model_name=MODEL_NAME, max_model_len=64,
                             prefill_addresses=(nodes[0].address,), decode_addresses=(nodes[1].address,))
        server = UvicornServer(create_app(config))
        server.start()
        try:
            report = _fuzz(f"http://127.0.0.1:{server.port}", args)
        finally:
            server.stop()
            for node in nodes:
                node.stop()
    return _print(report, args)


def _fuzz(base_url: str, args: argparse.Namespace) -> FuzzReport:
    from pdserve.ports import wait_http_ok

    wait_http_ok(base_url + "/health", timeout_s=10)
    started = time.monotonic()
    report = send_hostile(base_url, MODEL_NAME, args.timeout_s)
    fuzz_schema(base_url, MODEL_NAME, args.max_examples, args.time_s, args.timeout_s, args.seed, report)
    report.problems += send_hostile(base_url, MODEL_NAME, args.timeout_s).problems  # once more, after the fuzzing
    report.problems += check_still_serving(base_url, MODEL_NAME)
    report.elapsed_s = time.monotonic() - started
    return report


def _print(report: FuzzReport, args: argparse.Namespace) -> int:
    table = report.by_status()
    print(f"{'source':10} {'status':>16} {'cases':>8}")
    for source, statuses in table.items():
        for status, num in statuses.items():
            print(f"{source:10} {status:>16} {num:>8}")
    for problem in report.problems[:50]:
        print("PROBLEM", problem)
    for accepted in report.accepted_negative[:20]:
        print("negative case accepted:", accepted)
    result = {"num_cases": report.num_cases, "by_status": table, "num_problems": len(report.problems),
              "num_negative_accepted": len(report.accepted_negative), "elapsed_s": round(report.elapsed_s, 1),
              "time_s": args.time_s, "seed": args.seed}
    from results_io import write_result

    write_result("fuzz", result)
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
