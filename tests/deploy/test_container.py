"""The container image and the compose files. Always: the Dockerfile's default command publishes
the proxy and keeps the nodes on loopback, its HEALTHCHECK passes on a 200 and fails on a 503,
HOME and the caches lie in a directory the image's user owns, a CUDA build gets Python's headers
and a CPU build drops the CUDA libraries; every compose service's command parses with pdserve's
own parser and the 2P+2D layout is wired together. The image built and run: container_check.py
beside this file, run by name where a container runtime is at hand."""

from __future__ import annotations

import http.server
import ipaddress
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from pdserve import cli
from pdserve.launcher import nodes_host
from pdserve.settings import apply_settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE_FILES = sorted((ROOT / "deploy" / "compose").glob("*.yaml"))
SECRET = "s" * 24
USER_ID = "10001"
CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32, "temperature": 0}  # README's first request


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    found, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if current and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        current += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            keyword, _, rest = current.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
            current = ""
    return found


def _dockerfile() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


def _last(keyword: str) -> str:
    values = [rest for name, rest in _dockerfile() if name == keyword]
    assert values, f"the Dockerfile has no {keyword}"
    return values[-1]


def _env() -> dict[str, str]:
    env = {}
    for name, rest in _dockerfile():
        if name == "ENV":
            env.update(pair.split("=", 1) for pair in shlex.split(rest))
    return env


def _parse(argv: list[str], environ: dict[str, str]):
    """argv as `pdserve` parses it, these PDSERVE_* variables applied."""
    assert argv and argv[0] in {name for name, _, _ in cli.COMMANDS}, f"unknown subcommand in {argv}"
    parser, _, chosen = cli._parser(argv[0])
    apply_settings(chosen, argv[0], argv, environ)
    return parser.parse_args(argv)


def test_the_default_command_publishes_the_proxy_and_keeps_the_nodes_on_loopback():
    assert json.loads(_last("ENTRYPOINT")) == ["pdserve"]
    argv = json.loads(_last("CMD"))
    args = _parse(argv, {})
    assert argv[0] == "up" and args.host == "0.0.0.0" and args.node_host is None
    assert nodes_host(args.host) == "127.0.0.1"
    assert any(f"make-model {args.model} " in rest for name, rest in _dockerfile() if name == "RUN"), (
        "the default command serves the model converted at build time")
    assert str(args.port) in _last("EXPOSE").split()


def _healthcheck_argv() -> list[str]:
    rest = _last("HEALTHCHECK")
    options, _, command = rest.partition("CMD ")
    assert "--start-period=" in options, "the first start (model load, warm-up) needs a start period"
    argv = json.loads(command)
    assert argv[0] == "python", "slim images have no curl: the check is Python's"
    return [sys.executable, *argv[1:]]


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(("status", "is_healthy"), [(200, True), (503, False)])
def test_the_healthcheck_passes_only_on_a_200_from_health(status, is_healthy):
    handler = type("Handler", (_Health,), {"status": status})
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        env = {**os.environ, "HEALTHCHECK_URL": f"http://127.0.0.1:{server.server_address[1]}/health"}
        done = subprocess.run(_healthcheck_argv(), env=env, capture_output=True, timeout=30)
        server.shutdown()
    assert (done.returncode == 0) is is_healthy, done.stderr.decode()[-500:]


def test_the_healthcheck_asks_the_proxy_of_the_default_command_by_default():
    argv = json.loads(_last("CMD"))
    port = _parse(argv, {}).port
    assert f"'http://127.0.0.1:{port}/health'" in " ".join(_healthcheck_argv())


def test_home_and_the_caches_lie_in_a_directory_the_user_owns():
    env = _env()
    home = Path(env["HOME"])
    for name in ("PDSERVE_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert Path(env[name]).parent == home, f"{name}={env[name]} outside HOME={home}"
    assert _last("USER") == USER_ID
    runs = " ".join(rest for name, rest in _dockerfile() if name == "RUN")
    assert f"--uid {USER_ID}" in runs and f"chown -R {USER_ID}:{USER_ID} {home}" in runs
    flags = {f"PDSERVE_{a.dest.upper()}" for command, _, _ in cli.COMMANDS for a in cli._parser(command)[2]._actions}
    assert not set(env) & flags, "an image-wide PDSERVE_* flag would change every role's command line"


def _install_run() -> str:
    runs = [rest for name, rest in _dockerfile() if name == "RUN" and "pip install" in rest]
    assert len(runs) == 1
    return runs[0]


def _branches(run: str) -> tuple[str, str]:
    """The install RUN's CUDA branch and CPU branch (chosen by the torch installed)."""
    cuda = run[run.index("torch.version.cuda"):]
    return cuda[:cuda.index("fi;", cuda.index("else"))], run[run.index('if [ "$is_cuda" = 0 ]'):]


def test_a_cuda_build_gets_python_headers_for_triton_and_keeps_gcc():
    cuda, cpu = _branches(_install_run())
    assert "apt-get install -y --no-install-recommends python3-dev" in cuda.split("else")[0]
    assert "Python.h" in cuda and "python3-dev" not in cpu
    assert "gcc" in _install_run().split("python3 -m venv")[0]


def test_a_cpu_build_has_no_cuda_libraries():
    run = _install_run()
    _, cpu = _branches(run)
    assert "pip uninstall -y triton nixl-cu13" in cpu and "apt-get purge -y --auto-remove gcc libc6-dev" in cpu
    assert re.search(r"--index-url \"?\$\{TORCH_INDEX\}\"? torch==", run)
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in DOCKERFILE.read_text()


def test_the_model_is_readable_and_no_source_copy_shadows_the_installed_packages():
    """`pdserve up` starts its nodes as `python -m pdserve.cli`: the working directory comes first
    on their sys.path, so sources left there would be imported instead of the installed packages
    (without the compiled CPU kernels), and a cache folder there could pass for a package."""
    workdirs = [rest for name, rest in _dockerfile() if name == "WORKDIR"]
    run = _install_run()
    assert "chmod -R a+rX /models" in run.split("make-model", 1)[1]
    assert f"rm -rf /var/lib/apt/lists/* {workdirs[0]}" in run and workdirs[-1] == "/"


def test_the_build_context_leaves_out_what_the_image_does_not_copy():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "tests", "models"} <= set(ignored) and "wheels" not in ignored


# --- compose files ---------------------------------------------------------------------------


def _compose(name: str) -> dict:
    return yaml.safe_load((ROOT / "deploy" / "compose" / name).read_text())


def _interpolated(value: str) -> str:
    """Compose's ${VAR:?message} and ${VAR} with the test's values."""
    return re.sub(r"\$\{PDSERVE_CLUSTER_SECRET(:\?[^}]*)?\}", SECRET, value)


def _service_args(service: dict):
    environ = {key: _interpolated(str(value)) for key, value in (service.get("environment") or {}).items()}
    return _parse([str(part) for part in service["command"]], environ)


def test_the_compose_files_are_the_two_layouts():
    assert [path.name for path in COMPOSE_FILES] == ["one-host.yaml", "two-by-two.yaml"]


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda path: path.name)
def test_every_compose_service_runs_the_image_with_a_command_pdserve_takes(path):
    document = yaml.safe_load(path.read_text())
    assert document["services"]
    for name, service in document["services"].items():
        assert service["image"].startswith("pdserve:"), name
        assert isinstance(service["command"], list) and all(isinstance(part, str) for part in service["command"]), (
            f"{name}: compose wants the command as a list of strings")
        _service_args(service)
        assert {"cache:/cache"} <= set(service.get("volumes", [])), f"{name}: /cache (HOME, caches) on a volume"
        assert service.get("read_only") is True and "/tmp" in service.get("tmpfs", []), name


def test_one_host_runs_up_with_one_prefill_and_one_decode_node_and_publishes_the_proxy():
    service, = _compose("one-host.yaml")["services"].values()
    args = _service_args(service)
    assert (service["command"][0], args.prefill, args.decode, args.host) == ("up", 1, 1, "0.0.0.0")
    assert args.node_host is None, "the nodes stay on the container's loopback"
    assert [port.rsplit(":", 1)[1] for port in service["ports"]] == [str(args.port)]
    assert "HEALTHCHECK_URL" not in (service.get("environment") or {}), "the image's check asks the proxy"


def test_two_by_two_nodes_advertise_their_own_address_and_the_proxy_lists_them_all():
    document = _compose("two-by-two.yaml")
    subnet = ipaddress.ip_network(document["networks"]["pdserve"]["ipam"]["config"][0]["subnet"])
    roles = {"prefill": [], "decode": []}
    for name, service in document["services"].items():
        args = _service_args(service)
        address = service["networks"]["pdserve"]["ipv4_address"]
        assert ipaddress.ip_address(address) in subnet, name
        assert args.cluster_secret == SECRET, f"{name}: every listener off loopback needs the cluster secret"
        if service["command"][0] == "proxy":
            proxy, proxy_args = service, args
            continue
        assert (args.host, args.advertise_host) == ("0.0.0.0", address), name
        assert service["environment"]["HEALTHCHECK_URL"] == f"http://127.0.0.1:{args.health_port}/health", name
        assert "ports" not in service, f"{name}: only the proxy is published"
        roles[service["command"][0]].append(f"{address}:{args.port}")
    assert (len(roles["prefill"]), len(roles["decode"])) == (2, 2)
    assert proxy_args.prefill.split(",") == roles["prefill"] and proxy_args.decode.split(",") == roles["decode"]
    assert proxy_args.host == "0.0.0.0" and [p.rsplit(":", 1)[1] for p in proxy["ports"]] == [str(proxy_args.port)]
    assert set(proxy["depends_on"]) == {n for n, s in document["services"].items() if s is not proxy}


# --- the image, built and run ------------------------------------------------------------------
