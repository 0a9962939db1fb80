"""proxy.node_metrics: the nodes' vllm:* families on the proxy's /metrics, merged by name (each
node's samples under its engine label), other families left out, a node that does not answer in
time left out of that scrape and counted."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import protocol
from proxy.node_metrics import NodeSeries


def _page(engine: str, running: int, tokens: int) -> str:
    labels = f'engine="{engine}",model_name="m",role="decode"'
    return (f"# HELP vllm:num_requests_running requests in the running batch\n"
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{labels}}} {running}\n"
            f"# HELP vllm:generation_tokens tokens generated here\n# TYPE vllm:generation_tokens counter\n"
            f"vllm:generation_tokens_total{{{labels}}} {tokens}\n"
            f"# HELP pdserve_node_kv_blocks_free free KV blocks\n# TYPE pdserve_node_kv_blocks_free gauge\n"
            f"pdserve_node_kv_blocks_free{{{labels}}} 7\n")


class _Server:
    def __init__(self, body: str, delay_s: float = 0.0) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the stdlib's name
                time.sleep(delay_s)
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclass
class _Node:
    address: str
    last_report: protocol.LoadReport | None


def _node(port: int, metrics_port: int) -> _Node:
    report = protocol.LoadReport(node_id="n", role=protocol.Role.DECODE, protocol_version=protocol.PROTOCOL_VERSION,
                                 model_name="m", max_model_len=64, block_size=16, num_running=0, num_waiting=0,
                                 num_queued_prompt_tokens=0, num_free_blocks=1, num_total_blocks=1,
                                 metrics_port=metrics_port)
    return _Node(f"127.0.0.1:{port}", report)


@pytest.fixture
def servers():
    made = [_Server(_page("decode0", 2, 40)), _Server(_page("decode1", 3, 50)), _Server(_page("slow", 1, 1), 3.0)]
    yield made
    for server in made:
        server.close()


def _samples(text: bytes) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels["engine"]): s.value for f in text_string_to_metric_families(text.decode())
            for s in f.samples}


def test_the_nodes_vllm_series_are_merged_and_a_slow_node_is_left_out(servers):
    nodes = [_node(7100, s.port) for s in servers] + [_node(7101, 0), _Node("127.0.0.1:7102", None)]
    scraper = NodeSeries(lambda: nodes, timeout_s=0.5)

    async def scrape():
        try:
            return await scraper.render()
        finally:
            await scraper.close()

    started = time.monotonic()
    page = asyncio.run(scrape())
    assert time.monotonic() - started < 2.5  # the slow node's 3 s is not waited for
    assert _samples(page) == {("vllm:num_requests_running", "decode0"): 2, ("vllm:num_requests_running", "decode1"): 3,
                              ("vllm:generation_tokens_total", "decode0"): 40,
                              ("vllm:generation_tokens_total", "decode1"): 50}
    assert page.count(b"# TYPE vllm:num_requests_running gauge") == 1  # one family, both nodes' samples
    assert scraper.num_failures == 1
    [family] = scraper.collect()
    assert family.name == "pdserve_node_metrics_scrape_failures" and family.samples[0].value == 1


def test_no_node_to_read_is_an_empty_page():
    assert asyncio.run(NodeSeries(lambda: ()).render()) == b""
