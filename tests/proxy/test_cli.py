"""`pdserve proxy` as a real process: arguments, serving in front of a fake node, clean stop."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from engine.protocol import Role
from pdserve.ports import free_port, wait_http_ok
from proxy.config import ProxyConfig
from proxy.main import add_arguments, config_from_args
from tests.proxy.fake_node import FakeNode, FakeNodeConfig

REPO = Path(__file__).resolve().parents[2]


def test_arguments_become_a_proxy_config(model_dir):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(model_dir), "--prefill", "127.0.0.1:1,127.0.0.1:2", "--decode",
                              "127.0.0.1:3", "--port", "9", "--api-key", "k", "--max-model-len", "64"])
    config = config_from_args(args)
    assert config.prefill_addresses == ("127.0.0.1:1", "127.0.0.1:2") and config.decode_addresses == ("127.0.0.1:3",)
    assert (config.port, config.api_key, config.max_model_len, config.served_model_name) == (9, "k", 64, model_dir.name)


def test_unset_arguments_take_the_proxy_config_defaults(model_dir):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--model", str(model_dir), "--decode", "127.0.0.1:3"]))
    assert config == ProxyConfig(model_dir=str(model_dir), served_model_name=model_dir.name,
                                 decode_addresses=("127.0.0.1:3",))


def test_chat_template_arguments_become_config_fields(model_dir, tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(model_dir), "--decode", "127.0.0.1:3", "--chat-template",
                              str(tmp_path / "t.jinja"), "--chat-template-timeout-s", "2.5",
                              "--trust-request-chat-template"])
    config = config_from_args(args)
    assert (config.chat_template_path, config.chat_template_timeout_s, config.trust_request_chat_template) == (
        str(tmp_path / "t.jinja"), 2.5, True)


def test_negative_local_prefill_wait_turns_the_policy_off(model_dir):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(model_dir), "--decode", "127.0.0.1:3", "--local-prefill-min-wait-s", "-1"])
    assert config_from_args(args).local_prefill_min_wait_s is None


def test_bad_address_exits_with_a_message(model_dir):
    result = subprocess.run([sys.executable, "-m", "pdserve.cli", "proxy", "--model", str(model_dir), "--decode",
                             "nowhere"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "HOST:PORT" in result.stderr


def test_pdserve_proxy_serves_and_stops_on_sigterm(model_dir, vocab_size):
    node = FakeNode(FakeNodeConfig(role=Role.DECODE, vocab_size=vocab_size)).start()
    port = free_port("127.0.0.1")
    process = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "proxy", "--model", str(model_dir), "--decode",
                                node.address, "--port", str(port), "--served-model-name", "m", "--log-level",
                                "warning"], cwd=REPO, start_new_session=True)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=30)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=10)
        assert client.completions.create(model="m", prompt="hello", max_tokens=3).usage.completion_tokens == 3
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        node.stop()


def test_a_published_proxy_needs_a_secret_only_for_nodes_beyond_loopback(model_dir):
    """A container publishes the proxy's HTTP port (0.0.0.0) with its nodes on its own loopback:
    no cluster secret needed; a node beyond this machine needs one."""
    published = ProxyConfig(model_dir=str(model_dir), served_model_name=model_dir.name, host="0.0.0.0",
                            decode_addresses=("127.0.0.1:3",))
    assert published.host == "0.0.0.0"
    with pytest.raises(ValueError, match="node 10.0.0.1:7000 is not on loopback: set a cluster secret"):
        ProxyConfig(model_dir=str(model_dir), served_model_name=model_dir.name, host="127.0.0.1",
                    decode_addresses=("10.0.0.1:7000",))
