"""Prefix caching: the block pool's cache (LRU, reference counts, collisions) and the engine
reusing cached prefixes with outputs equal to caching off: greedy and seeded, under eviction
pressure and preemption, concurrent identical prompts, full-prompt hits, prompt logprobs,
migrated requests. Every engine test ends with every block free or cached-free and no
reference left (LLMEngine.check_leaks, which checks the pool's invariants)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.block_pool import ROOT_ENTRY, BlockPool
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.protocol import prefix_block_hashes
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

BLOCK = 16


def tokens(block_id: int) -> tuple[int, ...]:
    return tuple(range(block_id * BLOCK, (block_id + 1) * BLOCK))


def cache_chain(pool: BlockPool, block_ids: list[int], token_blocks: list[tuple[int, ...]]) -> list[int]:
    """Register block_ids as one prefix; returns their keys."""
    flat = [t for block in token_blocks for t in block]
    hashes = prefix_block_hashes(flat, BLOCK)
    parent = ROOT_ENTRY
    for block_id, block_hash, block_tokens in zip(block_ids, hashes, token_blocks):
        parent = pool.cache_block(block_id, block_hash, block_tokens, parent)
        assert parent is not None
    return hashes


# ---- the pool ---------------------------------------------------------------------------------


def test_freed_cached_blocks_stay_matchable_and_are_evicted_least_recently_used_after_plain_free_ones():
    pool = BlockPool(6)
    first = pool.allocate(2)
    blocks_a = [tokens(0), tokens(1)]
    hashes_a = cache_chain(pool, first, blocks_a)
    second = pool.allocate(2)
    blocks_b = [tokens(5), tokens(6)]
    hashes_b = cache_chain(pool, second, blocks_b)
    pool.free(first)  # a first: a is the least recently used
    pool.free(second)
    assert pool.num_free_blocks == 6 and pool.num_cached_free_blocks == 4
    assert pool.match_prefix(hashes_a, blocks_a).block_ids == first
    plain = pool.allocate(2)  # the never-cached blocks go first
    assert set(plain).isdisjoint(first + second) and pool.num_cached_blocks == 4
    evicted = pool.allocate(1)  # then a's last block (a request's tail goes before its head)
    assert evicted == [first[1]] and pool.num_evictions == 1
    assert pool.match_prefix(hashes_a, blocks_a).block_ids == [first[0]]
    assert pool.match_prefix(hashes_b, blocks_b).block_ids == second
    pool.free(plain + evicted)
    pool.check_consistent()


def test_referenced_blocks_are_never_evicted_and_counts_are_exact():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    token_blocks = [tokens(0), tokens(1)]
    hashes = cache_chain(pool, blocks, token_blocks)
    pool.free(blocks)
    hit = pool.match_prefix(hashes, token_blocks)
    pool.acquire(hit.block_ids)
    pool.acquire(hit.block_ids[:1])  # a second reader of the first block
    assert [pool.ref_count(b) for b in blocks] == [2, 1] and pool.num_free_blocks == 2
    others = pool.allocate(2)
    assert pool.allocate(1) is None  # the two left are referenced: not evictable
    pool.free(hit.block_ids)
    assert [pool.ref_count(b) for b in blocks] == [1, 0] and pool.num_free_blocks == 1
    assert pool.allocate(1) == [blocks[1]]  # unreferenced now: evicted and reused
    assert pool.match_prefix(hashes, token_blocks).block_ids == [blocks[0]]
    pool.free([blocks[0], blocks[1]] + others)
    with pytest.raises(ValueError, match="double free"):
        pool.free([blocks[0]])
    assert pool.num_free_blocks == 4
    pool.check_consistent()


def test_a_colliding_key_is_never_a_hit_and_is_replaced_only_when_unused():
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    key = 12345
    assert pool.cache_block(block, key, tokens(0), ROOT_ENTRY) is not None
    # Another prefix under the same 64-bit key: tokens differ, so never a hit.
    assert pool.match_prefix([key], [tokens(9)]).block_ids == []
    [other] = pool.allocate(1)
    assert pool.cache_block(other, key, tokens(9), ROOT_ENTRY) is None  # the holder is in use: not cached
    pool.free([block])
    entry = pool.cache_block(other, key, tokens(9), ROOT_ENTRY)  # unused now: replaced
    assert entry is not None and pool.match_prefix([key], [tokens(9)]).block_ids == [other]
    assert not pool.is_cached(block) and pool.match_prefix([key], [tokens(0)]).block_ids == []
    pool.free([other])
    pool.check_consistent()


def test_a_child_whose_parent_was_evicted_is_not_a_hit_under_a_new_parent():
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    token_blocks = [tokens(0), tokens(1)]
    hashes = cache_chain(pool, blocks, token_blocks)
    pool.acquire([blocks[1]])  # keep the child in use; the parent is freed and evicted
    pool.free(blocks)
    new = pool.allocate(2)
    assert blocks[0] in new and pool.match_prefix(hashes, token_blocks).block_ids == []
    entry = pool.cache_block(new[0], hashes[0], token_blocks[0], ROOT_ENTRY)  # the parent again, a new entry
    assert entry is not None
    assert pool.match_prefix(hashes, token_blocks).block_ids == [new[0]]  # the old child is not its child
    pool.free(new + [blocks[1]])
    pool.check_consistent()


def test_the_scheduler_keys_blocks_exactly_as_the_protocol_does():
    pool = BlockPool(8)
    scheduler = Scheduler(SchedulerConfig(), pool, BLOCK, enable_prefix_caching=True)
    prompt = [random.Random(1).randrange(50_000) for _ in range(70)]
    request = Request("r", prompt[:40], SamplingParams(), 1000, output_token_ids=prompt[40:])
    scheduler._hash_blocks(request, 4)
    assert request.block_hashes == prefix_block_hashes(prompt, BLOCK)  # output tokens included


# ---- the engine -------------------------------------------------------------------------------


def make_engine(model_dir, *, caching: bool, num_blocks: int = 128, max_num_batched_tokens: int = 256,
                max_num_seqs: int = 16) -> LLMEngine:
    config = EngineConfig(ModelConfig.from_pretrained(model_dir, dtype="float32"),
                          CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                          SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
                          enable_prefix_caching=caching)
    return LLMEngine(config)


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], prefix: str = "r",
        outputs_so_far: list[list[int]] | None = None) -> list[list[int]]:
    """Add every request at once and run them to completion; their output token ids."""
    ids = [f"{prefix}{i}" for i in range(len(requests))]
    for idx, (request_id, (prompt, params)) in enumerate(zip(ids, requests)):
        engine.add_request(request_id, prompt, params,
                           output_token_ids=outputs_so_far[idx] if outputs_so_far else None)
    got: dict[str, list[int]] = {r: [] for r in ids}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id] += [t.token_id for t in out.new_tokens]
    return [got[r] for r in ids]


def one_by_one(engine: LLMEngine, requests, prefix: str = "s") -> list[list[int]]:
    return [run(engine, [request], f"{prefix}{i}-")[0] for i, request in enumerate(requests)]


def conversation_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """A shared 'system prompt' of 100 tokens, then per user turns that grow."""
    rng = random.Random(seed)
    system = [rng.randrange(8, vocab) for _ in range(100)]
    prompts = []
    for _user in range(3):
        history = list(system)
        for _turn in range(3):
            history += [rng.randrange(8, vocab) for _ in range(rng.randrange(5, 40))]
            prompts.append(list(history))
    return prompts


@pytest.fixture(scope="module")
def vocab(tiny_model_dir) -> int:
    return ModelConfig.from_pretrained(tiny_model_dir).vocab_size


@pytest.fixture(scope="module")
def reference(tiny_model_dir, vocab):
    """Outputs with caching off, each prompt alone: greedy and seeded (temperature 1)."""
    engine = make_engine(tiny_model_dir, caching=False)
    prompts = conversation_prompts(vocab)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=8, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(len(prompts))]
    result = {"prompts": prompts, "greedy": greedy, "seeded": seeded,
              "greedy_out": one_by_one(engine, [(p, greedy) for p in prompts]),
              "seeded_out": one_by_one(engine, list(zip(prompts, seeded)))}
    assert engine.prefix_stats.num_hit_tokens == 0
    engine.check_leaks()
    return result


def test_turns_reuse_the_cached_prefix_and_give_the_same_outputs_greedy_and_seeded(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir, caching=True)
    prompts = reference["prompts"]
    assert one_by_one(engine, [(p, reference["greedy"]) for p in prompts]) == reference["greedy_out"]
    stats = engine.prefix_stats
    # Every prompt after the first starts with the 96 cached tokens of the system prompt (6 blocks);
    # later turns of a user hit their whole previous prompt's full blocks.
    assert stats.num_hit_tokens >= 96 * (len(prompts) - 1)
    assert stats.num_computed_prefill_tokens + stats.num_hit_tokens == sum(len(p) for p in prompts)
    assert stats.num_query_tokens == sum(len(p) for p in prompts)
    first_pass_hits = stats.num_hit_tokens
    assert one_by_one(engine, list(zip(prompts, reference["seeded"]))) == reference["seeded_out"]
    # The second pass hits every prompt's full blocks but the last token's.
    assert stats.num_hit_tokens - first_pass_hits == sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)
    assert engine.block_pool.num_cached_blocks > 0
    engine.check_leaks()


def test_a_full_prompt_hit_still_computes_the_last_block_for_the_first_token(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir, caching=True)
    prompt = reference["prompts"][0][:96]  # six whole blocks
    greedy = reference["greedy"]
    first = run(engine, [(prompt, greedy)], "a")
    computed = engine.prefix_stats.num_computed_prefill_tokens
    cached_kv = engine.kv_cache.clone()
    again = run(engine, [(prompt, greedy)], "b")
    assert again == first
    assert engine.prefix_stats.num_hit_tokens == 80  # 5 of 6 blocks: the last one is recomputed elsewhere
    assert engine.prefix_stats.num_computed_prefill_tokens - computed == 16
    cached = [b for b in range(engine.block_pool.num_blocks) if engine.block_pool.is_cached(b)]
    assert len(cached) == 6 and torch.equal(engine.kv_cache[cached], cached_kv[cached])  # never written again
    engine.check_leaks()


def test_under_eviction_pressure_and_preemption_outputs_equal_caching_off(tiny_model_dir, reference):
    # 24 blocks for nine prompts of 110-200 tokens (7-13 blocks each) with 8 output tokens:
    # cached blocks are evicted all the time, requests preempt each other.
    prompts = reference["prompts"]
    requests = [(p, reference["greedy"]) for p in prompts] + list(zip(prompts, reference["seeded"]))
    expected = reference["greedy_out"] + reference["seeded_out"]
    engine = make_engine(tiny_model_dir, caching=True, num_blocks=24, max_num_batched_tokens=64)
    assert run(engine, requests) == expected
    assert engine.block_pool.num_evictions > 0 and engine.scheduler.num_preemptions > 0
    assert engine.prefix_stats.num_hit_tokens > 0
    engine.check_leaks()


def test_concurrent_identical_prompts_agree_and_the_cache_keeps_one_copy(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir, caching=True)
    prompt, greedy = reference["prompts"][2], reference["greedy"]
    outputs = run(engine, [(prompt, greedy)] * 6)
    assert outputs == [reference["greedy_out"][2]] * 6
    num_full = (len(prompt) + 8 - 1) // BLOCK  # full blocks of prompt + output (the last token has no KV)
    assert engine.block_pool.num_cached_blocks == num_full  # one copy per prefix, whoever computed first
    later = run(engine, [(prompt, greedy)] * 3, "later")
    assert later == [reference["greedy_out"][2]] * 3
    engine.check_leaks()


def test_requests_owed_prompt_logprobs_compute_every_position(tiny_model_dir, reference):
    prompt = reference["prompts"][1]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)

    def prompt_logprobs(engine):
        engine.add_request("p", prompt, params)
        got = None
        while engine.has_unfinished():
            for out in engine.step():
                got = got or out.prompt_logprobs
        return got

    off = make_engine(tiny_model_dir, caching=False)
    expected = prompt_logprobs(off)
    on = make_engine(tiny_model_dir, caching=True)
    run(on, [(prompt, reference["greedy"])], "warm")  # the prompt's blocks are cached now
    hits = on.prefix_stats.num_hit_tokens
    got = prompt_logprobs(on)
    assert len(got) == len(prompt) and on.prefix_stats.num_hit_tokens == hits
    assert [t.token_id for t in got] == [t.token_id for t in expected]
    for mine, theirs in zip(got[1:], expected[1:]):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-5)
    # ...and its blocks are cached for others.
    run(on, [(prompt, reference["greedy"])], "after")
    assert on.prefix_stats.num_hit_tokens > hits
    off.check_leaks()
    on.check_leaks()


def test_a_migrated_request_reuses_blocks_its_output_filled(tiny_model_dir, reference, vocab):
    prompt = reference["prompts"][0]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine = make_engine(tiny_model_dir, caching=True)
    [full] = run(engine, [(prompt, params)], "orig")
    # The same request arriving with its first 30 tokens (migration): prompt + 29 of them are
    # cached, output blocks included.
    [rest] = run(engine, [(prompt, params)], "moved", outputs_so_far=[full[:30]])
    assert rest == full[30:]
    assert engine.prefix_stats.num_hit_tokens >= (len(prompt) + 29) // BLOCK * BLOCK
    engine.check_leaks()
