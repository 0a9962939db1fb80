"""Decode steps on static buffers (engine.decode_graphs): buckets, padding and buffer filling.

On the CPU the static path runs without graphs (decode_graphs="static"): the same buffers, the
same padded buckets, the same outputs as a captured graph replays. On CUDA the graphs themselves
are captured and replayed, against the eager engine and transformers.
"""

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.decode_graphs import DecodeGraphs, PendingTokens, bucket_for, capture_sizes
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.test_correctness import MAX_TOKENS, make_prompts, run_to_completion, transformers_greedy
from tests.kernels.conftest import ENGINE_DEVICES, gpu, requires_cuda


def test_capture_sizes_cover_every_batch_with_little_padding():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(13) == (1, 2, 4, 8, 13)
    sizes = capture_sizes(256)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 256 and len(sizes) == 23
    for n in range(1, 257):
        bucket = bucket_for(n, sizes)
        assert bucket is not None and bucket >= n and bucket - n < 16 and bucket in sizes
        assert bucket == min(s for s in sizes if s >= n)
    assert bucket_for(257, sizes) is None and bucket_for(0, sizes) is None


def engine_for(model_dir, mode, device="cpu", max_num_seqs=13, num_blocks=96, dtype="float32",
               async_scheduling=True, max_num_batched_tokens=256):
    return LLMEngine(EngineConfig(
        model=ModelConfig.from_pretrained(model_dir, dtype=dtype),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        device=device, decode_graphs=mode, async_scheduling=async_scheduling,
    ))


@pytest.fixture
def graph_runs(monkeypatch) -> list[tuple[int, int]]:
    """(decodes, bucket) of every static decode step, run or launched."""
    runs = []
    real = DecodeGraphs._stage

    def spy(self, decodes, fed=None):
        runs.append((len(decodes), bucket_for(len(decodes), self.sizes)))
        return real(self, decodes, fed)

    monkeypatch.setattr(DecodeGraphs, "_stage", spy)
    return runs


@pytest.fixture
def launched(monkeypatch) -> list[tuple[int, list[int] | None]]:
    """Per launched (async) step: its decodes' count, and each one's row in the step before it
    that fed its input (-1: staged from the host), or None when nothing fed it."""
    calls = []
    real = DecodeGraphs.launch

    def spy(self, decodes, feed=None, previous=None, draw=None):
        calls.append((len(decodes), None if feed is None else list(feed)))
        return real(self, decodes, feed, previous, draw)

    monkeypatch.setattr(DecodeGraphs, "launch", spy)
    return calls


def test_static_buffers_only_where_asked(tiny_model_dir):
    assert engine_for(tiny_model_dir, "auto").runner.graphs is None  # no graphs on the CPU
    assert engine_for(tiny_model_dir, "off").runner.graphs is None
    graphs = engine_for(tiny_model_dir, "static").runner.graphs
    assert graphs is not None and not graphs.use_graphs and graphs.sizes == (1, 2, 4, 8, 13)
    with pytest.raises(ValueError, match="decode_graphs must be one of auto, off, static"):
        EngineConfig(model=ModelConfig.from_pretrained(tiny_model_dir), decode_graphs="eager")


@pytest.fixture(scope="module")
def transformers_32(tiny_model_dir):
    """transformers' greedy 32 tokens of make_prompts' 16 prompts (computed once for the module)."""
    prompts = make_prompts(ModelConfig.from_pretrained(tiny_model_dir).vocab_size)
    return prompts, transformers_greedy(tiny_model_dir, prompts, 32)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("device", ENGINE_DEVICES)
def test_greedy_on_padded_buckets_equals_eager_and_transformers(tiny_model_dir, device, async_scheduling, graph_runs,
                                                                launched, transformers_32):
    """16 prompts through 13 slots with preemption: decode batches of many sizes, most padded;
    with async scheduling, runs of decode steps each launched before the one before is read."""
    mode = "auto" if device == "cuda" else "static"
    prompts, expected = transformers_32
    # Requests end at different steps: the decode batch shrinks through the buckets.
    lengths = [4 + (7 * i) % 29 for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths]
    eager = engine_for(tiny_model_dir, "off", device)
    want = run_to_completion(eager, prompts, params)
    assert not graph_runs
    engine = engine_for(tiny_model_dir, mode, device, async_scheduling=async_scheduling)
    assert engine.runner.graphs.use_graphs == (device == "cuda")
    got = run_to_completion(engine, prompts, params)
    for i, (tokens, eager_tokens, (want_tokens, _)) in enumerate(zip(got, want, expected)):
        assert [t.token_id for t in tokens] == [t.token_id for t in eager_tokens] == want_tokens[:lengths[i]], i
    padded = {(n, b) for n, b in graph_runs if n < b}
    assert len(padded) >= 3, graph_runs
    fed = [feed is not None for _, feed in launched]
    if async_scheduling:
        assert fed.count(True) >= 20 and fed.count(False) >= 3, fed
    else:
        assert not fed
    assert engine.scheduler.num_preemptions >= 1
    engine.check_leaks()


def test_padding_rows_write_no_kv(tiny_model_dir, graph_runs):
    """3 decodes in the 4-row bucket: the blocks no request holds stay zero."""
    engine = engine_for(tiny_model_dir, "static", num_blocks=32)
    prompts = make_prompts(ModelConfig.from_pretrained(tiny_model_dir).vocab_size)[2:5]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=6, temperature=0.0))
    held: set[int] = set()
    while engine.has_unfinished():
        held |= {b for r in engine.scheduler.running for b in r.block_ids}
        engine.step()
    assert (3, 4) in graph_runs
    untouched = [b for b in range(32) if b not in held]
    assert untouched and not engine.kv_cache[untouched].any()


def test_sampling_logprobs_and_greedy_rows_in_one_static_step_equal_eager(tiny_model_dir, graph_runs):
    """Seeded sampling, logprobs, penalties and plain greedy rows in the same decode steps: the
    static path gives each its logits row or its argmax as the eager path does."""
    vocab = ModelConfig.from_pretrained(tiny_model_dir).vocab_size
    prompts = make_prompts(vocab, seed=3)[:11]
    kinds = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
             SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2),
             SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7),
             SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, top_p=0.9, seed=3, repetition_penalty=1.2)]
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]
    want = run_to_completion(engine_for(tiny_model_dir, "off"), prompts, params)
    got = run_to_completion(engine_for(tiny_model_dir, "static"), prompts, params)
    assert graph_runs
    for i, (tokens, eager_tokens) in enumerate(zip(got, want)):
        assert [t.token_id for t in tokens] == [t.token_id for t in eager_tokens], f"prompt {i}"
        for t, e in zip(tokens, eager_tokens):
            assert (t.logprob is None) == (e.logprob is None)
            if t.logprob is not None:
                assert abs(t.logprob - e.logprob) < 1e-4
                assert [tid for tid, _ in t.top] == [tid for tid, _ in e.top]


def test_aborts_and_finishes_between_static_steps_leave_nothing(tiny_model_dir, graph_runs):
    engine = engine_for(tiny_model_dir, "static", num_blocks=64)
    prompts = make_prompts(ModelConfig.from_pretrained(tiny_model_dir).vocab_size)[:10]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"a{i}", prompt, SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True))
    for step in range(60):
        engine.step()
        if step % 5 == 4:
            engine.abort(f"a{step // 5}")
        if not engine.has_unfinished():
            break
    for i in range(len(prompts)):
        engine.abort(f"a{i}")
    assert graph_runs
    engine.check_leaks()


def test_static_outputs_are_the_models_logits(tiny_model_dir):
    """One bucket's logits rows equal an eager forward's for the same decodes. The requests ask
    for logprobs, so the eager step gives every row's logits (plain greedy rows would take the
    backend's greedy head where it has one: tokens without logits)."""
    engine = engine_for(tiny_model_dir, "static", max_num_seqs=4)
    prompts = make_prompts(ModelConfig.from_pretrained(tiny_model_dir).vocab_size)[3:6]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"q{i}", prompt, SamplingParams(max_tokens=3, temperature=0.0, logprobs=0))
    while len(engine.scheduler.running) < 3 or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    scheduled = engine.scheduler.schedule()
    assert len(scheduled.decodes) == 3 and not scheduled.prefills
    out = engine.runner.graphs.run(scheduled.decodes)
    assert out.logits.shape == (3, engine.config.model.vocab_size)
    logits, tokens = out.logits.clone(), out.tokens.tolist()
    engine.runner.graphs = None
    eager = engine.runner.execute(scheduled)  # the same K/V written again, then read
    torch.testing.assert_close(logits, eager.logits, rtol=1e-4, atol=1e-4)
    assert tokens == eager.logits.argmax(-1).tolist()


def _drive(engine, script, num_calls):
    """Step the engine num_calls times (or until idle), running script[call](engine) before the
    call where given; returns {request_id: [(first_token_idx, token ids, finish_reason)]}."""
    streams = {}
    for call in range(num_calls):
        if call in script:
            script[call](engine)
        if not engine.has_unfinished():
            break
        for out in engine.step():
            streams.setdefault(out.request_id, []).append(
                (out.first_token_idx, [t.token_id for t in out.new_tokens], out.finish_reason))
    return streams


def _late_stop_params(i: int, kind: str, **fields) -> SamplingParams:
    """greedy: every request greedy; drawn: seeded draws of every truncation, two greedy among them."""
    if kind == "greedy" or i in (3, 6):
        return SamplingParams(temperature=0.0, **fields)
    truncation = (dict(), dict(top_k=12), dict(top_p=0.8), dict(min_p=0.05), dict(top_k=20, top_p=0.9))[i % 5]
    return SamplingParams(temperature=0.9, seed=100 + i, **truncation, **fields)


@pytest.mark.parametrize("kind", ["greedy", "drawn"])
def test_one_step_late_stops_aborts_and_arrivals_give_the_synchronous_results(tiny_model_dir, launched, kind):
    """Stop tokens found one step late, max_tokens never overrun, aborts and new prompts between
    calls while a step is in flight: every request's tokens, indices and finish equal the
    synchronous engine's, and every block comes back. drawn: the launched steps' tokens are the
    sampler's seeded draws on the device (a mixed batch: two rows greedy), as the synchronous
    engine draws them."""
    vocab = ModelConfig.from_pretrained(tiny_model_dir).vocab_size
    prompts = make_prompts(vocab, seed=4)[:9]
    reference = engine_for(tiny_model_dir, "static", async_scheduling=False)
    free_run = run_to_completion(reference, prompts[:4],
                                 [_late_stop_params(i, kind, max_tokens=24, ignore_eos=True) for i in range(4)])
    # Requests 0-3 stop on a token of their own output (its first occurrence at step 5, 9, 14, 20).
    params = []
    for i in range(len(prompts)):
        stop = []
        if i < 4:
            ids = [t.token_id for t in free_run[i]]
            stop = [next(t for k, t in enumerate(ids) if k >= (5, 9, 14, 20)[i] and t not in ids[:k])]
        params.append(_late_stop_params(i, kind, max_tokens=(24, 24, 24, 24, 7, 11, 24, 24, 16)[i],
                                        stop_token_ids=stop, ignore_eos=True))

    def add(i):
        return lambda engine: engine.add_request(f"r{i}", prompts[i], params[i])

    def abort(i):
        return lambda engine: engine.abort(f"r{i}")

    def start(engine):
        for i in range(6):
            add(i)(engine)

    script = {0: start, 12: abort(2), 15: add(6), 17: abort(5), 22: add(7), 23: add(8), 30: abort(0)}
    results = {}
    for mode in ("sync", "async"):
        engine = engine_for(tiny_model_dir, "static", max_num_seqs=8, async_scheduling=mode == "async")
        results[mode] = _drive(engine, script, 200)
        engine.check_leaks()
    assert results["async"] == results["sync"]
    assert sum(feed is not None for _, feed in launched) >= 20
    finishes = {rid: stream[-1][2] for rid, stream in results["sync"].items()}
    assert finishes["r1"] == "stop" and finishes["r4"] == "length" and finishes["r2"] is None
    for rid, stream in results["async"].items():
        assert [index for index, _, _ in stream] == list(range(len(stream))), rid


def test_requests_joining_with_their_kv_in_place_ride_the_next_launch(tiny_model_dir, launched):
    """A decode node's pulled request joins the running with its KV in place and only its next
    token to compute: the step after the one in flight takes it in, its input token staged from
    the host beside the others' fed on the device, instead of the chain of launches stopping for
    a synchronous step. Its tokens are those it gets alone (greedy, and a seeded draw), and every
    stream equals the synchronous engine's."""
    from engine.protocol import TokenLogprob

    model = ModelConfig.from_pretrained(tiny_model_dir)
    prompts = make_prompts(model.vocab_size, seed=6)
    whole = [t for prompt in prompts for t in prompt]
    sources = [whole[:32], whole[40:88]]  # whole blocks of 16: all of each prompt cached
    join_params = [SamplingParams(max_tokens=18, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=18, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)]
    results = {}
    for mode in ("sync", "async"):
        engine = engine_for(tiny_model_dir, "static", max_num_seqs=8, async_scheduling=mode == "async")
        alone = run_to_completion(engine, sources, join_params, prefix="source")  # their prompts' blocks cached
        for i in range(4):
            engine.add_request(f"r{i}", prompts[2 + i], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))

        def join(i, source, num_blocks=None, engine=engine, alone=alone):
            """j{i}: source's request again, its first token given, its prompt's KV from the cache
            (num_blocks: only its first blocks, the rest a prefill chunk: it waits for a synchronous step)."""
            def add(_engine):
                blocks = engine.acquire_cached_prefix(f"j{i}", sources[source], len(sources[source]) // 16)
                assert len(blocks) * 16 == len(sources[source])
                if num_blocks is not None:
                    engine.free_blocks(blocks[num_blocks:])
                    blocks = blocks[:num_blocks]
                engine.add_prefilled_request(f"j{i}", sources[source], join_params[source],
                                             TokenLogprob(alone[source][0].token_id), blocks, 16 * len(blocks))
            return add

        launched.clear()
        streams = _drive(engine, {8: join(0, 0), 13: join(1, 1), 19: join(2, 1, num_blocks=2)}, 200)
        engine.check_leaks()
        for i, source in enumerate((0, 1, 1)):
            got = [t for _, ids, _ in streams[f"j{i}"] for t in ids]
            assert got == [t.token_id for t in alone[source][1:]], (mode, i)
        results[mode] = (streams, [feed for _, feed in launched])
    assert results["async"][0] == results["sync"][0]
    joined_launches = [fed for fed in results["async"][1] if fed is not None and -1 in fed]
    assert len(joined_launches) == 2 and all(fed.count(-1) == 1 for fed in joined_launches), results["async"][1]
    assert results["sync"][1] == []


def test_a_launch_never_decodes_more_requests_than_the_step_budget(tiny_model_dir, launched):
    """More decode-ready running requests than max_num_batched_tokens: a scheduled step decodes the
    first ones only, and the chained launch after it must not take the rest in as if they had
    joined (here six requests join at once with their prompts' KV from the prefix cache)."""
    from engine.protocol import TokenLogprob

    model = ModelConfig.from_pretrained(tiny_model_dir)
    engine = engine_for(tiny_model_dir, "static", max_num_seqs=8, max_num_batched_tokens=4)
    whole = [t for prompt in make_prompts(model.vocab_size, seed=7) for t in prompt]
    sources = [whole[16 * i: 16 * (i + 1)] for i in range(6)]
    firsts = run_to_completion(engine, sources, SamplingParams(max_tokens=1, temperature=0.0), prefix="source")
    for i, source in enumerate(sources):
        blocks = engine.acquire_cached_prefix(f"b{i}", source, 1)
        engine.add_prefilled_request(f"b{i}", source, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                     TokenLogprob(firsts[i][0].token_id), blocks)
    launched.clear()
    while engine.has_unfinished():
        engine.step()
    engine.check_leaks()
    sizes = [num for num, _ in launched]
    assert sizes and max(sizes) == 4, sizes


def test_an_outside_write_waits_for_a_launched_step_still_writing_to_its_blocks(tiny_model_dir, monkeypatch):
    """Async: a request that ends while a launched step computes its next token gives its blocks
    back at once, and that step still writes one KV slot in them. A writer outside the steps (a
    decode node's NIXL read) asking wait_for_late_writes for any of them waits for the step; for
    other blocks it does not."""
    waits = []
    real = PendingTokens.wait
    monkeypatch.setattr(PendingTokens, "wait", lambda self: (waits.append(self), real(self))[1])
    engine = engine_for(tiny_model_dir, "static", max_num_seqs=4, num_blocks=64)
    for i, prompt in enumerate(make_prompts(ModelConfig.from_pretrained(tiny_model_dir).vocab_size)[:2]):
        engine.add_request(f"w{i}", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for _ in range(20):
        engine.step()
        if engine._in_flight is not None:
            break
    in_flight = engine._in_flight
    assert in_flight is not None and len(in_flight.decodes) == 2
    victim, survivor = in_flight.decodes
    blocks = list(victim.block_ids)
    engine.abort(victim.request_id)
    assert in_flight.late_blocks == set(blocks) and engine.block_pool.num_free_blocks > 0
    elsewhere = [b for b in range(64) if b not in blocks and b not in survivor.block_ids]
    waits.clear()
    engine.wait_for_late_writes(elsewhere)
    assert waits == []
    engine.wait_for_late_writes([blocks[-1]])
    assert waits == [in_flight.pending] and not in_flight.late_blocks
    while engine.has_unfinished():
        engine.step()
    engine.check_leaks()


def test_the_device_tables_follow_every_row_sending_only_what_changed(tiny_model_dir, monkeypatch):
    """After every static step each row's device block table is its request's (through
    preemption, re-admission and rows changing hands), and a steady decode step sends the lengths
    and the blocks new since the last step, not the tables."""
    sent = []
    real = DecodeGraphs._copy_in

    def spy(self, size):
        staged = real(self, size)
        sent.append((size, self._num_updates))
        return staged

    monkeypatch.setattr(DecodeGraphs, "_copy_in", spy)
    engine = engine_for(tiny_model_dir, "static", max_num_seqs=8, num_blocks=40, async_scheduling=False)
    graphs = engine.runner.graphs
    prompts = make_prompts(ModelConfig.from_pretrained(tiny_model_dir).vocab_size, seed=6)[2:12]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"t{i}", prompt, SamplingParams(max_tokens=20 + 3 * i, temperature=0.0, ignore_eos=True))
    checked = 0
    while engine.has_unfinished():
        running = [r for r in engine.scheduler.running if r.num_computed_tokens + 1 == r.num_tokens]
        before = len(sent)
        engine.step()
        if len(sent) > before:  # a static step ran: its rows are the decodes, in order
            for row, request in enumerate(running):
                blocks = request.block_ids
                assert graphs._tables[row, : len(blocks)].tolist() == blocks, (row, request.request_id)
            checked += 1
    assert checked >= 10 and engine.scheduler.num_preemptions >= 1
    steady = [k for size, k in sent[1:] if size >= 4]
    assert min(steady) <= 8 + 2, sent  # the lengths and a block or two, not whole tables
    engine.check_leaks()


def test_a_step_whose_staging_failed_leaves_no_row_thinking_its_table_was_sent(tiny_model_dir, monkeypatch):
    """_fill notes a row's blocks as on the device before they are sent: where it fails part way,
    the next step must send every row's table again."""
    engine = engine_for(tiny_model_dir, "static", max_num_seqs=4, async_scheduling=False)
    graphs = engine.runner.graphs
    for i, prompt in enumerate(make_prompts(ModelConfig.from_pretrained(tiny_model_dir).vocab_size, seed=3)[:3]):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    decodes = list(reversed(engine.scheduler.running))  # every row changes hands: each sends its table
    assert len(decodes) == 3 and len({tuple(r.block_ids) for r in decodes}) == 3
    real, calls = DecodeGraphs._add_updates, []

    def failing(self, start, values):
        calls.append(start)
        if len(calls) == 2:
            raise RuntimeError("staging failed")
        real(self, start, values)

    monkeypatch.setattr(DecodeGraphs, "_add_updates", failing)
    with pytest.raises(RuntimeError, match="staging failed"):
        graphs._stage(decodes)
    monkeypatch.setattr(DecodeGraphs, "_add_updates", real)
    graphs._stage(decodes)
    for row, request in enumerate(decodes):
        assert graphs._tables[row, : len(request.block_ids)].tolist() == request.block_ids, row


@gpu
@requires_cuda
def test_on_cuda_a_launch_never_waits_for_the_device(tiny_model_dir, monkeypatch):
    """DecodeGraphs.launch, the async step (staging, the previous step's tokens fed on the device,
    the replay, a draw for sampled rows), under torch's sync debug mode: nothing in it waits for the
    device. The workload runs twice on one engine, the second time under the check, so that first
    uses (a bucket's pinned blocks, the generator) are not taken for per-step work; both runs agree."""
    engine = engine_for(tiny_model_dir, "auto", "cuda", async_scheduling=True)
    prompts = make_prompts(ModelConfig.from_pretrained(tiny_model_dir).vocab_size)[:8]
    params = [SamplingParams(max_tokens=12 + i, temperature=0.0) for i in range(6)]
    params += [SamplingParams(max_tokens=14, temperature=0.8, seed=3),
               SamplingParams(max_tokens=15, temperature=1.0, top_k=5, seed=4)]
    first = run_to_completion(engine, prompts, params)
    checked = []
    real = DecodeGraphs.launch

    def launch_checked(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(args[1] is not None)  # fed by the step before

    monkeypatch.setattr(DecodeGraphs, "launch", launch_checked)
    second = run_to_completion(engine, prompts, params, prefix="again")
    assert [[t.token_id for t in tokens] for tokens in second] == [[t.token_id for t in tokens] for tokens in first]
    assert len(checked) >= 10 and checked.count(True) >= 5, checked
    engine.check_leaks()


@gpu
@requires_cuda
@pytest.mark.parametrize("model_fixture, dtype, transposed", [("tiny_model_dir", "bfloat16", True),
                                                              ("qwen2_tiny_model_dir", "float32", False)])
def test_on_cuda_the_fused_small_batch_layers_decode_as_the_layer_loop(model_fixture, dtype, transposed, request,
                                                                       monkeypatch, graph_runs):
    """The Triton backend's fused small-batch layers (PDSERVE_TRITON_FUSED_DECODE=1), captured in the
    decode graphs: greedy tokens equal to the same engine run eagerly (the same kernels, so in every
    dtype), and in float32 equal to the layer loop's (cuBLAS projections) for 16 prompts in padded
    buckets with preemption; the weights transposed (the backend's default) and as stored (rotary
    and the KV write inside the QKV projection)."""
    from kernels.triton.backend import FUSED_DECODE_ENV, WEIGHTS_ENV
    from kernels.triton.decode_layers import SmallBatchLayers

    monkeypatch.setenv(WEIGHTS_ENV, "transposed" if transposed else "as-stored")
    model_dir = request.getfixturevalue(model_fixture)
    prompts = make_prompts(ModelConfig.from_pretrained(model_dir).vocab_size)
    lengths = [4 + (7 * i) % 29 for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths]
    looped = run_to_completion(engine_for(model_dir, "off", "cuda", dtype=dtype), prompts, params)
    fused_rows, real = [], SmallBatchLayers.run

    def spy(self, hidden, *args):
        fused_rows.append(hidden.shape[0])
        return real(self, hidden, *args)

    monkeypatch.setattr(SmallBatchLayers, "run", spy)
    monkeypatch.setenv(FUSED_DECODE_ENV, "1")
    eager = engine_for(model_dir, "off", "cuda", dtype=dtype)
    assert eager.model.fused_decode is not None and eager.model.fused_decode.rotary_in_qkv == (not transposed)
    want = run_to_completion(eager, prompts, params)
    assert fused_rows, "no eager decode step ran on the fused layers"
    engine = engine_for(model_dir, "auto", "cuda", dtype=dtype)
    assert engine.model.fused_decode is not None and engine.runner.graphs.use_graphs
    got = run_to_completion(engine, prompts, params)
    tokens = [[[t.token_id for t in run] for run in outputs] for outputs in (looped, want, got)]
    assert tokens[2] == tokens[1]
    if dtype == "float32":
        assert tokens[1] == tokens[0]
    assert len({(n, b) for n, b in graph_runs if n < b}) >= 3, graph_runs
    engine.check_leaks()
