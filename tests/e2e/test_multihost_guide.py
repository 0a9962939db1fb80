"""docs/multihost.md replayed: its command block, run as written in two network namespaces (host A
and host B, each with an address of its own), with the page's addresses, model and cores
replaced by the namespaces' addresses, the test's checkpoint and one core per node. Greedy
requests through the proxy equal transformers' with every prompt on the KV path, the proxy's
/metrics carries each node's vllm:* series, and every TCP port the processes listen on is one
the page's firewall table opens."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engine.protocol import curve_keys
from pdserve.cluster import Cluster
from pdserve.launcher import Deployment, wait_healthy
from pdserve.netns import TestNetwork
from tests.e2e.conftest import assert_kv_path_only
from tests.e2e.test_pipeline import client_for, hf, hf_greedy, model_name, random_prompts  # noqa: F401

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "multihost.md"
PAGE_ADDRESSES = {"A": "10.0.0.11", "B": "10.0.0.12"}


def guide_commands() -> tuple[dict[str, str], list[tuple[str, dict[str, str], list[str]]]]:
    """The exported variables, and (host, environment, argv) of each command in the page's
    block of commands, in order."""
    text = GUIDE.read_text()
    block = text[text.index("## Commands"):text.index("## Checks")]
    [code] = re.findall(r"```bash\n(.*?)```", block, flags=re.S)
    exported, commands, host = {}, [], None
    for line in code.splitlines():
        if line.startswith("# host"):
            host = line.removeprefix("# host").strip()
        elif line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            exported[name] = value
        elif line.strip():
            words = shlex.split(line)
            env = {}
            while "=" in words[0]:
                name, _, value = words.pop(0).partition("=")
                env[name] = value
            commands.append((host, env, words))
    return exported, commands


def _ports(text: str) -> set[int]:
    """The ports of the page's firewall table: single ports and ranges."""
    table = text[text.index("## Ports and firewall"):text.index("UCX picks")]
    ports = set()
    for row in table.splitlines()[2:]:
        cell = row.split("|")[1].strip() if row.startswith("|") else ""
        for part in cell.split(","):
            first, _, last = part.strip().partition("-")
            if first.isdigit():
                ports.update(range(int(first), int(last or first) + 1))
    return ports


def _listening_ports(namespace: str, pids: set[int]) -> set[int]:
    """TCP ports the given processes (and their children) listen on, inside the namespace."""
    out = subprocess.run(["ip", "netns", "exec", namespace, "ss", "-Htlnp"], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    ports = set()
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids:
            ports.add(int(line.split()[3].rsplit(":", 1)[1]))
    return ports


def _substituted(word: str, replace: dict[str, str]) -> str:
    for old, new in replace.items():
        word = word.replace(old, new)
    return word


@pytest.fixture(scope="module")
def guide(tiny_model_dir, tmp_path_factory):
    exported, commands = guide_commands()
    core_a, core_b = sorted(os.sched_getaffinity(0))[:2]
    with TestNetwork(["A", "B"]) as net:
        cluster = Cluster()
        log_dir = tmp_path_factory.mktemp("guide-logs")
        replace = {**{PAGE_ADDRESSES[h]: net.hosts[h].address for h in PAGE_ADDRESSES},
                   "models/smollm2": str(tiny_model_dir)}
        cores = {"0-7": str(core_a), "8-15": str(core_b)}
        started = {}
        for host, env, argv in commands:
            argv = [_substituted(word, replace) for word in argv]
            if "--cpus" in argv:
                i = argv.index("--cpus") + 1
                argv[i] = cores[argv[i]]
            assert argv[0] == "pdserve", argv
            role = argv[1]
            name = argv[argv.index("--node-id") + 1] if "--node-id" in argv else role
            full = net.hosts[host].command([sys.executable, "-m", "pdserve.cli", *argv[1:]])
            cluster.start(name, full, log_dir, {**exported, **env})
            started[name] = (host, argv)
        proxy_host, proxy_argv = started["proxy"]
        port = proxy_argv[proxy_argv.index("--port") + 1]
        nodes = {n: f"{net.hosts[h].address}:{a[a.index('--port') + 1]}" for n, (h, a) in started.items()
                 if n != "proxy"}
        deployment = Deployment(cluster, f"http://{net.hosts[proxy_host].address}:{port}", nodes, log_dir)
        try:
            wait_healthy(deployment, 180)
            yield deployment, net, started, exported
        finally:
            deployment.stop()


def test_the_guides_layout_serves_greedy_requests_over_the_kv_path(guide, hf):  # noqa: F811
    deployment, net, started, exported = guide
    client = client_for(deployment)
    name = model_name(client)
    prompts = random_prompts(8, [12, 40, 90], seed=5)
    expected = [hf_greedy(hf, p, 8)[0] for p in prompts]
    _, tokenizer = hf
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: client.completions.create(model=name, prompt=p, max_tokens=8,
                                                                    temperature=0), prompts))
    for i, (result, want) in enumerate(zip(results, expected)):
        assert result.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), f"prompt {i}"
    assert_kv_path_only(deployment, curve_keys(exported["PDSERVE_CLUSTER_SECRET"]))
    # One proxy scrape shows all four nodes' series (their /metrics on the page's --health-port).
    page = httpx.get(deployment.base_url + "/metrics", timeout=10).text
    engines = set(re.findall(r'^vllm:num_requests_running\{[^}]*engine="([^"]+)"', page, flags=re.M))
    assert engines == {"prefill0", "prefill1", "decode0", "decode1"}


def test_every_listening_port_is_in_the_guides_firewall_table(guide):
    deployment, net, started, _ = guide
    allowed = _ports(GUIDE.read_text())
    procs = dict(deployment.cluster.procs)
    for host in ("A", "B"):
        pids = {procs[name].pid for name, (where, _) in started.items() if where == host}  # ip netns exec execs
        listening = _listening_ports(net.hosts[host].name, pids)
        assert listening and listening <= allowed, (host, sorted(listening - allowed))
        # UCX's listeners are in the ranges the page gives each node (its TCP transport carries the KV).
        assert any(7400 <= p <= 7499 for p in listening), (host, sorted(listening))
