"""Bind vs advertise: a side channel bound to every interface tells peers the address they can
dial (--advertise-host); a node that binds 0.0.0.0 without one is refused with the reason. The
multi-host e2e test (tests/e2e/test_multihost.py) runs nodes so across network namespaces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kv_transfer.config import TransferConfig
from kv_transfer.messages import Ack
from kv_transfer.nixl_connector import interface_of
from kv_transfer.side_channel import SideChannelServer, request

REPO = Path(__file__).resolve().parents[2]
SECRET = "advertise-test-secret-0123456789"


def test_a_side_channel_on_every_interface_advertises_the_address_given():
    server = SideChannelServer("0.0.0.0", 0, lambda message: Ack(error="seen"), advertise_host="127.0.0.1")
    try:
        assert server.address == f"127.0.0.1:{server.port}"
        # Peers dial the advertised address and get answers there.
        assert request(server.address, Ack(), timeout_s=5) == Ack(error="seen")
    finally:
        server.close()
    plain = SideChannelServer("127.0.0.1", 0, lambda message: None)
    try:
        assert plain.address == f"127.0.0.1:{plain.port}"  # default: the bind address
    finally:
        plain.close()


def test_transfer_config_public_host():
    assert TransferConfig().public_host == "127.0.0.1"
    bound = TransferConfig(backend="fake", host="0.0.0.0", advertise_host="10.1.2.3")
    assert bound.public_host == "10.1.2.3"
    with pytest.raises(ValueError, match="advertise_host"):
        TransferConfig(backend="fake", advertise_host="0.0.0.0")


def test_ucx_is_told_the_advertised_interface():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.9") is None  # not on this machine (behind NAT, say): UCX left alone


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_a_node_binding_every_interface_needs_an_advertise_host(kind, tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", kind, "--model", str(tiny_model_dir),
                           "--host", "0.0.0.0", "--cluster-secret", SECRET], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 2 and "--advertise-host" in done.stderr, done.stderr[-2000:]

