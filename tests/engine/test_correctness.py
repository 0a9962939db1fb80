"""Greedy outputs and logprobs equal Hugging Face transformers', token for token (float32).

Sixteen prompts of 1 to 1,000 tokens go to one engine together, with a block budget small
enough to force chunked prefill and preemption, and to a fresh engine one at a time. The engine
runs on the CPU and, where there is a GPU, on CUDA (the Triton kernels, cuBLAS projections)
against the same transformers run on the CPU.
"""

import random

import pytest
import torch
import transformers

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.model import CausalLM
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from kernels.cpu import greedy_head
from tests.kernels.conftest import ENGINE_DEVICES

PROMPT_LENGTHS = [1, 2, 5, 15, 16, 17, 31, 33, 64, 100, 200, 333, 512, 700, 850, 1000]
MAX_TOKENS = 12


# float32 logprobs are up to ~4e-5 from float64's on these models, either way: the engine on a GPU
# against transformers on the CPU may differ by twice that.
LOGPROB_TOLERANCE = 2e-4


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the lowest ids: special tokens (eos) as prompt tokens are legal but unusual.
    return [[rng.randrange(8, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def transformers_greedy(model_dir, prompts, max_tokens):
    """Per prompt: (token ids, log-softmax of the chosen tokens), one prompt at a time."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            input_ids = torch.tensor([prompt])
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                do_sample=False, output_logits=True, return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = [
                torch.log_softmax(step_logits[0].float(), -1)[t].item()
                for step_logits, t in zip(out.logits, tokens)
            ]
            results.append((tokens, logprobs))
    return results


def make_engine(model_dir, num_blocks, max_num_batched_tokens=256, max_num_seqs=16, device="cpu", dtype="float32"):
    config = EngineConfig(
        model=ModelConfig.from_pretrained(model_dir, dtype=dtype),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        device=device,
    )
    return LLMEngine(config)


def run_to_completion(engine, prompts, params, prefix="r"):
    """params: one SamplingParams for all prompts, or a list of one per prompt."""
    outputs = {f"{prefix}{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt, params[i] if isinstance(params, list) else params)
    while engine.has_unfinished():
        for step in engine.step():
            outputs[step.request_id].extend(step.new_tokens)
    return [outputs[f"{prefix}{i}"] for i in range(len(prompts))]


@pytest.fixture(params=["tiny", "qwen2-tiny"])
def model_dir(request, tiny_model_dir, qwen2_tiny_model_dir):
    return tiny_model_dir if request.param == "tiny" else qwen2_tiny_model_dir


@pytest.fixture(params=ENGINE_DEVICES)
def device(request):
    return request.param


def greedy_head_spy(monkeypatch) -> list[tuple[int, int]]:
    """Records, for each step that took the greedy head (the CPU backend's capability where its
    build has it: plain greedy rows get their argmax without the logits), its rows there and its
    logits rows."""
    rows = []
    head = ModelRunner._head

    def spy(self, hidden, greedy_rows):
        if greedy_rows:
            rows.append((len(greedy_rows), hidden.shape[0]))
        return head(self, hidden, greedy_rows)

    monkeypatch.setattr(ModelRunner, "_head", spy)
    return rows


def has_greedy_head(engine) -> bool:
    """The backend's own probe: whether its build runs the greedy head."""
    return "greedy_head" in getattr(engine.backend, "capabilities", ())


@pytest.mark.parametrize("logprobs", ["all", "none", "half"])
def test_greedy_batch_with_preemption_and_chunking_equals_transformers(model_dir, device, logprobs, monkeypatch):
    """With logprobs every row takes the logits; without, on CPUs with AVX512-BF16 and VNNI, the greedy
    head; with half of the prompts asking for them, each row its own way in the same steps."""
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    prompts = make_prompts(vocab)
    expected = transformers_greedy(model_dir, prompts, MAX_TOKENS)
    # Steps with prefill chunks run the last layer past K/V on their logits rows alone: record
    # (tokens, rows) of each such step, so that the equality below covers that path.
    pruned = []
    last_layer = CausalLM._attend_logits_rows

    def spy(self, query, meta, kv_cache_layer, rows):
        if rows.shape[0] < query.shape[0]:
            pruned.append((query.shape[0], rows.shape[0]))
        return last_layer(self, query, meta, kv_cache_layer, rows)

    monkeypatch.setattr(CausalLM, "_attend_logits_rows", spy)
    greedy_rows = greedy_head_spy(monkeypatch)
    engine = make_engine(model_dir, num_blocks=96, device=device)
    free_at_start = engine.num_free_blocks
    asks = [logprobs == "all" or (logprobs == "half" and i % 2 == 0) for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0 if ask else None) for ask in asks]
    got = run_to_completion(engine, prompts, params)
    takes_greedy_head = has_greedy_head(engine)
    assert sum(g for g, _ in greedy_rows) == (asks.count(False) * MAX_TOKENS if takes_greedy_head else 0)

    num_preemptions = engine.scheduler.num_preemptions
    num_chunked = engine.scheduler.num_chunked_prefill_steps
    print(f"\n{model_dir.name}: {num_preemptions} preemptions, {num_chunked} chunked prefill steps")
    assert num_preemptions >= 1
    assert num_chunked >= 1
    assert any(0 < rows < tokens for tokens, rows in pruned) and any(rows == 0 for _, rows in pruned)
    for i, ((want_tokens, want_logprobs), tokens) in enumerate(zip(expected, got)):
        assert [t.token_id for t in tokens] == want_tokens, f"prompt {i} ({len(prompts[i])} tokens)"
        for t, want in zip(tokens, want_logprobs if asks[i] else []):
            assert abs(t.logprob - want) < LOGPROB_TOLERANCE, f"prompt {i}: logprob {t.logprob} vs {want}"
        assert all(t.logprob is None for t in tokens) or asks[i]
    assert engine.num_free_blocks == free_at_start
    engine.check_leaks()


def test_greedy_each_prompt_alone_equals_transformers(model_dir, device, monkeypatch):
    greedy_rows = greedy_head_spy(monkeypatch)
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    prompts = make_prompts(vocab, seed=1)
    expected = transformers_greedy(model_dir, prompts, MAX_TOKENS)
    engine = make_engine(model_dir, num_blocks=128, max_num_batched_tokens=2048, device=device)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for i, prompt in enumerate(prompts):
        [tokens] = run_to_completion(engine, [prompt], params, prefix=f"alone{i}-")
        assert [t.token_id for t in tokens] == expected[i][0], f"prompt {i} ({len(prompt)} tokens)"
    assert len(greedy_rows) == (len(prompts) * MAX_TOKENS if has_greedy_head(engine) else 0)
    engine.check_leaks()


def test_abort_at_any_point_frees_every_block(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=64, max_num_batched_tokens=64)
    free_at_start = engine.num_free_blocks
    prompts = make_prompts(ModelConfig.from_pretrained(tiny_model_dir).vocab_size)[:12]
    params = SamplingParams(max_tokens=30, temperature=0.0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"a{i}", prompt, params)
    engine.abort("a0")  # waiting
    for step_idx in range(40):
        engine.step()
        if step_idx % 4 == 0:
            engine.abort(f"a{step_idx // 4 + 1}")  # running, mid-prefill, or already gone
    for i in range(len(prompts)):
        engine.abort(f"a{i}")
    assert not engine.has_unfinished()
    assert engine.num_free_blocks == free_at_start


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_head_rows_beside_sampled_logprob_and_prompt_logprob_rows_change_nothing(tiny_model_dir, monkeypatch,
                                                                                       dtype):
    """Plain greedy requests in the same steps as seeded sampling, logprobs and prompt logprobs:
    every request's tokens, logprobs and prompt logprobs equal those of an engine without the
    greedy head (the logits path for every row). bfloat16: the int8 screen, on CPUs with
    AVX512-BF16 and VNNI whose head has bfloat16 panels (no AMX); the engine builds it from
    BF16_MIN_VOCAB outputs, here for the tiny model's 2,048 too."""
    monkeypatch.setattr(greedy_head, "BF16_MIN_VOCAB", 0)
    vocab = ModelConfig.from_pretrained(tiny_model_dir).vocab_size
    prompts = make_prompts(vocab, seed=2)[:10]
    kinds = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
             SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2),
             SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=5),
             SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, prompt_logprobs=1)]
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]
    expect_head = []

    def run(greedy_head: bool):
        engine = make_engine(tiny_model_dir, num_blocks=96, max_num_batched_tokens=128, dtype=dtype)
        expect_head.append(has_greedy_head(engine) and (engine.model.weights.lm_head.f32 if dtype == "float32"
                                                 else engine.model.weights.lm_head.bf16) is not None)
        if not greedy_head:
            engine.model.weights.greedy_head = None
        outputs = {f"m{i}": [] for i in range(len(prompts))}
        prompt_logprobs = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(f"m{i}", prompt, params[i])
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id].extend(out.new_tokens)
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
        engine.check_leaks()
        return outputs, prompt_logprobs

    greedy_rows = greedy_head_spy(monkeypatch)
    with_head = run(greedy_head=True)
    mixed_steps = len(greedy_rows)
    without = run(greedy_head=False)
    assert with_head == without
    assert len(greedy_rows) == mixed_steps  # the second engine took no greedy head
    assert (mixed_steps > 0) == expect_head[0]
    if expect_head[0]:  # steps where greedy rows and logits rows (sampled, prompt spans) met
        assert any(0 < g < total for g, total in greedy_rows)
