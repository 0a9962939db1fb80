"""Steps with prompt tokens on static buffers, their attention between graph pieces (engine.mixed_graphs).

On the CPU the static path runs without graphs (decode_graphs="static"): the same buffers, the same
padded token buckets and the same attention on the step's own metadata as the captured pieces
replay. On CUDA the pieces themselves are captured and replayed, against the eager engine.
"""

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.mixed_graphs import MixedGraphs, mixed_sizes
from engine.sampling_params import SamplingParams
from tests.engine.test_correctness import make_prompts, run_to_completion, transformers_greedy
from tests.kernels.conftest import ENGINE_DEVICES


def test_token_buckets_pad_little():
    assert mixed_sizes(0) == ()
    assert mixed_sizes(20) == (20,)
    assert mixed_sizes(256) == (32, 64, 128, 256)
    assert mixed_sizes(1000) == (32, 64, 128, 256, 512, 768, 1000)
    sizes = mixed_sizes(2048)
    for n in range(1, 2049):
        bucket = min(s for s in sizes if s >= n)
        assert bucket <= max(32, 2 * n - 1) or bucket - n < 256, n


def engine_for(model_dir, mode, device="cpu", mixed_graph_tokens=128, max_num_batched_tokens=160,
               max_num_seqs=6, num_blocks=160):
    return LLMEngine(EngineConfig(
        model=ModelConfig.from_pretrained(model_dir, dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        device=device, decode_graphs=mode, mixed_graph_tokens=mixed_graph_tokens, enable_prefix_caching=False,
    ))


@pytest.fixture
def mixed_runs(monkeypatch) -> list[tuple[int, int, int]]:
    """(tokens, of them decodes, bucket) of every step the mixed graphs ran."""
    runs = []
    real = MixedGraphs.run

    def spy(self, input_ids, meta):
        num = input_ids.shape[0]
        runs.append((num, meta.num_decode_tokens, min(s for s in self.sizes if s >= num)))
        return real(self, input_ids, meta)

    monkeypatch.setattr(MixedGraphs, "run", spy)
    return runs


@pytest.mark.parametrize("device", ENGINE_DEVICES)
def test_steps_with_prompt_tokens_on_graph_pieces_equal_eager_and_transformers(tiny_model_dir, device, mixed_runs):
    """12 prompts through 6 slots under a 160-token budget: prefill chunks alone and beside decodes,
    padded to their buckets, steps past the largest bucket eager; prompt logprobs (rows before the
    last of a chunk) and a seeded draw among them. Tokens equal the eager engine's and transformers'
    greedy ones; logprobs and prompt logprobs equal the eager engine's."""
    mode = "auto" if device == "cuda" else "static"
    prompts = make_prompts(ModelConfig.from_pretrained(tiny_model_dir).vocab_size)[:12]
    params = [SamplingParams(max_tokens=6 + i % 5, temperature=0.0, logprobs=1 if i % 3 == 0 else None,
                             prompt_logprobs=1 if i in (4, 9) else None) for i in range(12)]
    params[7] = SamplingParams(max_tokens=8, temperature=0.9, seed=11)
    eager = engine_for(tiny_model_dir, "off", device)
    assert eager.runner.mixed is None
    want = run_to_completion(eager, prompts, params)
    engine = engine_for(tiny_model_dir, mode, device)
    assert engine.runner.mixed.use_graphs == (device == "cuda")
    got = run_to_completion(engine, prompts, params)
    for i, (tokens, eager_tokens) in enumerate(zip(got, want)):
        assert [t.token_id for t in tokens] == [t.token_id for t in eager_tokens], i
        for t, e in zip(tokens, eager_tokens):
            if e.logprob is not None:
                assert t.logprob == pytest.approx(e.logprob, abs=1e-4), i
    reference = transformers_greedy(tiny_model_dir, [prompts[i] for i in (0, 5, 11)], 10)
    for i, (want_tokens, _) in zip((0, 5, 11), reference):
        assert [t.token_id for t in got[i]] == want_tokens[:len(got[i])], i
    padded = [run for run in mixed_runs if run[0] < run[2]]
    beside_decodes = [run for run in mixed_runs if 0 < run[1] < run[0]]
    assert padded and beside_decodes, mixed_runs
    assert len({bucket for _, _, bucket in mixed_runs}) >= 2, mixed_runs
    engine.check_leaks()


def test_prompt_logprobs_through_the_pieces_equal_eager(tiny_model_dir, mixed_runs):
    """Prompt logprobs take rows other than each chunk's last: the pieces give every row."""
    prompts = make_prompts(ModelConfig.from_pretrained(tiny_model_dir).vocab_size)[6:9]
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    results = {}
    for mode in ("off", "static"):
        engine = engine_for(tiny_model_dir, mode)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"q{i}", prompt, params)
        prompt_logprobs = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
        results[mode] = prompt_logprobs
    assert mixed_runs and results["static"].keys() == results["off"].keys() == {"q0", "q1", "q2"}
    for rid, want in results["off"].items():
        got = results["static"][rid]
        assert [t.token_id for t in got] == [t.token_id for t in want], rid
        for g, w in zip(got, want):
            if w.logprob is not None:
                assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
                assert [t for t, _ in g.top] == [t for t, _ in w.top]


def test_padding_rows_write_no_kv_and_the_real_rows_all_of_theirs(tiny_model_dir, mixed_runs):
    """A 20-token prompt in the 32-token bucket: its own slots get its K/V (as the eager engine
    writes them), and the blocks no request holds stay zero."""
    prompt = make_prompts(ModelConfig.from_pretrained(tiny_model_dir).vocab_size)[3][:15] * 2
    prompt = prompt[:20]
    caches = {}
    for mode in ("off", "static"):
        engine = engine_for(tiny_model_dir, mode, num_blocks=24)
        engine.add_request("p", prompt, SamplingParams(max_tokens=3, temperature=0.0))
        request = engine._requests["p"]
        engine.step()
        blocks = list(request.block_ids)
        caches[mode] = (engine.kv_cache.clone(), blocks)
    (eager_cache, eager_blocks), (cache, blocks) = caches["off"], caches["static"]
    assert mixed_runs == [(20, 0, 32)]
    assert blocks == eager_blocks
    torch.testing.assert_close(cache[blocks], eager_cache[blocks], atol=1e-5, rtol=1e-5)
    untouched = [b for b in range(24) if b not in blocks]
    assert not cache[untouched].any()


def test_none_where_off_or_split(tiny_model_dir):
    assert engine_for(tiny_model_dir, "static", mixed_graph_tokens=0).runner.mixed is None
    assert engine_for(tiny_model_dir, "off").runner.mixed is None
    assert engine_for(tiny_model_dir, "auto").runner.mixed is None  # on the CPU: no graphs of either kind
    with pytest.raises(ValueError, match="mixed_graph_tokens"):
        engine_for(tiny_model_dir, "static", mixed_graph_tokens=-1)


def test_the_captured_attentions_do_not_keep_the_graphs_alive(tiny_model_dir):
    """The pieces' attention closures (as a capture records them) must not point back at the
    MixedGraphs holding them: a cycle would keep the dropped engine's model and KV cache (most of
    a GPU) alive until a cycle collection happens to run."""
    import gc
    import weakref

    engine = engine_for(tiny_model_dir, "static")
    mixed = engine.runner.mixed
    recorded = []
    mixed.cut = lambda run, is_last, kept=recorded: kept.append(run)  # what capture_pieces' cut keeps
    mixed._stage_padding_only()
    mixed._forward(32)
    mixed.cut = None
    assert len(recorded) == ModelConfig.from_pretrained(tiny_model_dir).num_layers
    mixed._pieces[32] = recorded
    alive = weakref.ref(mixed)
    gc.disable()
    try:
        del engine, mixed, recorded
        assert alive() is None
    finally:
        gc.enable()


def test_a_failed_capture_leaves_the_engine_eager(tiny_model_dir, monkeypatch, caplog):
    def broken(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(MixedGraphs, "capture", broken)
    engine = engine_for(tiny_model_dir, "static")
    assert engine.runner.mixed is None and "capture failed" in caplog.text
    [tokens] = run_to_completion(engine, make_prompts(ModelConfig.from_pretrained(tiny_model_dir).vocab_size)[3:4],
                                 SamplingParams(max_tokens=4, temperature=0.0))
    assert len(tokens) == 4
