"""Scheduler and block pool without a model: fabricated tokens, then a leak check."""

import random

import pytest

from engine.block_pool import BlockPool
from engine.config import SchedulerConfig
from engine.request import FinishReason, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

BLOCK_SIZE = 4


def make_request(request_id: str, num_prompt: int, max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(request_id, list(range(1, num_prompt + 1)), params, max_total_tokens=10_000)


def run_fake_step(scheduler: Scheduler) -> list[Request]:
    """What the engine does after the model: advance progress, append a token, finish."""
    output = scheduler.schedule()
    assert output.num_tokens <= scheduler.config.max_num_batched_tokens
    finished = []
    for request, num_new in output.scheduled():
        request.num_computed_tokens += num_new
        assert len(request.block_ids) * BLOCK_SIZE >= request.num_computed_tokens
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(7)
            if request.num_output_tokens >= request.params.max_tokens:
                scheduler.finish(request, FinishReason.LENGTH)
                finished.append(request)
    return finished


def test_block_pool_allocates_until_short_then_returns_none():
    pool = BlockPool(4)
    first = pool.allocate(3)
    assert sorted(first) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    pool.free(first)
    assert pool.num_free_blocks == 4


def test_block_pool_double_free_raises():
    pool = BlockPool(2)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(ids)


def test_long_prompt_is_chunked_under_token_budget():
    pool = BlockPool(64)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8), pool, BLOCK_SIZE)
    request = make_request("a", num_prompt=30, max_tokens=2)
    scheduler.add_waiting(request)
    chunks = []
    while scheduler.num_unfinished:
        output = scheduler.schedule()
        chunks.append(output.num_tokens)
        for r, n in output.scheduled():
            r.num_computed_tokens += n
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(7)
                if r.num_output_tokens >= r.params.max_tokens:
                    scheduler.finish(r, FinishReason.LENGTH)
    assert chunks == [8, 8, 8, 6, 1]
    assert scheduler.num_chunked_prefill_steps == 3
    assert pool.num_free_blocks == 64


def test_preemption_when_blocks_run_out_and_every_block_comes_back():
    pool = BlockPool(12)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), pool, BLOCK_SIZE)
    requests = [make_request(f"r{i}", num_prompt=8, max_tokens=12) for i in range(4)]
    for r in requests:
        scheduler.add_waiting(r)
    finished = []
    for _ in range(500):
        finished += run_fake_step(scheduler)
        if not scheduler.num_unfinished:
            break
    assert {r.request_id for r in finished} == {r.request_id for r in requests}
    assert all(r.num_output_tokens == 12 for r in requests)
    assert scheduler.num_preemptions > 0
    assert pool.num_free_blocks == 12


def test_preempted_request_keeps_fcfs_order():
    pool = BlockPool(6)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), pool, BLOCK_SIZE)
    requests = [make_request(f"r{i}", num_prompt=8, max_tokens=8) for i in range(3)]
    for r in requests:
        scheduler.add_waiting(r)
    order = []
    while scheduler.num_unfinished:
        order += [r.request_id for r in run_fake_step(scheduler)]
    assert order == ["r0", "r1", "r2"]
    assert pool.num_free_blocks == 6


def test_random_workload_with_aborts_leaks_nothing():
    rng = random.Random(0)
    pool = BlockPool(40)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24), pool, BLOCK_SIZE)
    live: list[Request] = []
    for i in range(60):
        request = make_request(f"r{i}", rng.randint(1, 40), rng.randint(1, 20))
        scheduler.add_waiting(request)
        live.append(request)
        for _ in range(rng.randint(0, 3)):
            for done in run_fake_step(scheduler):
                live.remove(done)
        if live and rng.random() < 0.2:
            victim = live.pop(rng.randrange(len(live)))
            scheduler.finish(victim, FinishReason.ABORT)
    while scheduler.num_unfinished:
        run_fake_step(scheduler)
    assert scheduler.num_preemptions > 0
    assert pool.num_free_blocks == 40


def test_prefilled_finish_hands_blocks_to_caller():
    pool = BlockPool(8)
    scheduler = Scheduler(SchedulerConfig(), pool, BLOCK_SIZE)
    request = make_request("p", num_prompt=9, max_tokens=4)
    scheduler.add_waiting(request)
    output = scheduler.schedule()
    request.num_computed_tokens += output.num_tokens
    scheduler.finish(request, FinishReason.PREFILLED)
    assert len(request.block_ids) == 3
    assert pool.num_free_blocks == 5
    pool.free(request.block_ids)
    assert pool.num_free_blocks == 8


def test_prompt_work_lasts_until_every_prompt_is_computed():
    """has_prompt_work (the decode node borrows no cores while it holds): a queued prompt, one
    mid-prefill, and a preempted one back in the queue; not decoding requests."""
    pool = BlockPool(6)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=12), pool, BLOCK_SIZE)
    assert not scheduler.has_prompt_work
    scheduler.add_waiting(make_request("a", num_prompt=8, max_tokens=8))
    scheduler.add_waiting(make_request("b", num_prompt=8, max_tokens=8))
    assert scheduler.has_prompt_work  # queued
    run_fake_step(scheduler)  # a's 8 tokens and 4 of b's
    assert not scheduler.waiting and scheduler.has_prompt_work  # b mid-prefill
    run_fake_step(scheduler)  # b's rest; a decodes
    assert not scheduler.has_prompt_work  # both decoding
    while not scheduler.num_preemptions:  # 2 + 2 blocks of prompt; the decodes outgrow 6
        run_fake_step(scheduler)
    assert scheduler.waiting[0].request_id == "b" and scheduler.has_prompt_work  # recomputed from its prompt
    while scheduler.num_unfinished:
        run_fake_step(scheduler)
    assert not scheduler.has_prompt_work and pool.num_free_blocks == 6


def test_promised_blocks_count_what_accepted_prompts_still_need():
    """Waiting and chunk-prefilling requests take their blocks per chunk; num_promised_blocks is
    the rest of their prompts' blocks (the proxy counts them as taken), and 0 once decoding."""
    pool = BlockPool(64)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8), pool, BLOCK_SIZE)
    scheduler.add_waiting(make_request("a", num_prompt=30, max_tokens=2))  # 8 blocks of 4
    scheduler.add_waiting(make_request("b", num_prompt=5, max_tokens=2))  # 2 blocks
    assert scheduler.num_promised_blocks == 10 and pool.num_free_blocks == 64
    run_fake_step(scheduler)  # a's first chunk of 8 tokens: 2 blocks taken
    assert pool.num_free_blocks == 62 and scheduler.num_promised_blocks == 8
    while any(r.num_computed_tokens + 1 < r.num_tokens for r in (*scheduler.waiting, *scheduler.running)):
        run_fake_step(scheduler)
    assert scheduler.num_promised_blocks == 0  # both decoding: they hold their prompts' blocks
    while scheduler.num_unfinished:
        run_fake_step(scheduler)
    assert pool.num_free_blocks == 64
