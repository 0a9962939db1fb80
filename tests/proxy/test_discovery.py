"""Nodes joining and leaving a running proxy (proxy.discovery, proxy.admin) with fake nodes:
the admin endpoint (token, add, remove, drain), the node file, DNS names re-resolved; a node
added gets requests, a removed one finishes what it holds and gets nothing new."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from engine import protocol
from engine.protocol import Role
from proxy import discovery as discovery_module
from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.discovery import read_nodes_file
from tests.proxy.conftest import MODEL_NAME
from tests.proxy.fake_node import FakeNode, FakeNodeConfig

TOKEN = "admin-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def fake_nodes(vocab_size):
    """make(**FakeNodeConfig fields) -> a started fake decode node; all stopped at teardown."""
    started = []

    def make(**fields) -> FakeNode:
        node = FakeNode(FakeNodeConfig(role=Role.DECODE, vocab_size=vocab_size, **fields)).start()
        started.append(node)
        return node

    yield make
    for node in started:
        node.stop()


def _listing(proxy) -> dict[str, dict]:
    response = httpx.get(proxy.base_url + "/admin/nodes", headers=AUTH, timeout=5)
    assert response.status_code == 200, response.text
    return {n["address"]: n for n in response.json()["nodes"]}


def _wait(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not met within {timeout_s} s"
        time.sleep(0.02)


def _complete(proxy, max_tokens: int = 4) -> str:
    result = proxy.client().completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=max_tokens,
                                               temperature=0)
    return result.choices[0].text


def _num_requests(node: FakeNode) -> int:
    return len(node.messages(protocol.DecodeRequest))


def test_admin_endpoint_wants_the_token(start_proxy):
    proxy = start_proxy(num_prefill=0, admin_token=TOKEN)
    url = proxy.base_url + "/admin/nodes"
    assert httpx.get(url, timeout=5).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=5).status_code == 401
    nodes = httpx.get(url, headers=AUTH, timeout=5).json()["nodes"]
    assert [(n["name"], n["kind"], n["sources"], n["state"]) for n in nodes] == [("decode0", "decode", ["static"],
                                                                                  "ready")]
    bad = httpx.post(url, headers=AUTH, json={"kind": "decode", "address": "no-port"}, timeout=5)
    assert bad.status_code == 400 and "HOST:PORT" in bad.json()["error"]["message"]
    remote = httpx.post(url, headers=AUTH, json={"kind": "decode", "address": "10.1.2.3:7000"}, timeout=5)
    assert remote.status_code == 400 and "cluster secret" in remote.json()["error"]["message"]
    assert httpx.delete(url + "/decode7", headers=AUTH, timeout=5).status_code == 404


def test_admin_routes_are_off_beyond_loopback_without_a_token(model_dir):
    config = ProxyConfig(model_dir=str(model_dir), served_model_name=MODEL_NAME, host="0.0.0.0",
                         decode_addresses=("10.0.0.1:7000",), cluster_secret="s" * 16)
    # NOTE: no lifespan (no `with`): nothing connects; the routes answer from the static list.
    assert TestClient(create_app(config)).get("/admin/nodes", headers=AUTH).status_code == 404
    with_token = ProxyConfig(**{**config.__dict__, "admin_token": TOKEN})
    assert TestClient(create_app(with_token)).get("/admin/nodes", headers=AUTH).status_code == 200


def test_added_node_gets_requests_and_removed_node_finishes_its_own_and_gets_no_new(start_proxy, fake_nodes):
    # NOTE: the first node has 5x the blocks: routing would prefer it, were it not leaving.
    proxy = start_proxy(num_prefill=0, admin_token=TOKEN, node={"step_s": 0.05, "num_total_blocks": 5000})
    first = proxy.decode[0]
    long_text: list[str] = []
    streaming = threading.Thread(target=lambda: long_text.append(_complete(proxy, max_tokens=40)))
    streaming.start()  # ~2 s of decode steps on the only node
    _wait(lambda: first.num_running() == 1, what="the long request running on the first node")

    second = fake_nodes(step_s=0.01)
    added = httpx.post(proxy.base_url + "/admin/nodes", headers=AUTH,
                       json={"kind": "decode", "address": second.address}, timeout=5)
    assert added.status_code == 201 and added.json()["sources"] == ["admin"], added.text
    _wait(lambda: _listing(proxy)[second.address]["state"] == "ready", what="the added node ready")

    removed = httpx.delete(proxy.base_url + f"/admin/nodes/{first.address}", headers=AUTH, timeout=5)
    assert removed.status_code == 202 and removed.json()["state"] == "retiring", removed.text
    sent_to_first = _num_requests(first)
    texts = [_complete(proxy) for _ in range(6)]
    assert all(texts) and _num_requests(second) == 6
    assert _num_requests(first) == sent_to_first  # nothing new for the node leaving
    streaming.join(timeout=30)
    assert long_text and long_text[0]  # its own request finished normally
    _wait(lambda: first.address not in _listing(proxy), what="the removed node gone once drained")
    assert _complete(proxy) and _num_requests(first) == sent_to_first


def test_admin_drain_asks_the_node_itself(start_proxy):
    proxy = start_proxy(num_prefill=0, num_decode=2, admin_token=TOKEN)
    target = proxy.decode[1]
    response = httpx.post(proxy.base_url + f"/admin/nodes/{target.address}/drain", headers=AUTH, timeout=5)
    assert response.status_code == 202 and response.json()["state"] == "draining", response.text
    assert target.wait_for(lambda: target.messages(protocol.Drain))
    before = _num_requests(target)
    for _ in range(4):
        _complete(proxy)
    assert _num_requests(target) == before


def test_nodes_file_is_reread_when_it_changes(start_proxy, fake_nodes, tmp_path):
    first, second = fake_nodes(), fake_nodes()
    nodes_file = tmp_path / "nodes.yaml"
    nodes_file.write_text(f"decode:\n  - {first.address}\n")
    proxy = start_proxy(num_prefill=0, num_decode=0, admin_token=TOKEN, nodes_file=str(nodes_file),
                        discovery_interval_s=0.2)
    _wait(lambda: _listing(proxy)[first.address]["state"] == "ready", what="the file's node ready")
    assert _complete(proxy) and _num_requests(first) == 1
    nodes_file.write_text(f'{{"decode": ["{second.address}"]}}')  # JSON is YAML too
    _wait(lambda: set(_listing(proxy)) == {second.address}, what="the file's new node only")
    _wait(lambda: _listing(proxy)[second.address]["state"] == "ready", what="the new node ready")
    assert _complete(proxy) and _num_requests(second) == 1 and _num_requests(first) == 1
    for broken in ("decode: [this is not", ""):  # a broken file, or one caught mid-rewrite (empty),
        nodes_file.write_text(broken)              # keeps the last good nodes
        time.sleep(0.6)
        assert set(_listing(proxy)) == {second.address}
    nodes_file.write_text("{}")  # an empty pool is said so
    _wait(lambda: set(_listing(proxy)) == set(), what="the file's nodes gone")


def test_dns_names_are_reresolved(start_proxy, fake_nodes, monkeypatch):
    first, second = fake_nodes(), fake_nodes()
    answers = {"decode.pool.test": {first.address}}

    async def fake_resolve(name: str) -> frozenset[str]:
        host, port = discovery_module.split_host_port(name)
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return frozenset(answers[host])

    monkeypatch.setattr(discovery_module, "resolve", fake_resolve)
    proxy = start_proxy(num_prefill=0, num_decode=0, admin_token=TOKEN, decode_dns=("decode.pool.test:7000",),
                        discovery_interval_s=0.2)
    assert _listing(proxy)[first.address]["sources"] == ["dns"]
    answers["decode.pool.test"] = {first.address, second.address}
    _wait(lambda: second.address in _listing(proxy), what="the second record added")
    del answers["decode.pool.test"]  # a failed lookup keeps the last answer
    time.sleep(0.6)
    assert set(_listing(proxy)) == {first.address, second.address}
    answers["decode.pool.test"] = {second.address}
    _wait(lambda: set(_listing(proxy)) == {second.address}, what="the vanished record removed")


def test_nodes_file_format_errors(tmp_path):
    path = tmp_path / "nodes.json"
    path.write_text("{}")
    assert read_nodes_file(str(path)) == {"prefill": frozenset(), "decode": frozenset()}
    path.write_text('{"prefill": ["10.0.0.1:7000"], "decode": ["10.0.0.2:7000", "h:7001"]}')
    assert read_nodes_file(str(path)) == {"prefill": frozenset({"10.0.0.1:7000"}),
                                          "decode": frozenset({"10.0.0.2:7000", "h:7001"})}
    for text, word in (("[1, 2]", "mapping"), ("colo: []", "mapping"), ("decode: [7000]", "list of HOST:PORT"),
                       ("decode: ['nohost']", "HOST:PORT"), ("decode: [", "YAML"),
                       ("", "empty"), ("# only a comment\n", "empty")):
        path.write_text(text)
        with pytest.raises(ValueError, match=word):
            read_nodes_file(str(path))


def test_a_proxy_needs_some_decode_source(model_dir):
    with pytest.raises(ValueError, match="--decode-dns"):
        ProxyConfig(model_dir=str(model_dir), served_model_name=MODEL_NAME)
    ProxyConfig(model_dir=str(model_dir), served_model_name=MODEL_NAME, decode_dns=("decode.ns.svc:7000",))
    with pytest.raises(ValueError, match="HOST:PORT"):
        ProxyConfig(model_dir=str(model_dir), served_model_name=MODEL_NAME, decode_dns=("decode.ns.svc",))
