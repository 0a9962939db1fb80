"""The proxy process's own drain on SIGTERM (proxy.drain), with a real `pdserve proxy` process in
front of a fake decode node: new requests get 503 and /ready 503 at once, an open stream that
finishes within the drain timeout completes normally, one that does not ends with an error event
and [DONE] (and is aborted on its node), then the process exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from engine import protocol
from engine.protocol import Role
from pdserve.ports import free_port, wait_http_ok
from tests.proxy.conftest import MODEL_NAME
from tests.proxy.fake_node import FakeNode, FakeNodeConfig

DRAIN_TIMEOUT_S = 3.0


@pytest.fixture
def proxy_process(model_dir, vocab_size, tmp_path):
    """(base_url, the proxy's Popen, the fake decode node); both stopped at teardown."""
    node = FakeNode(FakeNodeConfig(role=Role.DECODE, vocab_size=vocab_size, step_s=0.05, max_model_len=4096)).start()
    port = free_port()
    log = (tmp_path / "proxy.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "proxy", "--model", str(model_dir),
                             "--served-model-name", MODEL_NAME, "--port", str(port), "--decode", node.address,
                             "--max-model-len", "4096", "--drain-timeout-s", str(DRAIN_TIMEOUT_S)],
                            stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(base_url + "/ready", timeout_s=60, check=lambda: _check_alive(proc))
        yield base_url, proc, node
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        log.close()
        node.stop()


def _check_alive(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        raise RuntimeError(f"the proxy exited with {proc.returncode}")


class _Stream:
    """One streamed completion on a thread: its SSE data lines."""

    def __init__(self, base_url: str, max_tokens: int) -> None:
        self.events: list[str] = []
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(base_url, body), daemon=True)
        self._thread.start()

    def _run(self, base_url: str, body: dict) -> None:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            self.events.extend(line[len("data: "):] for line in response.iter_lines() if line.startswith("data: "))

    def wait_started(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.events and self._thread.is_alive():
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.01)

    def join(self, timeout_s: float = 60.0) -> list[str]:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream did not end"
        return self.events


def test_sigterm_refuses_new_requests_finishes_short_streams_and_ends_long_ones(proxy_process):
    base_url, proc, node = proxy_process
    # NOTE: 0.05 s a token: the short one needs ~1 s of the 3 s drain, the long one ~100 s.
    short, long = _Stream(base_url, max_tokens=20), _Stream(base_url, max_tokens=2000)
    short.wait_started()
    long.wait_started()
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while httpx.get(base_url + "/ready", timeout=5).status_code != 503:  # the drain starts on the loop
        assert time.monotonic() < deadline, "/ready still 200 after SIGTERM"
        time.sleep(0.02)
    refused = httpx.post(base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
                         timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"

    short_events = short.join()
    assert short_events[-1] == "[DONE]" and not any("error" in json.loads(e) for e in short_events[:-1])
    assert sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in short_events[:-1]) >= 1
    long_events = long.join()
    assert long_events[-1] == "[DONE]"
    error = json.loads(long_events[-2])["error"]
    assert error["type"] == "server_error" and "shutting down" in error["message"], error
    assert proc.wait(timeout=30) == 0
    # The long one was aborted on its node, not left generating for nobody.
    assert node.wait_for(lambda: node.messages(protocol.Abort), timeout_s=5)
    assert node.num_running() == 0
