"""Availability with real processes: nodes killed, stopped, restarted and drained under
concurrent greedy streams; every request completes with the uninterrupted run's output, and the
nodes' blocks and leases all come back."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from pdserve.launcher import wait_healthy
from pdserve.ports import wait_http_ok
from tests.e2e.conftest import KV_PATH_ONLY, NODE_ARGS, _start, node_load, start_nodes, wait_blocks_free
from tests.e2e.test_pipeline import hf, hf_greedy, random_prompts  # noqa: F401 - hf is a fixture

MAX_TOKENS = 96
PROMPTS = [f"request {i}: the quick brown fox jumps over the lazy dog " * (1 + i % 3) for i in range(6)]
LONG_PROMPTS = [f"prompt {i} " + "lorem ipsum dolor sit amet " * 60 for i in range(4)]
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.9, "seed": 1234}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    """2 prefill + 2 decode nodes and the proxy, shared by this module's tests (each test leaves
    every node running and healthy)."""
    deployment = _start(tiny_model_dir, tmp_path_factory.mktemp("availability-logs"), num_prefill=2, num_decode=2,
                        node_args=NODE_ARGS)
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(client):
    """Each prompt's greedy output from the cluster while nothing fails; ("seeded", prompt): its
    seeded sampled output."""
    greedy = {prompt: _complete(client, prompt) for prompt in PROMPTS + LONG_PROMPTS}
    return greedy | {("seeded", prompt): _complete(client, prompt, SEEDED) for prompt in PROMPTS[:2]}


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _complete(client: openai.OpenAI, prompt: str, sampling: dict = GREEDY) -> str:
    response = client.completions.create(model=_model(client), prompt=prompt, max_tokens=MAX_TOKENS,
                                         extra_body={"ignore_eos": True, **sampling})
    assert response.usage.completion_tokens == MAX_TOKENS
    return response.choices[0].text


class _Streams:
    """Streams of prompts (greedy unless told) on threads; counts the chunks each has received
    and checks each one's usage (exact, whatever happened meanwhile)."""

    def __init__(self, client: openai.OpenAI, prompts: list[str], sampling: dict = GREEDY) -> None:
        self.client, self.prompts, self.sampling = client, prompts, sampling
        self.num_chunks = [0] * len(prompts)
        self._pool = ThreadPoolExecutor(len(prompts))
        self._futures = [self._pool.submit(self._stream, i) for i in range(len(prompts))]

    def _stream(self, idx: int) -> str:
        stream = self.client.completions.create(model=_model(self.client), prompt=self.prompts[idx],
                                                max_tokens=MAX_TOKENS, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True, **self.sampling})
        text, usage = [], None
        for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                self.num_chunks[idx] += 1
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == MAX_TOKENS, usage
        return "".join(text)

    def wait_started(self, min_chunks: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while min(self.num_chunks) < min_chunks:
            assert time.monotonic() < deadline, f"streams did not start: {self.num_chunks}"
            time.sleep(0.01)

    def results(self, timeout_s: float = 120.0) -> list[str]:
        try:
            return [f.result(timeout=timeout_s) for f in self._futures]
        finally:
            self._pool.shutdown(wait=False)


def _restart(cluster, name: str) -> None:
    proc = cluster.cluster.process(name)
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    cluster.cluster.restart(name)
    wait_healthy(cluster, 120)


def _assert_no_leaks(cluster) -> None:
    for name, address in cluster.node_addresses.items():
        report = wait_blocks_free(address, timeout_s=20)
        assert report.num_free_blocks == report.num_total_blocks, f"{name}: blocks not freed: {report}"
        assert report.num_leases == 0 and report.num_running == 0, f"{name}: {report}"


def _wait_for(predicate, timeout_s: float, what) -> None:
    """what: the failure's message, or a function making it (then, with what it saw)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.02)


def test_killed_decode_node_mid_stream_migrates_every_stream_unchanged(cluster, client, reference):
    streams, seeded = _Streams(client, PROMPTS), _Streams(client, PROMPTS[:2], SEEDED)
    streams.wait_started(min_chunks=3)
    seeded.wait_started(min_chunks=3)
    cluster.cluster.process("decode0").kill()
    assert streams.results() == [reference[p] for p in PROMPTS]
    assert seeded.results() == [reference["seeded", p] for p in PROMPTS[:2]]
    _restart(cluster, "decode0")
    _assert_no_leaks(cluster)


def test_killed_prefill_node_mid_prefill_every_request_completes(cluster, client, reference):
    streams = _Streams(client, LONG_PROMPTS)
    time.sleep(0.05)  # NOTE: the requests reach the prefill nodes; no token is out yet (long prompts)
    cluster.cluster.process("prefill0").kill()
    assert streams.results() == [reference[p] for p in LONG_PROMPTS]
    _restart(cluster, "prefill0")
    _assert_no_leaks(cluster)


STOP_S = 6.0  # twice the proxy's heartbeat timeout (3 s): judged down, then back


def test_stopped_node_is_routed_around_then_back(cluster, client, reference):
    """SIGSTOP of a decode node for a fixed STOP_S: its streams move to the other node and new
    requests go there meanwhile; after SIGCONT it takes requests again."""
    proc = cluster.cluster.process("decode1")
    streams = _Streams(client, PROMPTS)
    streams.wait_started(min_chunks=2)
    proc.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        assert streams.results() == [reference[p] for p in PROMPTS]
        assert [_complete(client, p) for p in PROMPTS[:2]] == [reference[p] for p in PROMPTS[:2]]
        # NOTE: all served while decode1 was still stopped (SIGCONT comes only below): routed around.
        time.sleep(max(0.0, STOP_S - (time.monotonic() - stopped_at)))
    finally:
        proc.send_signal(signal.SIGCONT)
    wait_healthy(cluster, 30)
    address = cluster.node_addresses["decode1"]
    # Back: with both nodes idle, a burst spreads over both (most free blocks first), so decode1 runs some.
    deadline = time.monotonic() + 90
    while True:  # NOTE: bursts until one lands there (routing may first fill the other node)
        again, took = _Streams(client, PROMPTS), False
        while not took and not all(f.done() for f in again._futures):
            took = node_load(address).num_running > 0
        assert again.results() == [reference[p] for p in PROMPTS]
        if took:
            break
        assert time.monotonic() < deadline, "decode1 took no request after SIGCONT"
    _assert_no_leaks(cluster)


def test_node_restarted_on_its_port_within_a_second_hangs_no_request(cluster, client, reference):
    streams = _Streams(client, PROMPTS)
    streams.wait_started(min_chunks=2)
    proc = cluster.cluster.process("decode1")
    proc.kill()
    proc.wait(timeout=10)
    cluster.cluster.restart("decode1")
    assert streams.results(timeout_s=60) == [reference[p] for p in PROMPTS]
    wait_healthy(cluster, 120)
    _assert_no_leaks(cluster)


def test_sigterm_drains_a_prefill_node_without_losing_requests_or_leases(cluster, client, reference):
    prompts = LONG_PROMPTS + PROMPTS
    streams = _Streams(client, prompts)
    proc = cluster.cluster.process("prefill1")
    threading.Timer(0.05, proc.send_signal, (signal.SIGTERM,)).start()
    assert streams.results() == [reference[p] for p in prompts]
    assert proc.wait(timeout=30) == 0  # drained: exited on its own once its leases were pulled
    _restart(cluster, "prefill1")
    _assert_no_leaks(cluster)


def test_prefill_node_killed_while_its_kv_awaits_pulls_every_stream_completes(tiny_model_dir, tmp_path,
                                                                               hf):  # noqa: F811
    """The decode node runs one sequence at a time, so most requests wait there with their KV
    still on a prefill node (leased, renewed by the decode node, the read queued behind the
    running request): SIGKILL of that prefill node (whichever of the two holds leases then: the
    proxy may route every prompt to one) lands inside their KV transfer. Each such pull fails (the
    holder is gone) and falls back to a local prefill; every stream equals transformers' greedy
    output, and the survivors end with every block free."""
    # NOTE: short KV timeouts: a pull from the dead holder fails within them (with the defaults,
    # 5 s per handshake and 30 s per read, the queued pulls fail one after another for minutes).
    decode_args = ["--max-num-seqs", "1", "--handshake-timeout-s", "1", "--transfer-timeout-s", "3"]
    deployment = start_nodes(tiny_model_dir, tmp_path / "logs", [[], []], [decode_args], KV_PATH_ONLY)
    try:
        wait_http_ok(deployment.base_url + "/health", 120, lambda: _check_alive(deployment))
        _, tokenizer = hf
        prompts = random_prompts(6, [40, 70, 100], seed=1414)
        # NOTE: 96 tokens each keep the later requests' pulls queued long enough to be seen (and
        # killed under): with 32, the six were sometimes all done between two looks
        want = [tokenizer.decode(hf_greedy(hf, p, 96)[0], skip_special_tokens=True) for p in prompts]
        client = openai.OpenAI(base_url=deployment.base_url + "/v1", api_key="unused", max_retries=0, timeout=180)
        addresses = deployment.node_addresses
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(_stream_ids, client, p, 96) for p in prompts]
            holders = []

            def pulls_wait_on_a_holder() -> bool:
                if node_load(addresses["decode0"]).num_pending_pulls < 3:
                    return False
                holders[:] = [n for n in ("prefill0", "prefill1") if node_load(addresses[n]).num_leases >= 1]
                return bool(holders)

            _wait_for(pulls_wait_on_a_holder, 60, lambda: "no pulls waiting on a prefill node's leases: "
                      + ", ".join(f"{n} {node_load(a)}" for n, a in addresses.items()) + "\n" + deployment.logs())
            killed = holders[0]
            print(f"\nkilled {killed} (holding leases: {holders})")
            deployment.cluster.process(killed).kill()
            texts = [f.result(timeout=180) for f in futures]
        assert texts == want
        decode = node_load(addresses["decode0"])
        assert decode.num_kv_fallbacks >= 1, decode  # pulls from the killed holder fell back: the kill hit them
        assert set(decode.num_kv_fallbacks_by_reason) <= {"handshake", "transfer", "timeout", "lease_lost"}
        for name in {"prefill0", "prefill1", "decode0"} - {killed}:
            report = wait_blocks_free(addresses[name], timeout_s=30)
            assert report.num_free_blocks == report.num_total_blocks and report.num_leases == 0, (name, report)
    finally:
        deployment.stop()


def _stream_ids(client: openai.OpenAI, prompt: list[int], max_tokens: int) -> str:
    stream = client.completions.create(model=_model(client), prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True)
    return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def _check_alive(deployment) -> None:
    dead = deployment.cluster.dead()
    if dead:
        raise RuntimeError(f"process ended: {dead}\n{deployment.logs()}")
