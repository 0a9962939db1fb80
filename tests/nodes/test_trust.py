"""Who may talk to a node: without a cluster secret every node listener stays on loopback (configs
and the CLI refuse anything else); with one, a node's control socket answers only peers holding
the secret (CURVE, checked by the ZAP handler), and the rest are counted as rejected."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import protocol
from kv_transfer.config import TransferConfig
from node.config import ServerConfig
from node.server import NodeServer
from proxy.config import ProxyConfig
from tests.conftest import dealer
from tests.nodes.conftest import DEFAULT_MAX_NUM_SEQS, make_engine

REPO = Path(__file__).resolve().parents[2]
SECRET = "node-test-cluster-secret"


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "example.com"])
def test_a_node_off_loopback_needs_a_cluster_secret(host):
    keys = protocol.curve_keys(SECRET)
    with pytest.raises(ValueError, match="cluster secret"):
        ServerConfig("n", host=host)
    with pytest.raises(ValueError, match="cluster secret"):
        TransferConfig(host=host)
    # The proxy's own HTTP port may face anything (a container publishes it; the API key guards it):
    # only nodes off loopback need the secret.
    assert ProxyConfig(model_dir="m", served_model_name="m", host=host, decode_addresses=("127.0.0.1:1",)).host == host
    with pytest.raises(ValueError, match="cluster secret"):
        ProxyConfig(model_dir="m", served_model_name="m", decode_addresses=(f"{host}:1",))
    assert ServerConfig("n", host=host, curve_keys=keys).curve_keys is keys
    assert TransferConfig(host=host, curve_keys=keys).host == host
    config = ProxyConfig(model_dir="m", served_model_name="m", host=host, decode_addresses=(f"{host}:1",),
                         cluster_secret=SECRET)
    assert SECRET not in repr(config) and "server_secret" not in repr(ServerConfig("n", curve_keys=keys))
    with pytest.raises(ValueError, match="at least 16"):
        ProxyConfig(model_dir="m", served_model_name="m", decode_addresses=("127.0.0.1:1",), cluster_secret="short")


def test_node_cli_refuses_a_public_host_without_a_secret_and_says_why(tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "prefill", "--model", str(tiny_model_dir),
                           "--host", "0.0.0.0"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2 and "cluster secret" in done.stderr and "0.0.0.0" in done.stderr


@pytest.fixture
def secret_node(tiny_model_dir, serve_node):
    engine = make_engine(tiny_model_dir, num_blocks=32, max_num_seqs=DEFAULT_MAX_NUM_SEQS)
    server = NodeServer(engine, ServerConfig("secret", curve_keys=protocol.curve_keys(SECRET)))
    return serve_node(server, connect=False).server


def _ask(address: str, keys: protocol.CurveKeys | None, request: protocol.ToNode, timeout_s: float) -> list:
    socket = dealer(address, keys)
    try:
        socket.send(protocol.encode(request))
        received, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if socket.poll(50):
                received.append(protocol.decode_from_node(socket.recv()))
                if isinstance(received[-1], protocol.TokenBatch) and received[-1].deltas[-1].finish_reason:
                    break
        return received
    finally:
        socket.close(linger=0)


def test_with_a_secret_only_its_holders_get_answers_from_a_node(secret_node):
    request = protocol.DecodeRequest("r", [5, 6, 7], protocol.SamplingOptions(max_tokens=3, temperature=0.0))
    outsiders = (None, protocol.curve_keys("another-secret-entirely"))
    for keys in outsiders:
        assert _ask(secret_node.address, keys, request, timeout_s=1.0) == []
    answers = _ask(secret_node.address, protocol.curve_keys(SECRET), request, timeout_s=10.0)
    tokens = [t for m in answers if isinstance(m, protocol.TokenBatch) for d in m.deltas for t in d.tokens]
    assert len(tokens) == 3  # the outsiders' requests never ran: the member's id "r" was free
    assert secret_node.control.rejects.counts.get("unauthenticated", 0) >= len(outsiders)
