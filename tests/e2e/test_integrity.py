"""Never a wrong answer, never one request taking down others, with real processes:

- a pull that waits in the decode node's queue longer than the prefill lease still reads its own
  prompt's KV (the lease is renewed while held, and a read is used only once the holder confirms
  the lease held throughout), while new prompts recycle the prefill node's freed blocks;
- a prefill/decode pair whose KV layouts differ is never routed to, and /health says why;
- malformed, oversized, wrong-version, unexpected and hostile messages sent to running nodes
  never disturb a bystander's stream, and the nodes stay up;
- with a cluster secret, a peer without it gets nothing from a node or its KV side channel;
- when the proxy is killed mid-stream, the nodes end its requests and free every block and
  lease within their orphan timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

import httpx
import msgspec
import openai
import pytest
import zmq

from engine import protocol
from engine import sampling_rules as rules
from engine.protocol import SamplingOptions
from kv_transfer import side_channel
from kv_transfer.errors import HandshakeFailed
from kv_transfer.layout import KVLayout
from kv_transfer.messages import SIDE_CHANNEL_VERSION, Hello, HelloReply
from pdserve.ports import free_port, wait_http_ok
from tests.conftest import held_port
from tests.e2e.conftest import (
    CLUSTER_SECRET,
    KV_PATH_ONLY,
    finished_requests,
    node_load,
    secure,
    start_nodes,
    wait_blocks_free,
)
from tests.e2e.test_pipeline import hf, hf_greedy, random_prompts  # noqa: F401 - hf is a fixture

# A prefill node with 24 blocks (8 prompts of 40 tokens), leases of 1 s, and a decode node that
# decodes one request at a time: the later requests of a wave wait for their pull far longer
# than a lease lasts, and the next wave's prompts need the blocks those leases hold.
LEASE_TIMEOUT_S = 1.0
SMALL_NODES = ("--max-num-batched-tokens", "256", "--num-blocks", "24", "--max-num-seqs", "1",
               "--lease-timeout-s", str(LEASE_TIMEOUT_S))
NUM_OUTPUT_TOKENS = 48  # the sixth request of a wave waits 5 x 48 decode steps for its pull: several leases


def _complete_all(base_url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[int, str]]:
    """(status, completion text or the error body) per prompt, all sent at once."""
    async def one(client: httpx.AsyncClient, prompt: list[int]):
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}  # as hf_greedy: eos ends
        response = await client.post("/v1/completions", json=body)
        if response.status_code != 200:
            return response.status_code, response.text
        return 200, response.json()["choices"][0]["text"]

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    return asyncio.run(run())


def test_pulls_queued_past_their_lease_never_return_another_prompts_kv(tiny_model_dir, tmp_path, hf):  # noqa: F811
    deployment = start_nodes(tiny_model_dir, tmp_path / "logs", [[]], [[]], KV_PATH_ONLY, SMALL_NODES)
    try:
        wait_http_ok(deployment.base_url + "/health", 120, lambda: _check_alive(deployment))
        first_wave = random_prompts(6, [40], seed=101)
        second_wave = random_prompts(8, [40], seed=202)
        _, tokenizer = hf
        expected = {tuple(p): tokenizer.decode(hf_greedy(hf, p, NUM_OUTPUT_TOKENS)[0], skip_special_tokens=True)
                    for p in first_wave + second_wave}
        assert len(set(expected.values())) == len(expected)  # another prompt's continuation is always wrong here
        model, results = tiny_model_dir.name, {}
        first = threading.Thread(target=lambda: results.__setitem__(
            "first", _complete_all(deployment.base_url, model, first_wave, NUM_OUTPUT_TOKENS)))
        first.start()
        time.sleep(LEASE_TIMEOUT_S * 1.5)  # past the first wave's leases: their blocks would be free to reuse now
        results["second"] = _complete_all(deployment.base_url, model, second_wave, NUM_OUTPUT_TOKENS)
        first.join(timeout=600)
        outcomes = list(zip(first_wave + second_wave, results["first"] + results["second"]))
        wrong = [i for i, (p, (status, got)) in enumerate(outcomes) if status == 200 and got != expected[tuple(p)]]
        errors = [(status, got) for _, (status, got) in outcomes if status != 200]
        decode = node_load(deployment.node_addresses["decode0"])
        print(f"\n{len(outcomes) - len(errors)} answers, {len(wrong)} wrong, {len(errors)} explicit errors; "
              f"decode fallbacks by reason {decode.num_kv_fallbacks_by_reason}")
        assert wrong == [], f"answers {wrong} are another prompt's continuation"
        # Explicit refusals are allowed (the proxy answers 429 while leases fill the prefill
        # node's few blocks), silent wrong answers never; the first wave came in with room.
        assert all(status in (429, 503) and '"error"' in body for status, body in errors), errors
        assert all(status == 200 for status, _ in results["first"])
        prefill = wait_blocks_free(deployment.node_addresses["prefill0"], timeout_s=10)
        assert prefill.num_leases == 0 and prefill.num_free_blocks == prefill.num_total_blocks
    finally:
        deployment.stop()


def _check_alive(deployment) -> None:
    dead = deployment.cluster.dead()
    if dead:
        raise RuntimeError(f"process ended: {dead}\n{deployment.logs()}")


def test_mismatched_kv_layouts_are_never_paired_and_health_names_the_fields(tiny_model_dir, tmp_path):
    deployment = start_nodes(tiny_model_dir, tmp_path / "logs", [["--dtype", "bfloat16"]], [["--dtype", "float32"]],
                             KV_PATH_ONLY)
    try:
        deadline = time.monotonic() + 120
        health = None
        while time.monotonic() < deadline:
            _check_alive(deployment)
            with contextlib.suppress(httpx.HTTPError):
                health = httpx.get(deployment.base_url + "/health", timeout=5)
                if "KV layout mismatch" in health.text:
                    break
            time.sleep(0.2)
        assert health is not None and health.status_code == 503, health and health.text
        [described] = [d for d in health.json()["down"] if "KV layout mismatch" in d]
        prefill, decode = deployment.node_addresses["prefill0"], deployment.node_addresses["decode0"]
        assert "prefill prefill0 and decode decode0" in described  # named, the addresses kept private
        assert "dtype: prefill 'bfloat16', decode 'float32'" in described
        response = httpx.post(deployment.base_url + "/v1/completions", timeout=30,
                              json={"model": tiny_model_dir.name, "prompt": [5, 6, 7], "max_tokens": 4})
        assert response.status_code == 503 and "KV layout" in response.json()["error"]["message"]
        for address in (prefill, decode):
            report = node_load(address)
            assert report.kv_layout is not None and report.num_running == report.num_waiting == 0
            assert report.num_kv_fallbacks == 0 and report.num_pending_pulls == 0 and report.num_leases == 0
        assert node_load(prefill).kv_layout.fields["dtype"] == "bfloat16"
        proxy_log = (deployment.log_dir / "proxy.log").read_text()
        assert f"KV layout mismatch between prefill {prefill} and decode {decode}" in proxy_log
    finally:
        deployment.stop()


class RawPeer:
    """A bare DEALER on a node's control socket, speaking (or not) the protocol by hand."""

    def __init__(self, address: str, keys: protocol.CurveKeys | None = None) -> None:
        self.socket = secure(zmq.Context.instance().socket(zmq.DEALER), keys)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"tcp://{address}")

    def send(self, message) -> None:
        self.socket.send(protocol.encode(message))

    def until(self, predicate, timeout_s: float = 30.0) -> list:
        """Messages received until one satisfies predicate (it is the last)."""
        received, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.socket.poll(100):
                message = protocol.decode_from_node(self.socket.recv())
                received.append(message)
                if predicate(message):
                    return received
        raise TimeoutError(f"nothing matching within {timeout_s} s; got {received[-5:]}")

    def close(self) -> None:
        self.socket.close(linger=0)


def _error_for(request_id: str):
    return lambda m: isinstance(m, protocol.ErrorReply) and m.request_id == request_id


def _finished(request_id: str):
    return lambda m: isinstance(m, protocol.TokenBatch) and any(
        d.request_id == request_id and d.finish_reason for d in m.deltas)


def _stream_text(base_url: str, body: dict, out: dict) -> None:
    """Stream a completion into out: status, events (counted as they come), error, text."""
    text = []
    out["events"], out["error"] = 0, None
    with httpx.stream("POST", base_url + "/v1/completions", json={**body, "stream": True}, timeout=300) as response:
        out["status"] = response.status_code
        for line in response.iter_lines():
            if line.startswith("data: {"):
                out["events"] += 1
                chunk = msgspec.json.decode(line[len("data: "):])
                text += [c["text"] for c in chunk.get("choices", [])]
                out["error"] = out["error"] or chunk.get("error")
    out["text"] = "".join(text)


def test_bad_messages_to_running_nodes_never_disturb_a_bystander_stream(tiny_model_dir, tmp_path, hf):  # noqa: F811
    deployment = start_nodes(tiny_model_dir, tmp_path / "logs", [[]], [[]], KV_PATH_ONLY)
    prefill_address, decode_address = deployment.node_addresses["prefill0"], deployment.node_addresses["decode0"]
    peers = []
    try:
        wait_http_ok(deployment.base_url + "/health", 120, lambda: _check_alive(deployment))
        _, tokenizer = hf
        prompt = random_prompts(1, [60], seed=303)[0]
        want = tokenizer.decode(hf_greedy(hf, prompt, 150)[0], skip_special_tokens=True)
        body = {"model": tiny_model_dir.name, "prompt": prompt, "max_tokens": 150, "temperature": 0}
        stream: dict = {}
        bystander = threading.Thread(target=_stream_text, args=(deployment.base_url, body, stream))
        bystander.start()
        _send_huge_top_k(deployment.base_url, body)
        prefill, decode = RawPeer(prefill_address), RawPeer(decode_address)
        peers += [prefill, decode]
        _send_garbage(prefill)
        _send_garbage(decode)
        handle = _send_hostile_requests(prefill, decode)
        _send_side_channel_garbage(handle.agent_address)
        bystander.join(timeout=300)
        assert stream["status"] == 200 and stream["error"] is None and stream["text"] == want
        for address in (prefill_address, decode_address):
            report = wait_blocks_free(address, timeout_s=30)
            assert report.num_free_blocks == report.num_total_blocks and report.num_leases == 0, report
            assert report.num_rejected_messages > 0
        assert deployment.cluster.dead() == []
        after = httpx.post(deployment.base_url + "/v1/completions", json={**body, "max_tokens": 8}, timeout=60)
        assert after.status_code == 200 and want.startswith(after.json()["choices"][0]["text"])
    finally:
        for peer in peers:
            peer.close()
        deployment.stop()


def _send_huge_top_k(base_url: str, body: dict) -> None:
    """Another client's top_k of 10**19 (past a signed 64-bit value: it once overflowed the
    sampler's tensor and failed every request of the step): a 400 naming top_k, streaming or not."""
    for stream in (False, True):
        response = httpx.post(base_url + "/v1/completions", json={**body, "top_k": 10**19, "stream": stream},
                              timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "top_k", error


def _send_garbage(peer: RawPeer) -> None:
    """Frames no node may act on: each is dropped, counted and logged (rate-limited)."""
    socket = peer.socket
    older = b"PD" + (protocol.PROTOCOL_VERSION - 1).to_bytes(2, "big") + protocol.encode(protocol.Ping())[4:]
    for payload in (b"", b"\x00" * 10, b"\xff" * 1000, older, protocol.encode(protocol.Ping())[:-1] + b"\xc1",
                    protocol.encode(protocol.TokenBatch([])),  # a node -> proxy message
                    b"PD" + protocol.PROTOCOL_VERSION.to_bytes(2, "big") + b"\x92\xa1x\xd9\x05\xff\xfe\xfd\xfc\xfb"):
        socket.send(payload)
    socket.send_multipart([b"two", b"frames"])
    peer.send(protocol.Abort(["nobody", "nobody-else"]))  # unknown ids: no-ops
    peer.send(protocol.ReleaseKV(["nobody"]))
    peer.send(protocol.Ping())
    assert isinstance(peer.until(lambda m: isinstance(m, protocol.LoadReport))[-1], protocol.LoadReport)


def _send_hostile_requests(prefill: RawPeer, decode: RawPeer) -> protocol.KVHandle:
    """Well-formed requests a node must refuse alone (or serve), each checked; returns the KV
    handle of a real prefill (its lease released)."""
    huge = SamplingOptions(max_tokens=4, top_k=2**64 - 1)
    decode.send(protocol.DecodeRequest("huge-top-k", [5, 6, 7], huge))
    assert decode.until(_error_for("huge-top-k"))[-1].is_client_error
    edges = SamplingOptions(max_tokens=3, top_k=rules.MAX_INT64, seed=rules.MAX_SEED, temperature=1.0,
                            stop_token_ids=[rules.MAX_TOKEN_ID])
    decode.send(protocol.DecodeRequest("edges", [5, 6, 7], edges))
    decode.until(_finished("edges"))
    decode.send(protocol.DecodeRequest("dup", [5, 6, 7], SamplingOptions(max_tokens=40, temperature=0)))
    decode.send(protocol.DecodeRequest("dup", [8, 9], SamplingOptions(max_tokens=2)))
    error = decode.until(_error_for("dup"))[-1]
    assert error.kind == "DuplicateRequestId"
    decode.until(_finished("dup"))  # the first "dup" is unharmed
    prefill.send(protocol.PrefillRequest("real", list(range(10, 50)), SamplingOptions(max_tokens=8)))
    result = prefill.until(lambda m: isinstance(m, protocol.PrefillResult) and m.request_id == "real")[-1]
    handle, first = result.kv_handle, result.first_token
    prompt = list(range(10, 50))
    cases = {  # request id -> the KV handle, and what the decode node must answer
        "far-blocks": (msgspec.structs.replace(handle, block_ids=[10**9, 10**9 + 1, 10**9 + 2]), "BadKVHandle"),
        "block-count": (msgspec.structs.replace(handle, block_ids=handle.block_ids[:1]), "ValueError"),
        "bad-address": (msgspec.structs.replace(handle, agent_address="not an address"), "ValueError"),
    }
    for request_id, (bad_handle, kind) in cases.items():
        decode.send(protocol.DecodeRequest(request_id, prompt, SamplingOptions(max_tokens=8), first, bad_handle))
        assert decode.until(_error_for(request_id))[-1].kind == kind, request_id
    with held_port() as free:  # an agent nobody serves: the handshake fails (bounded), then local prefill
        nobody = msgspec.structs.replace(handle, engine_id="nobody", agent_address=f"127.0.0.1:{free}")
        decode.send(protocol.DecodeRequest("nobody", prompt, SamplingOptions(max_tokens=8), first, nobody))
    batches = decode.until(_finished("nobody"))
    [opening] = [d for m in batches if isinstance(m, protocol.TokenBatch) for d in m.deltas
                 if d.request_id == "nobody"][:1]
    assert opening.kv.label == "fallback:handshake"
    prefill.send(protocol.ReleaseKV(["real"]))
    decode.send(protocol.DecodeRequest("too-long", list(range(10, 10 + 10_000)), SamplingOptions(max_tokens=2)))
    assert decode.until(_error_for("too-long"))[-1].is_client_error
    with contextlib.suppress(zmq.ZMQError):  # past the node's message size: it drops the connection
        decode.socket.send(protocol.encode(protocol.Ping())[:4] + b"\x00" * (protocol.MAX_MESSAGE_BYTES + 1))
    return handle


def _send_side_channel_garbage(address: str) -> None:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"tcp://{address}")
    try:
        for payload in (b"", b"\xff" * 64, b"KV\x00\x01junk", side_channel.encode(HelloReply(
                SIDE_CHANNEL_VERSION, "x", KVLayout(1, 1, 1, 1, "f", 1, "m", "c"), "nixl"))):
            socket.send(payload)
    finally:
        socket.close(linger=0)


def test_with_a_cluster_secret_a_peer_without_it_gets_nothing(secret_disaggregated):
    deployment = secret_disaggregated
    keys = protocol.curve_keys(CLUSTER_SECRET)
    prefill_address = deployment.node_addresses["prefill0"]
    for address in deployment.node_addresses.values():
        for wrong in (None, protocol.curve_keys("some-other-cluster-secret")):
            with pytest.raises(TimeoutError):
                node_load(address, timeout_s=1.5, keys=wrong)
        assert node_load(address, keys=keys).protocol_version == protocol.PROTOCOL_VERSION
    member = RawPeer(prefill_address, keys)
    try:
        member.send(protocol.PrefillRequest("probe", [5, 6, 7, 8], SamplingOptions(max_tokens=4)))
        handle = member.until(lambda m: isinstance(m, protocol.PrefillResult))[-1].kv_handle
        layout = KVLayout(1, 1, 1, 1, "float32", 1, "none", "none")
        hello = Hello(SIDE_CHANNEL_VERSION, "outsider", layout, "nixl")
        with pytest.raises(HandshakeFailed, match="no answer"):  # no NIXL metadata for outsiders
            side_channel.request(handle.agent_address, hello, timeout_s=1.5)
        reply = side_channel.request(handle.agent_address, hello, timeout_s=5, keys=keys)
        assert isinstance(reply, HelloReply) and reply.refusal is not None  # a member: answered (other layout)
        member.send(protocol.ReleaseKV(["probe"]))
    finally:
        member.close()
    report = wait_blocks_free(prefill_address, keys=keys)
    assert report.num_leases == 0 and report.num_rejected_messages >= 4  # the outsiders' handshakes, counted
    client = openai.OpenAI(base_url=deployment.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    name = client.models.list().data[0].id
    assert client.completions.create(model=name, prompt="x = 1", max_tokens=4, temperature=0).usage.completion_tokens


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_vanished_proxy_mid_stream_its_requests_end_and_every_block_comes_back(tiny_model_dir, tmp_path, how):
    """killed (SIGKILL): its connections close and the nodes see it gone at their next send.
    frozen (SIGSTOP): its connections stay open and take frames; only its silence (no pings)
    past the orphan timeout tells the nodes. The decode node runs one request at a time and
    keeps decoding into the frozen proxy's socket until then, so on a fast CPU the first
    requests can end by length first: each request ends one way or the other, never both or
    neither, and at least the last one is an orphan (4 x 1,900 tokens take far longer than
    the timeout on one decode row)."""
    orphan_timeout_s, num_requests = 2.0, 4
    node_args = ("--max-num-batched-tokens", "256", "--num-blocks", "128", "--max-num-seqs", "1",
                 "--orphan-timeout-s", str(orphan_timeout_s))
    health_port = free_port()
    deployment = start_nodes(tiny_model_dir, tmp_path / "logs", [[]], [["--health-port", str(health_port)]],
                             KV_PATH_ONLY, node_args)
    try:
        wait_http_ok(deployment.base_url + "/health", 120, lambda: _check_alive(deployment))
        before = {name: node_load(address) for name, address in deployment.node_addresses.items()}
        lengths = [40, 70, 100, 130]
        body = {"model": tiny_model_dir.name, "max_tokens": 1900, "temperature": 0,
                "ignore_eos": True}
        streams = [{} for _ in range(num_requests)]  # one decodes, the others wait for the decode node, leases held
        threads = [threading.Thread(target=_stream_quietly, args=(deployment.base_url, {**body, "prompt": p}, out),
                                    daemon=True)
                   for p, out in zip(random_prompts(num_requests, lengths, seed=404), streams)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _all_held(deployment, streams, num_requests - 1):
            time.sleep(0.05)
        assert _all_held(deployment, streams, num_requests - 1)
        proxy = deployment.cluster.process("proxy")
        os.kill(proxy.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)  # no Abort, no ReleaseKV comes
        killed_at = time.monotonic()
        for name, address in deployment.node_addresses.items():
            report = wait_blocks_free(address, timeout_s=orphan_timeout_s + 5)
            assert report.num_free_blocks == before[name].num_free_blocks == report.num_total_blocks, (name, report)
            assert report.num_running == report.num_leases == report.num_pending_pulls == 0, (name, report)
        took_s = time.monotonic() - killed_at
        orphaned = node_load(deployment.node_addresses["decode0"]).num_orphaned_requests
        by_length = finished_requests(f"http://127.0.0.1:{health_port}", "length")
        print(f"\nevery block back {took_s:.1f} s after the proxy was {how} (orphan timeout {orphan_timeout_s} s):"
              f" {orphaned} orphaned, {by_length} ended by length first")
        assert took_s < orphan_timeout_s + 3
        assert orphaned + by_length == num_requests and orphaned >= 1
        if how == "killed":
            assert orphaned == num_requests  # the next token's send finds the proxy gone
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(deployment.cluster.process("proxy").pid, signal.SIGKILL)
        deployment.stop()


def _all_held(deployment, streams: list[dict], num_waiting: int) -> bool:
    """One request streams, the others wait on the decode node for their pull (their leases held)."""
    decode = node_load(deployment.node_addresses["decode0"])
    prefill = node_load(deployment.node_addresses["prefill0"])
    is_streaming = any(s.get("events", 0) >= 3 for s in streams)
    return is_streaming and decode.num_running == 1 and decode.num_pending_pulls == prefill.num_leases == num_waiting


def _stream_quietly(base_url: str, body: dict, out: dict) -> None:
    with contextlib.suppress(httpx.HTTPError):
        _stream_text(base_url, body, out)


def test_a_gap_in_a_nodes_token_deltas_fails_the_request_explicitly():
    """No process needed: the proxy's request flow given deltas whose indices skip one (a lost
    frame) raises NodeDied (a 502, or an SSE error event once streaming) instead of yielding a
    silently shorter answer."""
    from proxy.errors import NodeDied
    from proxy.node_client import MessageQueue, NodeClient
    from proxy.request_flow import _decode_steps

    async def run() -> list:
        queue = MessageQueue()
        for idx in (1, 2, 4):  # token 3 never arrived
            queue.put_nowait(protocol.RequestDelta("r", [protocol.TokenLogprob(7)], idx))
        steps = []
        with pytest.raises(NodeDied, match="from index 4, expected 3"):
            async for step in _decode_steps(queue, NodeClient("127.0.0.1:1", "decode", 3.0), "r", 1, 5.0, 5.0):
                steps.append(step)
        return steps

    assert len(asyncio.run(run())) == 2
