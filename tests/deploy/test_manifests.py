"""The Kubernetes manifests (deploy/k8s: base + CPU overlay) against the code they run: every
container's command line parses with pdserve's own parser (environment settings included, as
pdserve.settings reads them), every probe hits an endpoint the process serves on the port its
flags give, every port matches a flag, every secret reference exists. Rendered with `kubectl
kustomize` where kubectl is installed (it embeds kustomize; no pip-installable kustomize
exists), else by the small resolver below (resources, namespace, images, labels and strategic
merge patches of containers by name: all the overlay uses), which the kubectl path checks."""

from __future__ import annotations

import copy
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient

from node.health import HealthServer
from pdserve import cli
from pdserve.settings import apply_settings
from proxy.app import create_app
from proxy.main import config_from_args

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "deploy" / "k8s" / "overlays" / "cpu"
RENDERED = REPO / "deploy" / "k8s" / "rendered-cpu.yaml"  # kubectl kustomize OVERLAY, committed
NODE_FLAG_PORTS = {"--port": "control", "--kv-port": "kv", "--health-port": "health"}


def render(directory: Path) -> list[dict]:
    """The manifests kustomize would build from directory (without kubectl: resolve())."""
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, check=True,
                             timeout=60).stdout
        return [d for d in yaml.safe_load_all(out) if d]
    return resolve(directory)


def resolve(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    documents: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        documents += resolve(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        for change in yaml.safe_load_all((directory / patch["path"]).read_text()):
            target = next(d for d in documents if (d["kind"], d["metadata"]["name"]) == (change["kind"],
                                                                                      change["metadata"]["name"]))
            _merge(target, change)
    for document in documents:
        if "namespace" in kustomization:
            document["metadata"]["namespace"] = kustomization["namespace"]
        for pairs in kustomization.get("labels", []):
            document["metadata"].setdefault("labels", {}).update(pairs["pairs"])
        for container in _containers(document):
            for image in kustomization.get("images", []):
                if container["image"].split(":")[0] == image["name"]:
                    container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return documents


def _merge(target: dict, change: dict) -> None:
    """Strategic merge as kustomize does it for what the overlays patch: maps merge, lists of
    named items (containers, env) merge by name (items new to the list go first, as kustomize
    puts them), other lists replace."""
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        elif isinstance(value, list) and value and isinstance(value[0], dict) and "name" in value[0]:
            named = {item["name"]: item for item in target.setdefault(key, [])}
            added = []
            for item in value:
                if item["name"] in named:
                    _merge(named[item["name"]], item)
                else:
                    added.append(copy.deepcopy(item))
            target[key][:0] = added
        else:
            target[key] = copy.deepcopy(value)


def _containers(document: dict) -> list[dict]:
    return document.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    return render(OVERLAY)


def _by(manifests, kind: str, name: str) -> dict:
    return next(d for d in manifests if d["kind"] == kind and d["metadata"]["name"] == name)


def _parse(container: dict, monkeypatch) -> tuple:
    """The container's command line as pdserve would take it: (args, parser) with the
    container's PDSERVE_* environment applied (secret and field references as placeholders)."""
    assert container["command"] == ["pdserve"]
    argv = container["args"]
    for variable in container.get("env", []):
        value = variable.get("value") or ("10.0.0.9" if "fieldRef" in variable.get("valueFrom", {})
                                          else "x" * 24)
        monkeypatch.setenv(variable["name"], value)
    parser, _, chosen = cli._parser(argv[0])
    apply_settings(chosen, argv[0], argv)
    return parser.parse_args(argv), chosen


def _key(document: dict) -> tuple[str, str]:
    return (document["kind"], document["metadata"]["name"])


def test_the_resolver_agrees_with_kustomize():
    """The resolver equals kustomize's rendering: kubectl's own where it is installed (and then
    the committed deploy/k8s/rendered-cpu.yaml must be that rendering, refreshed with `kubectl
    kustomize deploy/k8s/overlays/cpu > deploy/k8s/rendered-cpu.yaml`), else the committed one."""
    committed = [d for d in yaml.safe_load_all(RENDERED.read_text()) if d]
    if shutil.which("kubectl"):
        assert sorted(committed, key=_key) == sorted(render(OVERLAY), key=_key), \
            f"{RENDERED.name} is stale: refresh it with kubectl kustomize"
    assert sorted(resolve(OVERLAY), key=_key) == sorted(committed, key=_key)


def test_every_object_is_there_in_the_overlay_namespace(manifests):
    kinds = {(d["kind"], d["metadata"]["name"]) for d in manifests}
    for name in ("pdserve-proxy", "pdserve-prefill", "pdserve-decode"):
        assert {("Deployment", name), ("Service", name), ("PodDisruptionBudget", name)} <= kinds
    assert ("Secret", "pdserve-secrets") in kinds and ("ServiceMonitor", "pdserve-proxy") in kinds
    assert {d["metadata"]["namespace"] for d in manifests} == {"pdserve"}
    for kind in ("prefill", "decode"):
        assert _by(manifests, "Service", f"pdserve-{kind}")["spec"]["clusterIP"] == "None"  # headless: DNS lists pods
    for deployment in (d for d in manifests if d["kind"] == "Deployment"):
        for container in _containers(deployment):
            assert container["image"] == "pdserve:cpu" and container["resources"]["requests"]


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_node_command_ports_probes_and_drain(manifests, kind, monkeypatch):
    deployment = _by(manifests, "Deployment", f"pdserve-{kind}")
    container = _containers(deployment)[0]
    args, _ = _parse(container, monkeypatch)
    assert args.command == kind and args.host == "0.0.0.0" and args.advertise_host == "10.0.0.9"
    assert args.cluster_secret and args.log_format == "json"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {name: getattr(args, flag[2:].replace("-", "_")) for flag, name in NODE_FLAG_PORTS.items()}
    # The probes: on the health port, paths the node's HealthServer answers (200/503, not 404).
    node = type("Node", (), {"last_progress_at": time.monotonic(), "is_serving": True, "is_draining": False})()
    server = HealthServer("127.0.0.1", 0, node)
    server.start()
    try:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert ports[get["port"]] == args.health_port, probe
            status = httpx.get(f"http://127.0.0.1:{server.port}{get['path']}", timeout=5).status_code
            assert status == 200, (probe, get["path"], status)
    finally:
        server.close()
    # The headless Service's ports name the container's; the drain waits inside the grace period.
    service = _by(manifests, "Service", f"pdserve-{kind}")
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    assert "kill -TERM 1" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > args.drain_timeout_s


def test_proxy_command_ports_probes_and_discovery(manifests, monkeypatch, tiny_model_dir):
    deployment = _by(manifests, "Deployment", "pdserve-proxy")
    container = _containers(deployment)[0]
    args, _ = _parse(container, monkeypatch)
    assert args.command == "proxy" and args.admin_token and args.cluster_secret
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.port}
    # Discovery names are the node Services at their control port.
    for kind in ("prefill", "decode"):
        host, port = getattr(args, f"{kind}_dns").split(":")
        service = _by(manifests, "Service", host)
        assert int(port) in {p["port"] for p in service["spec"]["ports"] if p["name"] == "control"}
    args.model = str(tiny_model_dir)  # the image's model is not here: the tests' tiny one
    client = TestClient(create_app(config_from_args(args)))  # no lifespan: no node is dialed
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert ports[get["port"]] == args.port, probe
        assert client.get(get["path"]).status_code in (200, 503), (probe, get["path"])  # served, not 404
    monitor = _by(manifests, "ServiceMonitor", "pdserve-proxy")["spec"]["endpoints"][0]
    assert client.get(monitor["path"]).status_code == 200 and monitor["port"] == "http"
    assert _by(manifests, "Service", "pdserve-proxy")["spec"]["ports"][0]["targetPort"] == "http"


def test_every_secret_reference_exists(manifests):
    secrets = {d["metadata"]["name"]: d.get("stringData", d.get("data", {}))
               for d in manifests if d["kind"] == "Secret"}
    references = [v["valueFrom"]["secretKeyRef"] for d in manifests for c in _containers(d) for v in c.get("env", [])
                  if "secretKeyRef" in v.get("valueFrom", {})]
    assert references
    for reference in references:
        assert reference["key"] in secrets[reference["name"]], reference
    assert all(len(value) >= 16 for value in secrets["pdserve-secrets"].values())



GPU_OVERLAY = REPO / "deploy" / "k8s" / "overlays" / "gpu"


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_the_gpu_overlay_gives_each_node_pod_one_gpu(kind, monkeypatch):
    """deploy/k8s/overlays/gpu: the CUDA image, one nvidia.com/gpu per node pod on GPU nodes, the
    node's device set to cuda (its command line still parses); the proxy asks for no GPU. Where
    kubectl is installed its rendering equals the resolver's."""
    manifests = render(GPU_OVERLAY)
    if shutil.which("kubectl"):
        assert sorted(manifests, key=_key) == sorted(resolve(GPU_OVERLAY), key=_key)
    pod = _by(manifests, "Deployment", f"pdserve-{kind}")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == "pdserve:cuda"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    args, _ = _parse(container, monkeypatch)
    assert args.device == "cuda"
    names = {variable["name"] for variable in container["env"]}
    assert names >= {"PDSERVE_ADVERTISE_HOST", "PDSERVE_CLUSTER_SECRET", "PDSERVE_DEVICE"}
    [proxy] = _containers(_by(manifests, "Deployment", "pdserve-proxy"))
    assert "nvidia.com/gpu" not in str(proxy.get("resources"))


TP_OVERLAY = REPO / "deploy" / "k8s" / "overlays" / "cpu-tp"


def test_the_split_model_overlay_gives_prefill_pods_two_ranks_their_cores_and_shared_memory(monkeypatch):
    """deploy/k8s/overlays/cpu-tp: prefill pods of TP=2 (their command line parses so) with two
    cores and a memory-backed /dev/shm for the worker ranks' caches, beside decode pods of one rank."""
    manifests = render(TP_OVERLAY)
    if shutil.which("kubectl"):
        assert sorted(manifests, key=_key) == sorted(resolve(TP_OVERLAY), key=_key)
    pod = _by(manifests, "Deployment", "pdserve-prefill")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args, _ = _parse(container, monkeypatch)
    assert args.tensor_parallel_size == 2
    assert container["resources"]["limits"]["cpu"] == "2"
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    [decode] = _containers(_by(manifests, "Deployment", "pdserve-decode"))
    monkeypatch.delenv("PDSERVE_TENSOR_PARALLEL_SIZE", raising=False)
    assert _parse(decode, monkeypatch)[0].tensor_parallel_size == 1
