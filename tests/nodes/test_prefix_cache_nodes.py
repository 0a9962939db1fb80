"""Prefix caching across the real PrefillNode and DecodeNode (fake transport, driven message by
message): a second turn is prefilled from its uncached suffix and pulls only its new blocks, a
repeated prompt pulls nothing and its lease is released at once, a holder's shared blocks stay
while a lease depends on them; outputs equal a colocated engine with caching off, and both
sides end with every block free or cached-free."""

from __future__ import annotations

import dataclasses

from engine import protocol
from tests.nodes.conftest import (
    GREEDY,
    assert_nothing_held,
    assert_nothing_held_once_released,
    colocated_greedy,
    release_notices_processed,
)

TURN1 = [(13 * i + 7) % 2000 + 8 for i in range(40)]  # 2 full blocks + 8 tokens
TURN2 = TURN1 + [(17 * i + 3) % 2000 + 8 for i in range(40)]  # 80 tokens: 5 full blocks


def serve(pair, request_id: str, prompt: list[int]) -> list[int]:
    pair.pull(request_id, prompt)
    pair.run(lambda: pair.tokens_of(request_id) is not None)
    pair.run(release_notices_processed(pair))
    return pair.tokens_of(request_id)


def test_second_turn_pulls_only_new_blocks_and_a_repeated_prompt_pulls_nothing(pair, tiny_model_dir):
    prefill, decode = pair.prefill, pair.decode
    assert serve(pair, "t1", TURN1) == colocated_greedy(tiny_model_dir, TURN1)
    assert (decode.num_kv_blocks_pulled, decode.num_kv_blocks_skipped) == (3, 0)
    computed = prefill.engine.prefix_stats.num_computed_prefill_tokens
    assert computed == len(TURN1)

    assert serve(pair, "t2", TURN2) == colocated_greedy(tiny_model_dir, TURN2)
    # The prefill node computed only past its 2 cached blocks; the decode node pulled the 3 new.
    assert prefill.engine.prefix_stats.num_computed_prefill_tokens - computed == len(TURN2) - 32
    assert (decode.num_kv_blocks_pulled, decode.num_kv_blocks_skipped) == (3 + 3, 2)

    # The same conversation again: the decode node has every block; nothing moves.
    result = pair.prefill_prompt("t2-again", TURN2)
    assert len(prefill.leases) == 1
    pair.send_decode("t2-again", result, TURN2)
    pair.decode.run_once()
    assert decode.connector.num_reads_in_flight == 0  # no read started: the lease is released at once
    pair.run(lambda: len(prefill.leases) == 0)
    pair.run(lambda: pair.tokens_of("t2-again") is not None)
    assert pair.tokens_of("t2-again") == colocated_greedy(tiny_model_dir, TURN2)
    assert (decode.num_kv_blocks_pulled, decode.num_kv_blocks_skipped) == (6, 2 + 5)
    assert pair.deltas_of("t2-again")[0].kv == protocol.KVOutcome(protocol.KVSource.PULLED)

    # A repeated prompt with a partial last block: its full blocks are cached, its 8-token tail
    # is computed with the first token's step; nothing pulled.
    assert serve(pair, "t1-again", TURN1) == colocated_greedy(tiny_model_dir, TURN1)
    assert (decode.num_kv_blocks_pulled, decode.num_kv_blocks_skipped) == (6, 7 + 3)
    assert decode.num_kv_fallbacks == 0
    assert decode.engine.prefix_stats.num_hit_tokens == 32 + 80 + 32
    assert_nothing_held(pair)


def test_with_caching_off_every_block_is_pulled(pair, tiny_model_dir):
    for node in (pair.prefill, pair.decode):
        node.engine.scheduler.enable_prefix_caching = False
        node.engine.config = dataclasses.replace(node.engine.config, enable_prefix_caching=False)
    assert serve(pair, "t1", TURN1) == colocated_greedy(tiny_model_dir, TURN1)
    assert serve(pair, "t2", TURN2) == colocated_greedy(tiny_model_dir, TURN2)
    assert (pair.decode.num_kv_blocks_pulled, pair.decode.num_kv_blocks_skipped) == (3 + 5, 0)
    assert pair.prefill.engine.prefix_stats.num_computed_prefill_tokens == len(TURN1) + len(TURN2)
    assert pair.prefill.engine.block_pool.num_cached_blocks == 0
    assert_nothing_held(pair)


def test_shared_blocks_under_a_lease_are_never_evicted_by_the_holder(pair_factory, tiny_model_dir):
    # 5 prefill blocks: TURN2 takes all 5; a second lease on the same prompt shares them.
    pair = pair_factory(prefill_blocks=6)
    first = pair.prefill_prompt("a", TURN2)
    second = pair.prefill_prompt("b", TURN2)  # hits a's 4 blocks, recomputes the last
    assert first.kv_handle.block_ids[:4] == second.kv_handle.block_ids[:4]
    pair.prefill.handle_message(b"proxy", protocol.ReleaseKV(["a"]))  # a's lease ends; b's still holds 4
    pool = pair.prefill.engine.block_pool
    assert all(pool.ref_count(b) == 1 for b in second.kv_handle.block_ids)
    # Another prompt needs 3 blocks: only 1 is free; it waits, nothing of b's lease is evicted.
    other = [(11 * i + 5) % 2000 + 8 for i in range(40)]
    pair.prefill.handle_message(b"proxy", protocol.PrefillRequest("c", other, GREEDY))
    for _ in range(3):
        pair.prefill.run_once()
    assert not any(r.request_id == "c" for r in pair.results(protocol.PrefillResult))
    pair.send_decode("b", second, TURN2)
    pair.run(lambda: pair.tokens_of("b") is not None)
    assert pair.tokens_of("b") == colocated_greedy(tiny_model_dir, TURN2)
    pair.run(lambda: any(r.request_id == "c" for r in pair.results(protocol.PrefillResult)))
    pair.prefill.handle_message(b"proxy", protocol.ReleaseKV(["c"]))
    assert_nothing_held_once_released(pair)
    assert pair.decode.num_kv_fallbacks == 0


def test_digest_is_rebuilt_at_most_once_a_second_and_resent_to_each_proxy_when_due():
    from types import SimpleNamespace

    from node.prefix_cache import PrefixDigests

    now = [100.0]
    pool = SimpleNamespace(cache_version=1)
    engine = SimpleNamespace(config=SimpleNamespace(enable_prefix_caching=True), block_pool=pool,
                             prefix_cache_keys=lambda limit: (pool.cache_version, [pool.cache_version] * 3))
    digests = PrefixDigests(engine, clock=lambda: now[0], min_interval_s=1.0, resend_interval_s=5.0)
    assert digests.due_for(b"p1") is None  # nothing built yet
    digests.refresh()
    assert digests.due_for(b"p1").version == 1 and digests.due_for(b"p1") is None  # once per version
    assert digests.due_for(b"p2").version == 1  # each proxy gets it
    pool.cache_version = 2
    now[0] += 0.5
    digests.refresh()  # changed, but within a second of the last build: not yet
    assert digests.due_for(b"p1") is None
    now[0] += 0.6
    digests.refresh()
    assert digests.due_for(b"p1").version == 2
    now[0] += 5.0
    assert digests.due_for(b"p1").version == 2  # again after resend_interval_s, unchanged
    engine.config.enable_prefix_caching = False
    off = PrefixDigests(engine, clock=lambda: now[0])
    off.refresh()
    assert off.due_for(b"p1") is None  # caching off: no digest at all
