"""Cache-aware routing (proxy.routing): prompts go to the node caching their prefix, balanced
against load with a cap; digests kept, ignored when older, forgotten on a new boot id; the
proxy's optimistic view; round-robin; the decode preference; local prefill counting cached
tokens. First on a NodePool fed LoadReports directly (deterministic), then through the proxy
with fake nodes that cache and report digests."""

from __future__ import annotations

import concurrent.futures
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine import protocol
from proxy.config import RoutingPolicy
from proxy.node_client import NodeClient, take_report
from proxy.nodes import LocalPrefillPolicy, NodePool
from proxy.routing import OPTIMISTIC_TTL_S, PrefixView, PromptBlocks, RoutingConfig
from tests.proxy.conftest import MODEL_NAME

BLOCK = 16
SAMPLING = protocol.SamplingOptions()


class _AcceptingSocket:
    """Takes every message, as a connected node's socket does."""

    def send(self, _data: bytes, flags: int = 0) -> concurrent.futures.Future:
        sent: concurrent.futures.Future = concurrent.futures.Future()
        sent.set_result(None)
        return sent


def _report(node: NodeClient, queued: int = 0, digest: list[int] | None = None, version: int = 1,
            boot_id: str = "boot-1", free_blocks: int = 1000, running: int = 0, rate: float = 0.0,
            max_num_seqs: int = 0, waiting: int = 0) -> None:
    """Feed the node a LoadReport through the pool's own handler (as if received)."""
    role = protocol.Role.PREFILL if node.kind == "prefill" else protocol.Role.DECODE
    take_report(node, protocol.LoadReport(
        node_id=node.address, role=role, protocol_version=protocol.PROTOCOL_VERSION, model_name="m",
        max_model_len=100_000, block_size=BLOCK, num_running=running, num_waiting=waiting,
        num_queued_prompt_tokens=queued, max_num_seqs=max_num_seqs,
        num_free_blocks=free_blocks, num_total_blocks=1000, boot_id=boot_id, prefill_tokens_per_s=rate,
        last_request_seq=node.num_requests_sent,
        prefix_cache=None if digest is None else protocol.PrefixCacheDigest(version, digest)))


@pytest.fixture
def make_pool():
    pools: list[NodePool] = []

    def make(num_prefill: int = 2, num_decode: int = 1, policy: RoutingPolicy = RoutingPolicy.CACHE_AWARE,
             local_prefill: LocalPrefillPolicy | None = None, **caps) -> NodePool:
        pool = NodePool([f"127.0.0.1:{1000 + i}" for i in range(num_prefill)],
                        [f"127.0.0.1:{2000 + i}" for i in range(num_decode)], heartbeat_timeout_s=60,
                        local_prefill=local_prefill, routing=RoutingConfig(policy, **caps))
        pools.append(pool)
        for node in pool.all:
            node.socket = _AcceptingSocket()
            _report(node)
        return pool

    yield make
    for pool in pools:
        pool.context.term()


def _prompt(num_tokens: int, first: int = 1) -> list[int]:
    return [first + i % 50 for i in range(num_tokens)]


def _hashes(token_ids: list[int]) -> list[int]:
    return protocol.prefix_block_hashes(token_ids, BLOCK)


def test_prompt_goes_to_the_prefill_node_caching_the_longest_prefix(make_pool):
    pool = make_pool(num_prefill=3)
    prompt = _prompt(200)
    _report(pool.prefill[1], digest=_hashes(prompt[:64]))  # 4 blocks
    _report(pool.prefill[2], digest=_hashes(prompt[:160]))  # 10 blocks
    assert pool.pick_prefill(prompt=PromptBlocks(prompt)) is pool.prefill[2]
    assert pool.prefill[2].routing_decisions == {"cache": 1}
    # another conversation's blocks do not count: chained hashes name whole prefixes
    other = _prompt(200, first=7)
    assert pool.pick_prefill(prompt=PromptBlocks(other)) is pool.prefill[0]
    assert pool.prefill[0].routing_decisions == {"load": 1}


def test_least_loaded_ignores_caches(make_pool):
    pool = make_pool(policy=RoutingPolicy.LEAST_LOADED)
    prompt = _prompt(200)
    _report(pool.prefill[0], queued=10)
    _report(pool.prefill[1], queued=20, digest=_hashes(prompt))
    assert pool.pick_prefill(prompt=PromptBlocks(prompt)) is pool.prefill[0]
    assert pool.prefill[0].routing_decisions == {"least_loaded": 1}


def test_cost_is_uncached_plus_queued_tokens_and_the_cap_bounds_affinity(make_pool):
    prompt = _prompt(1000)
    cached = _hashes(prompt)[:62]  # 992 tokens
    # 8 uncached + 500 queued < 1,000 uncached + 0 queued: the cache wins
    pool = make_pool()
    _report(pool.prefill[1], queued=500, digest=cached)
    assert pool.pick_prefill(prompt=PromptBlocks(prompt)) is pool.prefill[1]
    # 8 + 1,500 > 1,000: the idle node, though it caches nothing
    pool = make_pool()
    _report(pool.prefill[1], queued=1500, digest=cached)
    assert pool.pick_prefill(prompt=PromptBlocks(prompt)) is pool.prefill[0]
    assert pool.prefill[0].routing_decisions == {"load": 1}
    # within the cost rule, but past the cap: the cap wins
    pool = make_pool(max_extra_prefill_tokens=400)
    _report(pool.prefill[1], queued=500, digest=cached)
    assert pool.pick_prefill(prompt=PromptBlocks(prompt)) is pool.prefill[0]
    assert pool.prefill[0].routing_decisions == {"cap": 1}


def test_a_hot_prefix_spreads_over_the_nodes_as_their_queues_grow(make_pool):
    """Every prompt shares a cached system prompt on one node: requests in flight count as
    that node's queue (their uncached tokens), so past the cap the others take them."""
    pool = make_pool(max_extra_prefill_tokens=300)
    system = _prompt(512)
    _report(pool.prefill[0], digest=_hashes(system))
    chosen = []
    for user in range(8):
        prompt = PromptBlocks(system + _prompt(128, first=100 + user))
        node = pool.pick_prefill(prompt=prompt)
        node.send_request(protocol.PrefillRequest(f"r{user}", prompt.token_ids, SAMPLING), prompt)
        chosen.append(pool.prefill.index(node))
    # prefill0 takes prompts (128 uncached tokens each) until its queue is 300 past prefill1's
    # (the 4th); prefill1 then caches the system prompt too (the proxy's own view), and costs
    # decide: without the cap [0, 0, 0, 0, 0, 1, ...], least-loaded [0, 1, 0, 1, ...]
    assert chosen == [0, 0, 0, 1, 0, 0, 0, 1], chosen
    assert pool.prefill[1].routing_decisions == {"cap": 1, "cache": 1}


def test_unreported_load_counts_only_uncached_tokens(make_pool):
    pool = make_pool()
    prompt = PromptBlocks(_prompt(320))
    _report(pool.prefill[0], digest=_hashes(prompt.token_ids[:256]))
    node = pool.prefill[0]
    node.send_request(protocol.PrefillRequest("r", prompt.token_ids, SAMPLING), prompt)
    assert node.num_queued_prefill_tokens == 320 - 256


def test_digests_are_kept_until_newer_and_forgotten_on_a_new_boot_id(make_pool):
    pool = make_pool()
    prompt = _prompt(128)
    holder = pool.prefill[1]
    _report(holder, digest=_hashes(prompt), version=5)
    _report(holder)  # no digest in this report: unchanged, still held
    assert pool.pick_prefill(prompt=PromptBlocks(prompt)) is holder
    _report(holder, digest=[], version=4)  # older than the one held: ignored
    assert pool.pick_prefill(prompt=PromptBlocks(prompt)) is holder
    _report(holder, digest=[], version=6)  # newer: the blocks were evicted
    assert pool.pick_prefill(prompt=PromptBlocks(prompt)) is pool.prefill[0]
    _report(holder, digest=_hashes(prompt), version=7)
    _report(holder, boot_id="boot-2")  # restarted: its cache is gone, whatever it held before
    assert holder.prefix.digest == frozenset() and holder.prefix.version == -1
    assert pool.pick_prefill(prompt=PromptBlocks(prompt)) is pool.prefill[0]
    _report(holder, digest=_hashes(prompt), version=1, boot_id="boot-2")  # versions start again
    assert pool.pick_prefill(prompt=PromptBlocks(prompt)) is holder


def test_a_node_without_a_digest_is_routed_by_load(make_pool):
    pool = make_pool()
    _report(pool.prefill[0], queued=100)
    assert pool.pick_prefill(prompt=PromptBlocks(_prompt(64))) is pool.prefill[1]
    assert pool.prefill[1].routing_decisions == {"load": 1}


def test_the_next_turn_follows_a_prompt_sent_before_the_nodes_digest_shows_it(make_pool):
    pool = make_pool()
    first = PromptBlocks(_prompt(320))
    _report(pool.prefill[0], queued=400)  # busy: turn one goes to prefill1 by load
    node = pool.pick_prefill(prompt=first)
    assert node is pool.prefill[1]
    node.send_request(protocol.PrefillRequest("t1", first.token_ids, SAMPLING), first)
    _report(pool.prefill[0])  # idle again; prefill1 reports, still without a digest
    _report(pool.prefill[1])
    second = PromptBlocks(first.token_ids + _prompt(40, first=300))
    assert pool.pick_prefill(prompt=second) is pool.prefill[1]  # 320 cached there by the proxy's own view
    assert pool.prefill[1].routing_decisions["cache"] == 1
    # the optimistic entries expire: then only digests count
    view = pool.prefill[1].prefix
    assert view.num_cached_blocks(second.hashes(BLOCK)) == 20
    assert view.num_cached_blocks(second.hashes(BLOCK), now=time.monotonic() + OPTIMISTIC_TTL_S + 1) == 0


def test_optimistic_view_is_bounded():
    view = PrefixView()
    view.add(list(range(protocol.MAX_DIGEST_BLOCKS + 10)))
    assert len(view.optimistic) == protocol.MAX_DIGEST_BLOCKS and 0 not in view.optimistic


def test_round_robin_alternates_whatever_caches_and_loads_say(make_pool):
    pool = make_pool(num_prefill=2, num_decode=2, policy=RoutingPolicy.ROUND_ROBIN)
    prompt = _prompt(128)
    _report(pool.prefill[0], queued=5000)
    _report(pool.prefill[1], digest=_hashes(prompt))
    _report(pool.decode[1], digest=_hashes(prompt))
    picks = [pool.prefill.index(pool.pick_prefill(prompt=PromptBlocks(prompt))) for _ in range(5)]
    assert picks == [0, 1, 0, 1, 0]
    decode_picks = [pool.decode.index(pool.pick_decode(prompt=PromptBlocks(prompt))) for _ in range(4)]
    assert decode_picks == [0, 1, 0, 1]
    pool.prefill[1].unreachable_since = time.monotonic()  # not routable: skipped, the turn goes on
    assert [pool.prefill.index(pool.pick_prefill(prompt=PromptBlocks(prompt))) for _ in range(2)] == [0, 0]
    assert pool.prefill[0].routing_decisions == {"round_robin": 5}


def test_decode_prefers_the_node_holding_the_conversation_within_load_limits(make_pool):
    prompt = _prompt(320)
    pool = make_pool(num_decode=2)
    _report(pool.decode[0], free_blocks=900)  # more free blocks: the choice without caches
    _report(pool.decode[1], free_blocks=500, digest=_hashes(prompt[:256]), running=8)
    assert pool.pick_decode(prompt=PromptBlocks(prompt)) is pool.decode[1]
    assert pool.decode[1].routing_decisions == {"cache": 1}
    assert make_pool(num_decode=2, policy=RoutingPolicy.LEAST_LOADED).pick_decode(
        prompt=PromptBlocks(prompt)).address == pool.decode[0].address
    # past the cap (least loaded + 8 requests): the other node
    _report(pool.decode[1], free_blocks=500, digest=_hashes(prompt[:256]), version=2, running=9)
    assert pool.pick_decode(prompt=PromptBlocks(prompt)) is pool.decode[0]
    assert pool.decode[0].routing_decisions == {"cap": 1}
    # within the cap but without room for the uncached blocks: the other node
    _report(pool.decode[1], free_blocks=3, digest=_hashes(prompt[:256]), version=3)
    assert pool.pick_decode(prompt=PromptBlocks(prompt)) is pool.decode[0]


@pytest.mark.parametrize("policy", [RoutingPolicy.CACHE_AWARE, RoutingPolicy.LEAST_LOADED])
def test_decode_prefers_a_free_slot_to_a_cached_prefix_and_to_free_blocks(make_pool, policy):
    """decode[1] caches the conversation and has more free blocks, but runs its max_num_seqs (4):
    the request would wait there for another to finish, so decode[0] takes it while it has a slot.
    The admission's TTFT estimate counts on this (0 wait while any node has a free slot)."""
    prompt = _prompt(320)
    pool = make_pool(num_decode=2, policy=policy)
    _report(pool.decode[0], free_blocks=500, running=3, max_num_seqs=4)
    _report(pool.decode[1], free_blocks=900, digest=_hashes(prompt[:256]), running=4, max_num_seqs=4)
    assert pool.pick_decode(prompt=PromptBlocks(prompt)) is pool.decode[0]
    reason = "slot" if policy is RoutingPolicy.CACHE_AWARE else "least_loaded"
    assert pool.decode[0].routing_decisions == {reason: 1}
    # a request sent there since its report takes its last slot: both full, the usual choice
    other = _prompt(64, first=7)
    pool.decode[0].send_request(protocol.PrefillRequest("r0", other, SAMPLING), PromptBlocks(other))
    assert pool.pick_decode(prompt=PromptBlocks(prompt)) is pool.decode[1]
    # a waiting request holds a slot too; a node that does not report max_num_seqs has one
    pool = make_pool(num_decode=2, policy=policy)
    _report(pool.decode[0], free_blocks=900, digest=_hashes(prompt[:256]), waiting=1, running=3, max_num_seqs=4)
    _report(pool.decode[1], free_blocks=500, running=5)
    assert pool.pick_decode(prompt=PromptBlocks(prompt)) is pool.decode[1]


def test_local_prefill_counts_cached_tokens(make_pool):
    """100 tokens/s everywhere, 1 s threshold, penalty 2; a 400-token prompt; the prefill node
    has 100 tokens queued: 5 s there. Uncached on the decode node too: 4 s x 2 > 5 s, stays in
    the pool; with 384 tokens cached on the decode node: 0.16 s x 2, prefilled there; with them
    cached on the prefill node instead: 0.17 s there, under the threshold, stays in the pool."""
    prompt = _prompt(400)
    policy = LocalPrefillPolicy(min_wait_s=1.0, penalty=2.0)
    pool = make_pool(num_prefill=1, local_prefill=policy)
    _report(pool.prefill[0], queued=100, rate=100.0)
    _report(pool.decode[0], rate=100.0)
    assert pool.pick_local_prefill(pool.prefill[0], PromptBlocks(prompt)) is None
    _report(pool.decode[0], rate=100.0, digest=_hashes(prompt))
    assert pool.pick_local_prefill(pool.prefill[0], PromptBlocks(prompt)) is pool.decode[0]
    assert pool.decode[0].routing_decisions == {"local_prefill": 1}
    pool = make_pool(num_prefill=1, local_prefill=policy)
    _report(pool.prefill[0], queued=0, rate=100.0, digest=_hashes(prompt))
    _report(pool.decode[0], rate=100.0, digest=_hashes(prompt))
    assert pool.pick_local_prefill(pool.prefill[0], PromptBlocks(prompt)) is None


# ---- through the proxy, with fake nodes that cache ---------------------------------------------

CACHING = {"prefix_caching": True, "max_model_len": 4096, "num_total_blocks": 10_000}


def _complete(proxy, prompt: list[int]) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "ignore_eos": True, "temperature": 0}
    response = httpx.post(proxy.base_url + "/v1/completions", content=json.dumps(body), timeout=20,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    return response.json()


def _wait_for_metric(proxy, line: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(proxy.base_url + "/metrics", timeout=5).text
        if line in text or time.monotonic() > deadline:
            assert line in text, line
            return text
        time.sleep(0.02)


def _prefilled_on(proxy, prompt: list[int]) -> list[int]:
    """Indexes of the prefill nodes that got this exact prompt."""
    return [i for i, node in enumerate(proxy.prefill)
            if any(m.prompt_token_ids == prompt for m in node.messages(protocol.PrefillRequest))]


def test_a_prompt_goes_to_the_fake_node_caching_it_and_metrics_say_so(start_proxy):
    proxy = start_proxy(num_prefill=2, node=CACHING)
    system = _prompt(96, first=3)
    proxy.prefill[1].cache_prompt(system)  # prefill1's next report carries the digest and the lookup
    _wait_for_metric(proxy, 'pdserve_node_prefix_query_tokens_total{kind="prefill",node="prefill1"} 96.0')
    prompt = system + [200, 201, 202]
    _complete(proxy, prompt)
    assert _prefilled_on(proxy, prompt) == [1]
    text = _wait_for_metric(proxy, 'pdserve_node_prefix_hit_tokens_total{kind="prefill",node="prefill1"} 96.0')
    for line in ('pdserve_routing_decisions_total{kind="prefill",node="prefill1",reason="cache"} 1.0',
                 'pdserve_node_prefix_hit_rate{kind="prefill",node="prefill1"} 0.492',  # 96 of 96 + 99
                 'pdserve_node_prompt_tokens_by_cache_total{kind="prefill",node="prefill1",source="cached"} 96.0',
                 'pdserve_node_prompt_tokens_by_cache_total{kind="prefill",node="prefill1",source="uncached"} 99.0'):
        assert line in text, line


def test_conversations_stay_on_their_prefill_node_across_turns(start_proxy):
    """Four users at once, three turns each: turn one spreads by load (each in flight counts),
    every later turn lands where its conversation is cached. Each turn sends the users in
    another order (least-loaded routing would then move them)."""
    proxy = start_proxy(num_prefill=2, node={**CACHING, "prefill_s": 1.0})
    conversations = [_prompt(160, first=10 + 40 * user) for user in range(4)]
    homes: dict[int, list[int]] = {}
    for turn in range(3):
        order = conversations[turn:] + conversations[:turn]
        with ThreadPoolExecutor(len(conversations)) as pool:
            list(pool.map(lambda c: _complete(proxy, c), order))
        for user, prompt in enumerate(conversations):
            homes.setdefault(user, []).extend(_prefilled_on(proxy, prompt))
        conversations = [c + [300 + turn] * 20 for c in conversations]
    assert all(len(set(nodes)) == 1 and len(nodes) == 3 for nodes in homes.values()), homes
    assert {nodes[0] for nodes in homes.values()} == {0, 1}, homes  # both nodes used


def test_round_robin_through_the_proxy_alternates(start_proxy):
    proxy = start_proxy(num_prefill=2, node=CACHING, routing=RoutingPolicy.ROUND_ROBIN)
    prompt = _prompt(64)
    for _ in range(4):
        _complete(proxy, prompt)
    assert [len(node.messages(protocol.PrefillRequest)) for node in proxy.prefill] == [2, 2]
