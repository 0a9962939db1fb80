"""Prefix caching between real node processes: a prefill and a decode node (`pdserve prefill`,
`pdserve decode`, NIXL, the tiny model) driven over their control sockets as a proxy would.
A conversation's second turn is prefilled from its uncached suffix and pulls only its new
blocks; the same prompt again pulls nothing; no pull falls back; greedy output equals
transformers'; over NIXL and gloo; both nodes report the prompt's block keys in their prefix-cache digest."""

from __future__ import annotations

import sys
import time

import msgspec
import pytest
import torch
import transformers

from engine import protocol
from pdserve.cluster import Cluster
from pdserve.ports import free_port
from tests.conftest import dealer

GREEDY = protocol.SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True)
TURN1 = [(13 * i + 7) % 2000 + 8 for i in range(40)]  # 2 full blocks + 8 tokens
TURN2 = TURN1 + [(17 * i + 3) % 2000 + 8 for i in range(40)]  # 80 tokens: 5 full blocks
NODE_ARGS = ["--num-blocks", "128", "--max-num-batched-tokens", "256", "--max-num-seqs", "8", "--log-level", "WARNING"]


class Proxy:
    """A DEALER per node, speaking engine.protocol as the proxy does."""

    def __init__(self, addresses: dict[str, str]) -> None:
        self.sockets = {name: dealer(address) for name, address in addresses.items()}
        self.seq = 0

    def close(self) -> None:
        for socket in self.sockets.values():
            socket.close(linger=0)

    def send(self, node: str, message) -> None:
        self.sockets[node].send(protocol.encode(message))

    def receive(self, node: str, wanted, timeout_s: float = 60.0):
        """The first message from node for which wanted(message) is true; pings meanwhile (a
        silent proxy is an orphan to the node)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.sockets[node].poll(200):
                self.send(node, protocol.Ping())
                continue
            try:
                message = protocol.decode_from_node(self.sockets[node].recv())
            except msgspec.DecodeError:
                continue
            if wanted(message):
                return message
        raise TimeoutError(f"nothing wanted from {node} within {timeout_s} s")

    def load(self, node: str, until=lambda report: True, timeout_s: float = 10.0) -> protocol.LoadReport:
        """The node's load once until(report) holds (a report is recorded before the loop's
        next step: it can lag one step behind), or the last one seen after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.send(node, protocol.Ping())
            report = self.receive(node, lambda m: isinstance(m, protocol.LoadReport))
            if until(report) or time.monotonic() > deadline:
                return report
            time.sleep(0.05)

    def complete(self, request_id: str, prompt: list[int]) -> list[int]:
        self.seq += 1
        self.send("prefill", protocol.PrefillRequest(request_id, prompt, GREEDY, seq=self.seq))
        result = self.receive("prefill", lambda m: getattr(m, "request_id", None) == request_id)
        assert isinstance(result, protocol.PrefillResult) and result.kv_handle is not None, result
        self.send("decode", protocol.DecodeRequest(request_id, prompt, GREEDY, result.first_token, result.kv_handle,
                                                   seq=self.seq))
        tokens = [result.first_token.token_id]
        while True:
            batch = self.receive("decode", lambda m: isinstance(m, protocol.TokenBatch | protocol.ErrorReply))
            assert not isinstance(batch, protocol.ErrorReply), batch
            for delta in batch.deltas:
                if delta.request_id == request_id:
                    tokens += [t.token_id for t in delta.tokens]
                    if delta.finish_reason is not None:
                        return tokens


def transformers_greedy(model_dir, prompt: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(params=["nixl", "gloo"])
def nodes(request, tiny_model_dir, tmp_path):
    """A prefill and a decode node over one KV backend (a pull of part of a lease, both ways)."""
    cluster = Cluster()
    addresses = {kind: f"127.0.0.1:{free_port()}" for kind in ("prefill", "decode")}
    proxy = None
    try:
        for kind, address in addresses.items():
            cluster.start(kind, [sys.executable, "-m", "pdserve.cli", kind, "--model", str(tiny_model_dir), "--port",
                                 address.rsplit(":")[1], "--node-id", kind, "--transfer-backend", request.param,
                                 *NODE_ARGS], tmp_path)
        proxy = Proxy(addresses)
        for kind in addresses:
            proxy.receive(kind, lambda m: isinstance(m, protocol.LoadReport), timeout_s=120.0)
        yield proxy
    finally:
        if proxy is not None:
            proxy.close()
        cluster.stop()


def test_second_turn_pulls_only_new_blocks_repeated_prompt_pulls_nothing(nodes, tiny_model_dir):
    assert nodes.complete("t1", TURN1) == transformers_greedy(tiny_model_dir, TURN1)
    decode = nodes.load("decode", lambda r: r.num_kv_blocks_pulled == 3)
    assert (decode.num_kv_blocks_pulled, decode.num_kv_blocks_skipped) == (3, 0)

    assert nodes.complete("t2", TURN2) == transformers_greedy(tiny_model_dir, TURN2)
    decode = nodes.load("decode", lambda r: r.num_kv_blocks_pulled == 6)
    assert (decode.num_kv_blocks_pulled, decode.num_kv_blocks_skipped) == (3 + 3, 2)  # its 2 cached blocks

    assert nodes.complete("t2-again", TURN2) == transformers_greedy(tiny_model_dir, TURN2)
    decode = nodes.load("decode", lambda r: r.num_kv_blocks_skipped == 7)
    prefill = nodes.load("prefill", lambda r: r.num_prefix_query_tokens == 200)
    assert (decode.num_kv_blocks_pulled, decode.num_kv_blocks_skipped) == (6, 2 + 5)  # nothing pulled
    assert decode.num_kv_fallbacks == 0
    # The prefill node computed TURN1, TURN2 past its 2 cached blocks, and the repeat's last block.
    assert prefill.num_computed_prefill_tokens == 40 + 48 + 16
    assert prefill.num_prefix_query_tokens == 40 + 80 + 80 and prefill.num_prefix_hit_tokens == 32 + 64
    keys = set(protocol.prefix_block_hashes(TURN2, 16))
    for node in ("prefill", "decode"):  # a digest comes when due (new, or a few seconds since the last)
        digest = nodes.receive(node, lambda m: isinstance(m, protocol.LoadReport) and m.prefix_cache is not None
                               and keys <= set(m.prefix_cache.block_hashes), timeout_s=15.0).prefix_cache
        assert len(digest.block_hashes) <= protocol.MAX_DIGEST_BLOCKS
    # every lease ended: read and confirmed, or released (a full hit's at once)
    assert nodes.load("prefill", lambda r: r.num_leases == 0).num_leases == 0
