"""The Grafana dashboard (deploy/grafana/pdserve.json) queries only metrics that pdserve exports:
every panel's PromQL is parsed (promql-parser, Prometheus' grammar) into its metric selectors,
and each metric name, and each label its selectors match on, must be in what a real proxy and
real prefill and decode node processes serve on /metrics after some traffic. Every panel is fed
by a series of a process the rendered Kubernetes manifests scrape, and the autoscaling example
reads a series its node pool's pods export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import ModelConfig
from pdserve.launcher import wait_healthy
from pdserve.ports import free_port
from tests.deploy.test_manifests import (
    AUTOSCALING_OVERLAY,
    OPERATOR_OVERLAY,
    OVERLAY,
    autoscaling_series,
    render,
    scraped_roles,
)
from tests.e2e.conftest import KV_PATH_ONLY, start_nodes

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve.json"
# Sample names each metric type adds to its family's name in the exposition format.
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",)}
# Grafana's built-in interval variables, and a stand-in for the dashboard's own: only so the
# text parses as PromQL (a variable inside a quoted label value needs no stand-in).
_INTERVALS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}


def add_exported(text: str, metrics: dict[str, set[str]], bucket_bounds: dict[str, set[str]]) -> None:
    """Add every sample name a /metrics body has or declares (a family with no sample yet, such as
    a labelled counter never incremented, counts by its TYPE line) to metrics, with the labels
    seen on it, and each histogram's bucket bounds (le values) to bucket_bounds."""
    for family in text_string_to_metric_families(text):
        for suffix in _SUFFIXES.get(family.type, ("",)):
            metrics.setdefault(family.name + suffix, set())
        for sample in family.samples:
            metrics.setdefault(sample.name, set()).update(sample.labels)
            if "le" in sample.labels:
                bucket_bounds.setdefault(family.name, set()).add(sample.labels["le"])


def grafana_to_promql(expr: str) -> str:
    """expr with Grafana's variables ($name, ${name}, ${name:format}) replaced by text that parses."""
    return re.sub(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))",
                  lambda m: _INTERVALS.get(m.group(1) or m.group(2), "var"), expr)


def selectors(node) -> list:
    """The vector selectors of a parsed PromQL expression, depth first."""
    if isinstance(node, promql_parser.VectorSelector):
        return [node]
    found = []
    children = list(getattr(node, "args", None) or [])
    children += [getattr(node, name, None) for name in ("expr", "param", "lhs", "rhs", "vector_selector")]
    for child in children:
        if isinstance(child, promql_parser.Expr):
            found += selectors(child)
    return found


def panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' nested panels included (rows themselves hold no query)."""
    found = []
    for panel in dashboard["panels"]:
        found += panels(panel) if panel.get("panels") else []
        if panel["type"] != "row":
            found.append(panel)
    return found


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    found = [(f"panel {p['title']!r} target {t['refId']}", t["expr"]) for p in panels(dashboard)
             for t in p["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]["query"])
            assert match, f"variable {variable['name']}: not label_values(selector, label)"
            found.append((f"variable {variable['name']}", match.group(1)))
    return found


def merged(exports) -> dict[str, set[str]]:
    """Several processes' exports as one: each sample name with every label seen on it."""
    together: dict[str, set[str]] = {}
    for exported in exports:
        for name, labels in exported.items():
            together.setdefault(name, set()).update(labels)
    return together


def unfed_panels(dashboard: dict, exported: dict[str, set[str]]) -> list[str]:
    """Titles of the panels of which no query names a series in exported with the labels it
    matches on (a family declared with no sample yet counts by its name): panels that stay empty."""
    unfed = []
    for panel in panels(dashboard):
        found = [s for t in panel["targets"] for s in selectors(promql_parser.parse(grafana_to_promql(t["expr"])))]
        if not any(s.name in exported and (not exported[s.name] or
                                           {m.name for m in s.matchers.matchers} - {"le"} <= exported[s.name])
                   for s in found):
            unfed.append(panel["title"])
    return unfed


def problems_of(dashboard: dict, exported: dict[str, set[str]]) -> list[str]:
    """What in the dashboard's queries names a metric, or a label of a metric, not exported."""
    problems = []
    for where, expr in queries(dashboard):
        try:
            found = selectors(promql_parser.parse(grafana_to_promql(expr)))
        except ValueError as exc:
            problems.append(f"{where}: does not parse: {exc}: {expr}")
            continue
        if not found:
            problems.append(f"{where}: names no metric: {expr}")
        for selector in found:
            if selector.name not in exported:
                problems.append(f"{where}: {selector.name!r} is not exported")
                continue
            labels = {m.name for m in selector.matchers.matchers} - {"le"}
            if exported[selector.name] and labels - exported[selector.name]:
                problems.append(f"{where}: {selector.name} has no label {sorted(labels - exported[selector.name])}")
    return problems


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exported(scraped) -> dict[str, set[str]]:
    return merged(scraped[0].values())


@pytest.fixture(scope="module")
def scraped(tiny_model_dir, tmp_path_factory) -> tuple[dict[str, dict[str, set[str]]], dict[str, set[str]]]:
    """What a proxy, a prefill node and a decode node (real processes, NIXL) export after a few
    requests (so labelled series exist too): per process kind (proxy, prefill, decode) the sample
    names with their label names, and all histograms' bucket bounds."""
    ports = [free_port(), free_port()]
    deployment = start_nodes(tiny_model_dir, tmp_path_factory.mktemp("grafana-logs"),
                             [["--health-port", str(ports[0])]], [["--health-port", str(ports[1])]],
                             proxy_args=KV_PATH_ONLY)
    try:
        wait_healthy(deployment, 120)
        model = ModelConfig.from_pretrained(tiny_model_dir).name
        for max_tokens in (4, 8):
            response = httpx.post(deployment.base_url + "/v1/completions", timeout=60, json={
                "model": model, "prompt": "count to ten", "max_tokens": max_tokens, "stream": True,
                "temperature": 0})
            assert response.status_code == 200, response.text
        by_kind: dict[str, dict[str, set[str]]] = {}
        bucket_bounds: dict[str, set[str]] = {}
        urls = {"proxy": deployment.base_url, "prefill": f"http://127.0.0.1:{ports[0]}",
                "decode": f"http://127.0.0.1:{ports[1]}"}
        for kind, url in urls.items():
            response = httpx.get(url + "/metrics", timeout=10)
            assert response.status_code == 200, url
            add_exported(response.text, by_kind.setdefault(kind, {}), bucket_bounds)
        yield by_kind, bucket_bounds
    finally:
        deployment.stop()


def test_every_dashboard_query_names_only_exported_metrics_and_labels(dashboard, exported):
    assert len(panels(dashboard)) >= 25
    assert all(panel["targets"] for panel in panels(dashboard))
    assert problems_of(dashboard, exported) == []


def test_the_check_catches_a_misspelled_metric_or_label(dashboard, exported):
    """Guards the check itself: a one-letter typo in a metric or a label is reported."""
    broken = json.loads(json.dumps(dashboard))
    target = panels(broken)[0]["targets"][0]
    target["expr"] = target["expr"].replace("pdserve_requests_total", "pdserve_request_total")
    node_target = next(t for p in panels(broken) for t in p["targets"] if "vllm:kv_cache_usage_perc" in t["expr"])
    node_target["expr"] = node_target["expr"].replace("engine=~", "engin=~")
    problems = problems_of(broken, exported)
    assert len(problems) == 2, problems
    assert "'pdserve_request_total' is not exported" in problems[0] and "['engin']" in problems[1]


def test_variables_cover_datasource_model_and_slo_buckets(dashboard, scraped):
    bucket_bounds = scraped[1]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "model_name" in variables["model_name"]["query"]["query"]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels(dashboard))
    # The goodput panels read one histogram bucket: every SLO offered must be a bucket bound.
    for name, metric in (("slo_ttft", "pdserve_time_to_first_token_seconds"),
                         ("slo_tpot", "pdserve_inter_token_latency_seconds")):
        offered = {option["value"] for option in variables[name]["options"]}
        assert variables[name]["current"]["value"] in offered
        assert offered <= bucket_bounds[metric], (name, sorted(bucket_bounds[metric]))
        assert any(f'le="${name}"' in t["expr"] and metric in t["expr"] for p in panels(dashboard)
                   for t in p["targets"]), name


@pytest.mark.parametrize(("overlay", "by"), [(OVERLAY, "annotations"), (OPERATOR_OVERLAY, "operator")],
                         ids=["annotations", "operator"])
def test_every_panel_is_fed_by_a_process_the_manifests_scrape(dashboard, scraped, overlay, by):
    """Each panel names a series that a process scraped by the rendered manifests exports: the
    pods' prometheus.io annotations (deploy/k8s/overlays/cpu) or the Operator's monitors
    (overlays/prometheus-operator) reach the proxy and every node pool."""
    roles = scraped_roles(render(overlay), by)
    assert unfed_panels(dashboard, merged(scraped[0][role] for role in roles)) == []


def test_the_feed_check_finds_the_panels_a_missing_scrape_leaves_empty(dashboard, scraped):
    """Guards the check: the proxy alone (the manifests once scraped nothing else) leaves the
    panels of the nodes' own pdserve_node_* series empty, the nodes alone the proxy's panels."""
    by_kind = scraped[0]
    unfed = unfed_panels(dashboard, by_kind["proxy"])
    assert {"Queued prompt tokens, draining", "Engine step time p50 / p99", "KV pull bandwidth"} <= set(unfed)
    assert "Requests by HTTP status" not in unfed
    unfed = unfed_panels(dashboard, merged([by_kind["prefill"], by_kind["decode"]]))
    assert {"Requests by HTTP status", "TTFT p50 / p99 (proxy)"} <= set(unfed) and "KV cache usage" not in unfed


def test_each_autoscaler_reads_a_series_its_pools_pods_export(scraped):
    """deploy/k8s/overlays/autoscaling: each node pool's HorizontalPodAutoscaler reads a series the
    pool's own pods serve (not the proxy's copy of it), and those pods are scraped."""
    scaled = autoscaling_series()
    assert set(scaled) == {"pdserve-prefill", "pdserve-decode"}
    for deployment, series in scaled.items():
        kind = deployment.removeprefix("pdserve-")
        assert {"model_name", "engine"} <= scraped[0][kind].get(series, set()), (deployment, series)
    assert scraped_roles(render(AUTOSCALING_OVERLAY), "annotations") >= {"prefill", "decode"}
