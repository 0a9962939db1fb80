"""Tensor parallelism on the CPU (gloo, one worker process per extra rank): the shards cover the
model exactly once; a TP=2 engine's greedy output equals transformers' (float32, with chunked
prefill and preemption) on tiny, small (SmolLM2's shape: 9 heads over 2 ranks split unevenly, by
whole GQA groups) and qwen2-tiny (QKV biases), and its seeded sampling equals TP=1's; a rank
that dies fails the engine at its next step instead of hanging it. Its pure decode steps on the
static decode path equal transformers too, and a worker's KV cache is the memory rank 0 allocated
for it. The CUDA cases (the ranks sharing one GPU: tp_group.ranks_share_gpu) run in
benchmarks/gpu_checks.sh: the decode steps captured as graphs between the collectives, and the
cache handed over as a CUDA IPC handle."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.protocol import Role
from engine.sampling_params import SamplingParams
from engine.tp_group import TensorParallelError
from engine.tp_shard import check_tensor_parallel, local_model_config, tp_shard
from tests.conftest import REPO, _cached_model, child_env, is_alive
from tests.engine.test_correctness import run_to_completion, transformers_greedy
from tests.kernels.conftest import ENGINE_DEVICES

# Sixteen prompts; the block budget below is small enough to preempt, the token budget to chunk.
PROMPT_LENGTHS = [1, 2, 5, 9, 15, 16, 17, 24, 31, 33, 40, 48, 64, 80, 100, 120]
MAX_TOKENS = 4
# float32 summed in another order (the ranks' partial sums) over small's 30 layers: 1.2e-4 seen
LOGPROB_TOLERANCE = 5e-4


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def make_engine(model_dir, tensor_parallel_size: int, num_blocks: int = 20, **fields) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig.from_pretrained(model_dir),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
        tensor_parallel_size=tensor_parallel_size,
        **fields,
    ))


@pytest.fixture(scope="module")
def small_model_dir():
    return _cached_model("small")


@pytest.mark.parametrize(("heads", "kv_heads", "size"), [(4, 2, 2), (9, 3, 2), (9, 3, 3), (4, 2, 4), (8, 2, 8),
                                                         (32, 8, 4), (6, 6, 4)])
def test_shards_cover_every_head_row_and_token_once(tiny_model_dir, heads, kv_heads, size):
    base = ModelConfig.from_pretrained(tiny_model_dir)
    model = base.__class__(**{**base.__dict__, "num_heads": heads, "num_kv_heads": kv_heads})
    check_tensor_parallel(model, size)
    shards = [tp_shard(model, rank, size) for rank in range(size)]
    group = heads // kv_heads
    assert [h for s in shards for h in s.q_heads] == list(range(heads))
    assert [i for s in shards for i in s.intermediate] == list(range(model.intermediate_size))
    assert [t for s in shards for t in s.vocab] == list(range(model.vocab_size))
    for s in shards:
        assert s.q_heads and s.kv_heads
        # each rank attends with its own KV heads only, in the model's GQA ratio
        assert {q // group for q in s.q_heads} == set(s.kv_heads)
        assert len(s.q_heads) == group * len(s.kv_heads) or len(s.kv_heads) == 1
    assert {k for s in shards for k in s.kv_heads} == set(range(kv_heads))


@pytest.mark.parametrize(("heads", "kv_heads", "size", "says"), [(4, 2, 3, "multiple of the model's 2 KV heads"),
                                                                 (4, 4, 8, "more than the model's 4 attention"),
                                                                 (4, 2, 0, "must be >= 1")])
def test_a_model_that_does_not_split_is_refused_naming_the_numbers(tiny_model_dir, heads, kv_heads, size, says):
    base = ModelConfig.from_pretrained(tiny_model_dir)
    model = base.__class__(**{**base.__dict__, "num_heads": heads, "num_kv_heads": kv_heads})
    with pytest.raises(ValueError, match=says):
        EngineConfig(model=model, tensor_parallel_size=size)


@pytest.mark.parametrize("preset", ["tiny", "small", "qwen2-tiny"])
def test_tp2_greedy_with_preemption_and_chunking_equals_transformers(preset, tiny_model_dir, qwen2_tiny_model_dir,
                                                                     request):
    model_dir = {"tiny": tiny_model_dir, "qwen2-tiny": qwen2_tiny_model_dir}.get(preset) or \
        request.getfixturevalue("small_model_dir")
    prompts = make_prompts(ModelConfig.from_pretrained(model_dir).vocab_size)
    expected = transformers_greedy(model_dir, prompts, MAX_TOKENS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
    one_rank = make_engine(model_dir, 1)
    by_one_rank = [[t.token_id for t in tokens] for tokens in run_to_completion(one_rank, prompts, params)]
    assert by_one_rank == [tokens for tokens, _ in expected]  # TP=1 equals transformers, and TP=2 both
    engine = make_engine(model_dir, 2)
    try:
        # split for real: rank 0 holds its part of the heads, a worker process the rest
        full = ModelConfig.from_pretrained(model_dir)
        assert engine.model.config.num_heads < full.num_heads and len(engine.ranks._processes) == 1
        got = run_to_completion(engine, prompts, params)
        assert engine.scheduler.num_preemptions >= 1
        assert engine.scheduler.num_chunked_prefill_steps >= 1
        for i, ((want_tokens, want_logprobs), tokens) in enumerate(zip(expected, got)):
            assert [t.token_id for t in tokens] == want_tokens, f"prompt {i} ({len(prompts[i])} tokens)"
            for t, want in zip(tokens, want_logprobs):
                assert abs(t.logprob - want) < LOGPROB_TOLERANCE, f"prompt {i}: logprob {t.logprob} vs {want}"
        engine.check_leaks()
    finally:
        engine.close()


def test_sums_too_big_for_the_shared_memory_slots_go_over_gloo_and_agree(tiny_model_dir, monkeypatch):
    """8 KiB slots: the decode steps' sums (6 rows of 1 KiB) go through shared memory, the prefill
    chunks' (up to 64 rows) over gloo; the tokens are transformers'."""
    from engine import tp_group, tp_shm

    monkeypatch.setattr(tp_shm, "SLOT_BYTES", 8192)
    calls = {"channel": 0, "gloo": 0}
    channel_all_reduce, gloo_wait = tp_shm.ShmChannel.all_reduce, tp_group.TPGroup._wait

    def counted(name, real):
        def call(*args):
            calls[name] += 1
            return real(*args)
        return call

    monkeypatch.setattr(tp_shm.ShmChannel, "all_reduce", counted("channel", channel_all_reduce))
    monkeypatch.setattr(tp_group.TPGroup, "_wait", counted("gloo", gloo_wait))
    prompts = make_prompts(ModelConfig.from_pretrained(tiny_model_dir).vocab_size, seed=4)[:6]
    expected = transformers_greedy(tiny_model_dir, prompts, MAX_TOKENS)
    engine = make_engine(tiny_model_dir, 2, num_blocks=64)
    try:
        got = run_to_completion(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    finally:
        engine.close()
    assert [[t.token_id for t in tokens] for tokens in got] == [tokens for tokens, _ in expected]
    assert calls["channel"] > 0 and calls["gloo"] > 0, calls


class _CountedGroup:
    """A one-rank gloo group that counts the collectives it runs and the elements they carry."""

    def __init__(self) -> None:
        import datetime

        import torch.distributed as dist

        self.group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
        self.calls: list[tuple[str, int]] = []

    def allreduce(self, tensors, options):
        self.calls.append(("allreduce", tensors[0].numel()))
        return self.group.allreduce(tensors, options)

    def gather(self, outputs, inputs, options):
        self.calls.append(("gather", inputs[0].numel()))
        return self.group.gather(outputs, inputs, options)


def test_collectives_of_nothing_still_meet(tiny_model_dir):
    """A step that samples nothing (a prompt's chunk before its last) runs its last layer's sums and
    the vocabulary gather on no rows; each still runs a collective (of one element), since NCCL
    skips an empty one and nothing would then order a worker's last KV writes before rank 0's
    synchronize (LLMEngine.wait_for_kv_writes)."""
    from engine.tp_group import TPGroup

    model = ModelConfig.from_pretrained(tiny_model_dir)
    counted = _CountedGroup()
    group = TPGroup(tp_shard(model, 0, 1), model.vocab_size, counted)
    empty = torch.empty(0, model.hidden_size)
    assert group.all_reduce(empty) is empty
    logits = group.gather_vocab(torch.empty(0, model.vocab_size))
    assert logits.shape == (0, model.vocab_size)
    assert counted.calls == [("allreduce", 1), ("allreduce", 1)]
    assert torch.equal(group.gather_vocab(torch.ones(2, model.vocab_size)), torch.ones(2, model.vocab_size))
    assert counted.calls[-1] == ("gather", 2 * model.vocab_size)


def test_a_rank_says_it_loaded_before_its_first_collective(tiny_model_dir):
    """NCCL sets its communicator up at the first collective (the block count's minimum) and waits
    there for every rank without a timeout: rank 0 must learn of a worker that failed to load
    before it, so each rank reports (or, rank 0, waits for) "loaded" first."""
    from engine.tp_ranks import build_rank
    from kernels.select import select_backend

    model = ModelConfig.from_pretrained(tiny_model_dir)
    events = []

    class Group:
        shard = tp_shard(model, 0, 1)

        def min_int(self, value):
            events.append("min_int")
            return value

    config = EngineConfig(model=model, cache=CacheConfig(block_size=16, num_blocks=8))
    built = build_rank(config, select_backend("cpu", "reference"), Group(), loaded=lambda: events.append("loaded"))
    assert events == ["loaded", "min_int"] and built.num_blocks == 8


def test_seeded_sampling_and_logprobs_are_those_of_one_rank(tiny_model_dir):
    prompts = make_prompts(ModelConfig.from_pretrained(tiny_model_dir).vocab_size, seed=3)[:8]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, seed=100 + i, logprobs=2,
                             prompt_logprobs=1 if i % 3 == 0 else None) for i in range(len(prompts))]
    results = []
    for size in (1, 2):
        engine = make_engine(tiny_model_dir, size, num_blocks=128)
        try:
            results.append(run_to_completion(engine, prompts, params))
        finally:
            engine.close()
    one, two = results
    assert [[t.token_id for t in r] for r in one] == [[t.token_id for t in r] for r in two]
    for a, b in zip(one, two):
        for x, y in zip(a, b):
            assert abs(x.logprob - y.logprob) < 1e-4
            assert [tok for tok, _ in x.top] == [tok for tok, _ in y.top]


def test_a_dead_rank_fails_the_next_step_and_the_engine_stays_failed(tiny_model_dir):
    engine = make_engine(tiny_model_dir, 2)
    try:
        prompt = make_prompts(2000)[5]
        run_to_completion(engine, [prompt], SamplingParams(max_tokens=2, temperature=0.0))
        [worker] = engine.ranks._processes
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        engine.add_request("after", prompt, SamplingParams(max_tokens=2, temperature=0.0))
        with pytest.raises(TensorParallelError, match="rank 1 .* exited with code -9"):
            engine.step()
        with pytest.raises(TensorParallelError, match="failed earlier"):
            engine.step()
    finally:
        engine.close()


def test_workers_leave_signals_to_rank_0(tiny_model_dir):
    """A supervisor's SIGTERM to a node's process group (pdserve up) drains the node, which steps on
    until it stops its workers itself; a terminal's Ctrl-C reaches the workers too."""
    engine = make_engine(tiny_model_dir, 2)
    try:
        prompt = make_prompts(2000)[5]
        before = run_to_completion(engine, [prompt], SamplingParams(max_tokens=3, temperature=0.0))
        [worker] = engine.ranks._processes
        for sig in (signal.SIGTERM, signal.SIGINT):
            os.kill(worker.pid, sig)
        time.sleep(0.5)  # NOTE: time for a worker that took them to end
        assert run_to_completion(engine, [prompt], SamplingParams(max_tokens=3, temperature=0.0)) == before
        assert worker.poll() is None
    finally:
        engine.close()


def test_a_nodes_engine_whose_worker_is_lost_while_nothing_steps_ends_its_process(tiny_model_dir):
    """A node's engine (lost_rank_ends_process) whose main thread never runs into the lost rank (idle,
    or waiting in an NCCL collective for it) exits 1 within the grace instead of waiting on it."""
    child = textwrap.dedent(f"""
        import time
        from tests.engine.test_tensor_parallel import make_engine
        engine = make_engine({str(tiny_model_dir)!r}, 2, lost_rank_ends_process=True)
        print(engine.ranks._processes[0].pid, flush=True)
        time.sleep(300)  # a main thread that never gets back to the engine
    """)
    process = subprocess.Popen([sys.executable, "-c", child], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        worker = int(process.stdout.readline())
        os.kill(worker, signal.SIGKILL)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 1
    assert f"rank 1 (pid {worker}) exited with code -9" in err and "ending this node's process" in err


@pytest.mark.parametrize("ends_process", [False, True])
def test_a_worker_lost_while_rank_0_waits_in_its_first_collective_ends_the_process(tiny_model_dir, ends_process):
    """NCCL's first collective (the block count's minimum) waits for every rank without a timeout:
    a worker lost there ends rank 0's process within the start's grace, for a node's engine and an
    offline one alike, instead of leaving it waiting. Here rank 0's first collective never returns."""
    child = textwrap.dedent(f"""
        import os, signal, time
        import engine.tp_ranks as tp_ranks
        from engine.tp_group import TPGroup
        from tests.engine.test_tensor_parallel import make_engine
        tp_ranks.START_LOST_RANK_GRACE_S = 2.0
        spawned = []
        spawn = tp_ranks._spawn_workers
        tp_ranks._spawn_workers = lambda *a: spawned.append(spawn(*a)) or spawned[-1]

        def min_int(self, value):  # a collective waiting for a rank that is gone
            [worker] = spawned[0][0]
            print(worker.pid, flush=True)
            os.kill(worker.pid, signal.SIGKILL)
            time.sleep(300)

        TPGroup.min_int = min_int
        make_engine({str(tiny_model_dir)!r}, 2, lost_rank_ends_process={ends_process})
    """)
    process = subprocess.Popen([sys.executable, "-c", child], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        worker = int(process.stdout.readline())
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 1
    assert f"rank 1 (pid {worker}) exited with code -9 while the group was starting" in err


def test_a_worker_whose_rank_0_is_gone_ends_although_it_is_busy():
    """engine.tp_ranks._watch_parent: a worker stuck in a step (a collective waiting for rank 0) ends when
    rank 0's process does."""
    grandchild = ("import sys, threading, time; from engine.tp_ranks import _watch_parent; "
                  "threading.Thread(target=_watch_parent, args=(int(sys.argv[1]),), daemon=True).start(); "
                  "print('watching', flush=True); time.sleep(300)")
    parent = textwrap.dedent(f"""
        import os, subprocess, sys, time
        worker = subprocess.Popen([sys.executable, "-c", {grandchild!r}, str(os.getpid())])
        print(worker.pid, flush=True)
        time.sleep(300)
    """)
    process = subprocess.Popen([sys.executable, "-c", parent], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        worker = int(process.stdout.readline())
        assert process.stdout.readline() == "watching\n"
        process.kill()
        process.wait()
        deadline = time.monotonic() + 60
        while is_alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not is_alive(worker)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


def test_the_benchmark_times_both_sizes_and_records_their_ratio(tiny_model_dir, tmp_path, monkeypatch):
    from benchmarks import tensor_parallel

    monkeypatch.setenv("PDSERVE_RESULTS_DIR", str(tmp_path))
    assert tensor_parallel.main(["--smoke", "--model", str(tiny_model_dir)]) == 0
    [record] = tmp_path.glob("tensor_parallel-*.json")
    result = json.loads(record.read_text())["result"]
    assert result["sizes"] == [1, 2] and list(result["summary"]) == ["1", "2"]
    assert result["summary"]["1"]["decode_over_base"] == {"1": 1.0}
    assert result["summary"]["2"]["decode_step_ms"]["1"] > 0 and result["summary"]["2"]["prefill_step_ms"] > 0


def test_a_shared_cache_past_the_free_room_is_refused_in_one_line(tiny_model_dir, tmp_path, monkeypatch):
    from engine import kv_cache

    model = ModelConfig.from_pretrained(tiny_model_dir)
    monkeypatch.setattr(kv_cache.os, "statvfs", lambda _: os.statvfs_result((4096, 4096, 10, 10, 10, 10, 10, 10, 0,
                                                                              255)))
    with pytest.raises(ValueError, match=r"does not fit in .* \(0\.00 GiB free\): give it more room"):
        kv_cache.map_shared_kv_cache(model, 64, 16, str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()


def test_the_longest_prefill_chunk_reaches_the_backend_from_the_host(tiny_model_dir, monkeypatch):
    """Each prefill attention call gets its longest chunk as a host int (a GPU backend reads
    nothing back per layer): from the runner, and from a worker rank's unpacked step alike."""
    from engine import tp_ranks

    engine = make_engine(tiny_model_dir, 1, num_blocks=64)
    seen = []
    real = engine.backend._prefill_attention

    def spy(query, kv_cache_layer, block_tables, cu, seq_lens, scale, max_query_len):
        seen.append((int((cu[1:] - cu[:-1]).max()), max_query_len))
        return real(query, kv_cache_layer, block_tables, cu, seq_lens, scale, max_query_len)

    monkeypatch.setattr(engine.backend, "_prefill_attention", spy)
    prepared = []
    real_prepare = engine.runner._prepare_host

    def prepare(scheduled):
        batch = real_prepare(scheduled)
        prepared.append(([n for _, n in scheduled.prefills], batch))
        return batch

    monkeypatch.setattr(engine.runner, "_prepare_host", prepare)
    for i, prompt in enumerate(make_prompts(engine.config.model.vocab_size)[8:14]):
        engine.add_request(f"c{i}", prompt, SamplingParams(max_tokens=3, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    assert seen and all(longest == given for longest, given in seen), seen
    chunks, batch = prepared[0]
    assert batch.meta.prefill_max_query_len == max(chunks) and len(set(chunks)) > 1
    packed = tp_ranks._pack_step(batch.input_ids, batch.meta, batch.logits_indices)
    assert tp_ranks._unpack_step(packed, "cpu")[1].prefill_max_query_len == max(chunks)
    assert all(b.meta.prefill_max_query_len == 0 for c, b in prepared if not c)  # decode-only steps


@pytest.mark.parametrize("device", ENGINE_DEVICES)
def test_a_cache_rank_0_allocates_is_the_memory_its_worker_opens(tiny_model_dir, tmp_path, device):
    """Rank 0 allocates a worker's cache (the one NIXL agent registers its own memory) and hands it
    over: the worker's process opens that very memory (a shared file on the CPU, a CUDA IPC handle
    on a GPU), so what either writes the other reads."""
    from engine.kv_cache import allocate_kv_cache
    from engine.tp_ranks import _export_cache

    config = make_engine_config(tiny_model_dir, 2, device)
    local = local_model_config(config.model, tp_shard(config.model, 1, 2))
    path = str(tmp_path / "kv-rank1") if device == "cpu" else None
    cache = allocate_kv_cache(local, 8, 16, device, shared_file=path)
    cache[3] = 1.0
    if cache.is_cuda:
        torch.cuda.synchronize()
    (tmp_path / "handle").write_bytes(pickle.dumps((_export_cache(cache, path), config)))
    child = textwrap.dedent(f"""
        import pickle, sys, torch
        from engine.tp_ranks import _import_cache
        handle, config = pickle.loads(open({str(tmp_path / "handle")!r}, "rb").read())
        cache = _import_cache(handle, config, 1, 8)
        assert tuple(cache.shape) == {tuple(cache.shape)} and cache.stride() == {cache.stride()}, cache.stride()
        assert bool((cache[3] == 1.0).all()) and not bool(cache[4].any())
        cache[5] = 2.0
        if cache.is_cuda:
            torch.cuda.synchronize()
    """)
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120, cwd=REPO,
                   env=child_env())
    assert bool((cache[5] == 2.0).all()) and bool((cache[3] == 1.0).all()) and not bool(cache[4].any())


def make_engine_config(model_dir, tensor_parallel_size: int, device: str) -> EngineConfig:
    return EngineConfig(model=ModelConfig.from_pretrained(model_dir), cache=CacheConfig(block_size=16, num_blocks=8),
                        device=device, tensor_parallel_size=tensor_parallel_size, role=Role.DECODE)


def test_ranks_share_the_engines_gpu_and_split_its_budget_only_when_asked(tiny_model_dir, monkeypatch):
    """PDSERVE_TP_SHARE_GPU=1 (a one-GPU machine's test bed): every rank on the engine's GPU, the
    budget split between them as on the CPU; else one GPU per rank, each its own budget."""
    from engine.kv_cache import block_size_bytes, num_cache_blocks
    from engine.tp_group import SHARE_GPU_VARIABLE
    from engine.tp_ranks import rank_device

    model = ModelConfig.from_pretrained(tiny_model_dir)
    cache = CacheConfig(block_size=16, kv_cache_memory_bytes=64 * block_size_bytes(model, 16))
    monkeypatch.delenv(SHARE_GPU_VARIABLE, raising=False)
    assert [rank_device("cuda:1", r) for r in range(3)] == ["cuda:1", "cuda:2", "cuda:3"]
    assert num_cache_blocks(model, cache, "cuda:1", 2) == 64
    monkeypatch.setenv(SHARE_GPU_VARIABLE, "1")
    assert [rank_device("cuda:1", r) for r in range(3)] == ["cuda:1"] * 3
    assert rank_device("cuda", 1) == "cuda:0"  # an index: torch.cuda.set_device takes no bare "cuda"
    assert num_cache_blocks(model, cache, "cuda:1", 2) == 32
    assert rank_device("cpu", 1) == "cpu"


@pytest.mark.parametrize("device", ENGINE_DEVICES)
@pytest.mark.parametrize("preset", ["tiny", "qwen2-tiny"])
def test_tp2_static_decode_path_equals_transformers(preset, device, tiny_model_dir, qwen2_tiny_model_dir,
                                                     monkeypatch):
    """A split model's pure decode steps on the static decode path (on a GPU: each rank's step
    captured as graphs between its collectives, the two ranks sharing the GPU): rank 0 stages each
    step and the worker replays the same buffers, in padded buckets of many sizes, with
    preemption; greedy equals transformers."""
    from engine.decode_graphs import DecodeGraphs
    from engine.tp_group import SHARE_GPU_VARIABLE

    if device == "cuda":
        monkeypatch.setenv(SHARE_GPU_VARIABLE, "1")  # the worker inherits it

    model_dir = {"tiny": tiny_model_dir, "qwen2-tiny": qwen2_tiny_model_dir}[preset]
    staged = []
    real = DecodeGraphs._stage
    monkeypatch.setattr(DecodeGraphs, "_stage", lambda self, decodes, fed=None: staged.append(len(decodes)) or
                        real(self, decodes, fed))
    prompts = make_prompts(ModelConfig.from_pretrained(model_dir).vocab_size, seed=3)
    lengths = [4 + (5 * i) % 23 for i in range(len(prompts))]  # requests end at different steps
    expected = transformers_greedy(model_dir, prompts, max(lengths))
    engine = LLMEngine(EngineConfig(
        model=ModelConfig.from_pretrained(model_dir), cache=CacheConfig(block_size=16, num_blocks=24),
        scheduler=SchedulerConfig(max_num_seqs=13, max_num_batched_tokens=64), tensor_parallel_size=2,
        device=device, decode_graphs="auto" if device == "cuda" else "static",
    ))
    try:
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.use_graphs == (device == "cuda") and not engine.async_decodes.enabled
        got = run_to_completion(engine, prompts, [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths])
        for i, ((want, _), tokens, n) in enumerate(zip(expected, got, lengths)):
            assert [t.token_id for t in tokens] == want[:n], f"prompt {i}"
        assert engine.scheduler.num_preemptions >= 1
        assert len(set(staged)) >= 5, staged  # decode batches of many sizes, most padded
        engine.check_leaks()
    finally:
        engine.close()
