"""The Kubernetes manifests (deploy/k8s: base + overlays) against the code they run: every
container's command line parses with pdserve's own parser (environment settings included, as
pdserve.settings reads them), every probe hits an endpoint the process serves on the port its
flags give, every port matches a flag, every secret reference exists; and what an operator needs
on a first day: a Namespace, every process scraped (annotations, or the Operator's monitors in
their own overlay), PodDisruptionBudgets that let a drain evict a lone pod, non-root read-only
containers, pools spread over hosts, an autoscaler on the nodes' own load. Rendered with
`kubectl kustomize` where kubectl is installed (it embeds kustomize; no pip-installable kustomize
exists), else by the small resolver below (resources, namespace, images, labels and strategic
merge patches of containers by name: all the overlays use), which the kubectl path checks."""

from __future__ import annotations

import copy
import math
import re
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
OVERLAYS = sorted(path for path in (REPO / "deploy" / "k8s" / "overlays").iterdir() if path.is_dir())


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
        if "namespace" in kustomization and document["kind"] == "Namespace":
            document["metadata"]["name"] = kustomization["namespace"]  # as kustomize renames it
        elif "namespace" in kustomization:
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
    puts them), other lists replace, a null deletes."""
    for key, value in change.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
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


def _parse(container: dict) -> tuple:
    """The container's command line as pdserve would take it: (args, parser) with the
    container's PDSERVE_* environment applied (secret and field references as placeholders)."""
    assert container["command"] == ["pdserve"]
    argv = container["args"]
    environ = {variable["name"]: variable.get("value") or ("10.0.0.9" if "fieldRef" in variable.get("valueFrom", {})
                                                           else "x" * 24)
               for variable in container.get("env", [])}
    parser, _, chosen = cli._parser(argv[0])
    apply_settings(chosen, argv[0], argv, environ)
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
    assert {("Secret", "pdserve-secrets"), ("Namespace", "pdserve")} <= kinds
    for kind in ("prefill", "decode"):
        assert _by(manifests, "Service", f"pdserve-{kind}")["spec"]["clusterIP"] == "None"  # headless: DNS lists pods
    for deployment in (d for d in manifests if d["kind"] == "Deployment"):
        for container in _containers(deployment):
            assert container["image"] == "pdserve:cpu" and container["resources"]["requests"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda path: path.name)
def test_every_overlay_renders_with_kustomize_into_its_namespace(overlay):
    """`kubectl kustomize` builds every overlay (where kubectl is installed), the resolver (the
    fallback of the other tests) agrees with it, and every namespaced object lies in the
    overlay's own Namespace object, which the apply creates before them."""
    manifests = resolve(overlay)
    if shutil.which("kubectl"):  # where it is installed (here it is): the resolver agrees with it
        manifests = render(overlay)
        assert sorted(manifests, key=_key) == sorted(resolve(overlay), key=_key)
    [namespace] = [d["metadata"]["name"] for d in manifests if d["kind"] == "Namespace"]
    assert {d["metadata"].get("namespace") for d in manifests if d["kind"] != "Namespace"} == {namespace}
    assert manifests[0]["kind"] == "Namespace"


def test_no_custom_resource_outside_its_overlay():
    """Plain Kubernetes kinds only outside overlays/prometheus-operator: an apply of any other
    overlay succeeds on a cluster without the Prometheus Operator's CRDs."""
    builtin = {"Namespace", "Secret", "Service", "Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler"}
    for overlay in OVERLAYS:
        kinds = {d["kind"] for d in render(overlay)}
        if overlay.name == "prometheus-operator":
            assert kinds - builtin == {"ServiceMonitor", "PodMonitor"}
        else:
            assert kinds <= builtin, (overlay.name, kinds - builtin)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_node_command_ports_probes_and_drain(manifests, kind):
    deployment = _by(manifests, "Deployment", f"pdserve-{kind}")
    container = _containers(deployment)[0]
    args, _ = _parse(container)
    assert args.command == kind and args.host == "0.0.0.0" and args.advertise_host == "10.0.0.9"
    assert args.cluster_secret and args.log_format == "json"
    # --cpus is a list of host cores, unknown to a pod: the node's threads follow its CPU limit.
    assert args.cpus is None
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {name: getattr(args, flag[2:].replace("-", "_")) for flag, name in NODE_FLAG_PORTS.items()}
    # The probes and the scrape: on the health port, paths the node's HealthServer answers (200/503, not 404).
    node = type("Node", (), {"last_progress_at": time.monotonic(), "is_serving": True, "is_draining": False})()
    server = HealthServer("127.0.0.1", 0, node, render_metrics=lambda: b"")
    server.start()
    try:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert ports[get["port"]] == args.health_port, probe
            status = httpx.get(f"http://127.0.0.1:{server.port}{get['path']}", timeout=5).status_code
            assert status == 200, (probe, get["path"], status)
        assert httpx.get(f"http://127.0.0.1:{server.port}{METRICS_PATH}", timeout=5).status_code == 200
    finally:
        server.close()
    # The headless Service's ports name the container's; the drain waits inside the grace period.
    service = _by(manifests, "Service", f"pdserve-{kind}")
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    assert "kill -TERM 1" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > args.drain_timeout_s


def test_proxy_command_ports_probes_and_discovery(manifests, tiny_model_dir):
    deployment = _by(manifests, "Deployment", "pdserve-proxy")
    container = _containers(deployment)[0]
    args, _ = _parse(container)
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
    assert client.get(METRICS_PATH).status_code == 200
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


# --- scraping: which processes a Prometheus reads, by annotations or by the Operator's monitors ---

METRICS_PATH = "/metrics"
OPERATOR_OVERLAY = REPO / "deploy" / "k8s" / "overlays" / "prometheus-operator"


def matches(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions) selects labels."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, values = expression["key"], expression.get("values", [])
        found = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
                 "Exists": key in labels, "DoesNotExist": key not in labels}[expression["operator"]]
        if not found:
            return False
    return True


def _container_port(container: dict, port) -> int | None:
    """A container port's number, named or numbered (None: the container has no such port)."""
    for declared in container.get("ports", []):
        if port in (declared.get("name"), declared["containerPort"]):
            return declared["containerPort"]
    return None


def scrape_targets(manifests: list[dict], by: str) -> list[tuple[dict, int, str]]:
    """(container, port, path) of every pod container a Prometheus scrapes: by="annotations" for
    one that follows the pods' prometheus.io annotations (the kubernetes-pods job of Prometheus'
    example configuration), by="operator" for the Prometheus Operator (PodMonitors, and
    ServiceMonitors through their Services), each monitor in its own namespace."""
    deployments = [d for d in manifests if d["kind"] == "Deployment"]
    targets = []
    if by == "annotations":
        for deployment in deployments:
            annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
            if annotations.get("prometheus.io/scrape") == "true":
                port = int(annotations["prometheus.io/port"])
                path = annotations.get("prometheus.io/path", METRICS_PATH)
                targets += [(c, port, path) for c in _containers(deployment) if _container_port(c, port)]
        return targets
    assert by == "operator", by
    for monitor in (d for d in manifests if d["kind"] in ("PodMonitor", "ServiceMonitor")):
        namespace = monitor["metadata"]["namespace"]
        local = [d for d in deployments if d["metadata"]["namespace"] == namespace]
        for endpoint in monitor["spec"].get("podMetricsEndpoints", monitor["spec"].get("endpoints", [])):
            path = endpoint.get("path", METRICS_PATH)
            if monitor["kind"] == "PodMonitor":
                pods = [(d, endpoint["port"]) for d in local
                        if matches(monitor["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])]
            else:
                pods = [(d, port["targetPort"]) for service in manifests if service["kind"] == "Service"
                        and service["metadata"]["namespace"] == namespace
                        and matches(monitor["spec"]["selector"], service["metadata"].get("labels", {}))
                        for port in service["spec"]["ports"] if port.get("name") == endpoint["port"]
                        for d in local
                        if matches({"matchLabels": service["spec"]["selector"]},
                                   d["spec"]["template"]["metadata"]["labels"])]
            for deployment, port in pods:
                targets += [(c, _container_port(c, port), path) for c in _containers(deployment)
                            if _container_port(c, port)]
    return targets


def scraped_roles(manifests: list[dict], by: str) -> set[str]:
    """The roles (proxy, prefill, decode) whose /metrics a Prometheus scrapes, by="annotations" or
    "operator": a target on the proxy's --port or a node's --health-port at /metrics."""
    roles = set()
    for container, port, path in scrape_targets(manifests, by):
        args, _ = _parse(container)
        metrics_port = args.port if args.command == "proxy" else args.health_port
        if (port, path) == (metrics_port, METRICS_PATH):
            roles.add(args.command)
    return roles


@pytest.mark.parametrize(("overlay", "by"), [(OVERLAY, "annotations"), (OPERATOR_OVERLAY, "operator")],
                         ids=["annotations", "operator"])
def test_the_proxy_and_every_node_pool_are_scraped(overlay, by):
    """Both ways of scraping reach every process's /metrics: the proxy's on its HTTP port and
    each node's on its health port (most of the dashboard reads the nodes' own series)."""
    manifests = render(overlay)
    assert scraped_roles(manifests, by) == {"proxy", "prefill", "decode"}
    # Guards the check: the nodes unscraped (the old manifests: only the proxy's ServiceMonitor).
    for deployment in (d for d in manifests if d["kind"] == "Deployment" and d["metadata"]["name"] != "pdserve-proxy"):
        deployment["spec"]["template"]["metadata"].pop("annotations", None)
    without_nodes = [d for d in manifests if d["kind"] != "PodMonitor"]
    assert scraped_roles(without_nodes, by) == {"proxy"}


# --- drains, placement, privileges ---

def allowed_disruptions(budget: dict, num_pods: int) -> int:
    """The evictions a PodDisruptionBudget allows over num_pods healthy pods, as the disruption
    controller counts them (percentages of the pods, rounded up)."""
    def count(value) -> int:
        return math.ceil(num_pods * int(value[:-1]) / 100) if isinstance(value, str) else value
    spec = budget["spec"]
    if "maxUnavailable" in spec:
        return max(0, count(spec["maxUnavailable"]))
    return max(0, num_pods - count(spec.get("minAvailable", 0)))


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda path: path.name)
def test_every_budget_lets_a_drain_evict_one_pod_even_of_a_lone_replica(overlay):
    """`kubectl drain` proceeds: each Deployment has one PodDisruptionBudget, and it allows an
    eviction at the replicas the Deployment runs and at one replica (a proxy of one)."""
    manifests = render(overlay)
    budgets = [d for d in manifests if d["kind"] == "PodDisruptionBudget"]
    for deployment in (d for d in manifests if d["kind"] == "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        [budget] = [b for b in budgets if matches(b["spec"]["selector"], labels)]
        for num_pods in {deployment["spec"].get("replicas", 1), 1}:
            assert allowed_disruptions(budget, num_pods) >= 1, (deployment["metadata"]["name"], num_pods)
    # Guards the count: the old proxy budget (minAvailable: 1 beside one replica) blocks drains.
    assert allowed_disruptions({"spec": {"minAvailable": 1}}, 1) == 0


def _image_user() -> int:
    """The UID the Dockerfile creates and runs as."""
    text = (REPO / "Dockerfile").read_text()
    [created] = re.findall(r"useradd --uid (\d+)", text)
    [user] = re.findall(r"^USER (\S+)$", text, flags=re.M)
    assert user == created, (user, created)
    return int(created)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda path: path.name)
def test_every_pod_runs_as_the_image_user_read_only_unprivileged_and_spread(overlay):
    """Every pod: the image's non-root user, the runtime's seccomp profile, pods of a Deployment
    spread over hosts; every container: no privilege escalation, no capabilities, a read-only
    root filesystem with the places pdserve writes (/tmp, HOME, the *_CACHE_DIR it is given) on
    emptyDir volumes."""
    for deployment in (d for d in render(overlay) if d["kind"] == "Deployment"):
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] == _image_user(), name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        [spread] = [c for c in pod["topologySpreadConstraints"] if c["topologyKey"] == "kubernetes.io/hostname"]
        assert matches(spread["labelSelector"], deployment["spec"]["template"]["metadata"]["labels"]), name
        scratch = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True, name
            assert context["capabilities"]["drop"] == ["ALL"] and not context["capabilities"].get("add"), name
            writable = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in scratch]
            env = {v["name"]: v.get("value") for v in container["env"]}
            places = ["/tmp", env["HOME"]] + [env[v] for v in env if v.endswith("_CACHE_DIR")]
            for place in places:
                assert any(Path(place).is_relative_to(mount) for mount in writable), (name, place)
    [proxy] = _containers(_by(render(overlay), "Deployment", "pdserve-proxy"))
    assert "PDSERVE_CACHE_DIR" in {v["name"] for v in proxy["env"]}  # the proxy's tokenizer cache


GPU_OVERLAY = REPO / "deploy" / "k8s" / "overlays" / "gpu"


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_the_gpu_overlay_gives_each_node_pod_one_gpu(kind):
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
    args, _ = _parse(container)
    assert args.device == "cuda"
    names = {variable["name"] for variable in container["env"]}
    assert names >= {"PDSERVE_ADVERTISE_HOST", "PDSERVE_CLUSTER_SECRET", "PDSERVE_DEVICE"}
    [proxy] = _containers(_by(manifests, "Deployment", "pdserve-proxy"))
    assert "nvidia.com/gpu" not in str(proxy.get("resources"))


TP_OVERLAY = REPO / "deploy" / "k8s" / "overlays" / "cpu-tp"


def test_the_split_model_overlay_gives_prefill_pods_two_ranks_their_cores_and_shared_memory():
    """deploy/k8s/overlays/cpu-tp: prefill pods of TP=2 (their command line parses so) with two
    cores and a memory-backed /dev/shm for the worker ranks' caches, beside decode pods of one rank."""
    manifests = render(TP_OVERLAY)
    if shutil.which("kubectl"):
        assert sorted(manifests, key=_key) == sorted(resolve(TP_OVERLAY), key=_key)
    pod = _by(manifests, "Deployment", "pdserve-prefill")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args, _ = _parse(container)
    assert args.tensor_parallel_size == 2
    assert container["resources"]["limits"]["cpu"] == "2"
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    [decode] = _containers(_by(manifests, "Deployment", "pdserve-decode"))
    assert _parse(decode)[0].tensor_parallel_size == 1


GPU_TP_OVERLAY = REPO / "deploy" / "k8s" / "overlays" / "gpu-tp"


@pytest.mark.parametrize(("kind", "size"), [("prefill", 2), ("decode", 4)])
def test_the_split_gpu_overlay_gives_each_pod_a_gpu_per_rank_and_shared_memory(kind, size):
    """deploy/k8s/overlays/gpu-tp: prefill pods of TP=2 and decode pods of TP=4 on GPUs (their
    command lines parse so), each asking for exactly as many GPUs as it has ranks, with a
    memory-backed /dev/shm for NCCL."""
    manifests = render(GPU_TP_OVERLAY)
    if shutil.which("kubectl"):
        assert sorted(manifests, key=_key) == sorted(resolve(GPU_TP_OVERLAY), key=_key)
    pod = _by(manifests, "Deployment", f"pdserve-{kind}")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args, _ = _parse(container)
    assert (args.tensor_parallel_size, args.device) == (size, "cuda")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"][
        "nvidia.com/gpu"] == str(size)
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


AUTOSCALING_OVERLAY = REPO / "deploy" / "k8s" / "overlays" / "autoscaling"


def test_the_autoscaling_overlay_sizes_each_node_pool_by_a_pods_metric():
    """deploy/k8s/overlays/autoscaling: one autoscaling/v2 HorizontalPodAutoscaler per node pool on
    a per-pod metric (the series behind each: tests/deploy/test_grafana.py), whose Deployment
    states no replicas (an apply would reset the autoscaler's count), at least two pods."""
    manifests = render(AUTOSCALING_OVERLAY)
    scalers = {d["spec"]["scaleTargetRef"]["name"]: d for d in manifests if d["kind"] == "HorizontalPodAutoscaler"}
    assert set(scalers) == {"pdserve-prefill", "pdserve-decode"}
    for name, scaler in scalers.items():
        assert scaler["apiVersion"] == "autoscaling/v2"
        assert scaler["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        assert "replicas" not in _by(manifests, "Deployment", name)["spec"]
        assert 2 <= scaler["spec"]["minReplicas"] < scaler["spec"]["maxReplicas"]
        assert [m["type"] for m in scaler["spec"]["metrics"]] == ["Pods"]
    assert _by(manifests, "Deployment", "pdserve-proxy")["spec"]["replicas"] == 1


def autoscaling_series() -> dict[str, str]:
    """{Deployment name: the series its autoscaler reads}: the custom metrics API's name, with the
    adapter rule hpa.yaml gives undone (vllm_x is the node's vllm:x)."""
    scalers = [d for d in render(AUTOSCALING_OVERLAY) if d["kind"] == "HorizontalPodAutoscaler"]
    return {s["spec"]["scaleTargetRef"]["name"]:
            re.sub(r"^vllm_", "vllm:", s["spec"]["metrics"][0]["pods"]["metric"]["name"]) for s in scalers}
