"""The nodes' vllm:* series on the proxy's /metrics, so that one scrape of the proxy (where a vLLM
user points Prometheus) shows the cluster. Each node serves them on its health port, which its
load reports name (LoadReport.metrics_port); at each scrape of the proxy, the proxy reads every
node it knows at once, each within a deadline, and adds their vllm:* families, merged by name (each
node's samples keep its `engine` label: the node id). A node that does not answer in time is left
out of that scrape and counted in pdserve_node_metrics_scrape_failures."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

_PREFIX = "vllm:"
_SCRAPE_TIMEOUT_S = 2.0


class NodeSeries:
    """Reads the nodes' /metrics; render() gives the merged vllm:* families as exposition text."""

    def __init__(self, nodes: Callable[[], Iterable], timeout_s: float = _SCRAPE_TIMEOUT_S) -> None:
        self._nodes = nodes
        self._timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None
        self.num_failures = 0

    async def render(self) -> bytes:
        urls = [url for url in map(_metrics_url, self._nodes()) if url is not None]
        if not urls:
            return b""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout_s, trust_env=False)
        texts = await asyncio.gather(*(self._fetch(url) for url in urls))
        merged: dict[str, Metric] = {}
        for text in texts:
            for family in _families(text):
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(list(merged.values())))
        return generate_latest(registry)

    def collect(self) -> list[Metric]:
        """For the proxy's own registry: the failed reads."""
        return [CounterMetricFamily("pdserve_node_metrics_scrape_failures", "reads of a node's /metrics (for the "
                                    "vllm:* series here) that failed or ran past their deadline",
                                    value=self.num_failures)]

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def _fetch(self, url: str) -> str:
        try:
            response = await asyncio.wait_for(self._client.get(url), self._timeout_s)
            response.raise_for_status()
            return response.text
        except (TimeoutError, httpx.HTTPError, OSError) as exc:
            self.num_failures += 1
            logger.debug("reading %s: %s", url, exc)
            return ""


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def _metrics_url(node) -> str | None:
    report = node.last_report
    if report is None or not report.metrics_port:
        return None
    host = node.address.rsplit(":", 1)[0]
    return f"http://{host}:{report.metrics_port}/metrics"


def _families(text: str) -> list[Metric]:
    try:
        return [f for f in text_string_to_metric_families(text) if f.name.startswith(_PREFIX)]
    except ValueError as exc:  # a node's page we cannot parse: left out, not the proxy's page broken
        logger.debug("a node's /metrics did not parse: %s", exc)
        return []
