"""benchmarks/proxy_capacity.py at toy size: every request completes through the real proxy in front
of the fake nodes, each round's CPU is counted for the proxy, the nodes and the client, and the
docs' renderer takes the record."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_small_run_counts_the_proxys_cpu_per_token_and_renders(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/proxy_capacity.py", "--rounds", "1", "--num-requests", "8",
                           "--output-len", "20"], cwd=REPO, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PDSERVE_RESULTS_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [path] = tmp_path.glob("proxy_capacity-*.json")
    result = json.loads(path.read_text())["result"]
    [round_] = result["rounds"]
    assert round_["completed"] == 8 and round_["failed"] == 0 and round_["output_tokens"] == 8 * 20
    assert round_["proxy_cpu_s"] > 0 and round_["nodes_cpu_s"] > 0 and round_["client_cpu_s"] > 0
    assert round_["proxy_us_per_token"] == result["proxy_us_per_token_median"] > 0
    from benchmarks import render_results

    block = render_results.render(render_results.load(tmp_path))[0]["proxy_capacity"]
    assert f"{result['proxy_us_per_token_median']:.1f} µs" in block
