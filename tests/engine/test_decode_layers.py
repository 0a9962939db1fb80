"""The fused decode layers (the CPU backend's fused_decode capability, kernels/cpu/decode_layers.py:
one C call per decode step where the build has the small-batch projection kernels) against the layer
loop they replace: the same kernels in the same order, so the same bits, on a Llama-shaped and a
Qwen2-shaped model (projection biases); and the same typed errors for positions, slots, block ids and
lengths outside the caches."""

from __future__ import annotations

import random

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, 2048) for _ in range(n)] for n in (5, 17, 33, 70, 129, 3)]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [next(iter(step.values())) for step in o.outputs[0].logprobs])
            for o in outputs]


@pytest.fixture
def fused_calls(monkeypatch) -> list:
    """The row counts of every fused decode step run."""
    from kernels.cpu.decode_layers import DecodeLayers

    calls, real = [], DecodeLayers.run

    def spy(self, hidden, *args):
        calls.append(hidden.shape[0])
        return real(self, hidden, *args)

    monkeypatch.setattr(DecodeLayers, "run", spy)
    return calls


def _expected(llm: LLM, dtype: str) -> bool:
    """The backend's own probe: a fused step where its build has decode_layers and the small-batch
    projection kernel of this dtype."""
    backend = llm.engine.backend
    kernels = backend.projections
    has_linear = kernels.has_amx or kernels.has_bf16 if dtype == "bfloat16" else kernels.has_f32
    return "fused_decode" in backend.capabilities and has_linear


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "qwen2_tiny_model_dir"])
def test_fused_decode_layers_equal_the_python_loop(model_fixture, dtype, request, fused_calls):
    model_dir = request.getfixturevalue(model_fixture)
    llm = LLM(str(model_dir), dtype=dtype, device="cpu", max_num_batched_tokens=64, enable_prefix_caching=False)
    expected = _expected(llm, dtype)
    assert (llm.engine.model.fused_decode is not None) == expected
    prompts = _prompts(3)
    fused = _generate(llm, prompts)
    assert (len(fused_calls) > 0) == expected
    assert all(0 < rows <= len(prompts) for rows in fused_calls)
    llm.engine.model.fused_decode = None
    fused_calls.clear()
    looped = _generate(llm, prompts)
    assert fused_calls == []
    assert fused == looped  # tokens and logprobs, bit for bit
    llm.engine.check_leaks()


def test_fused_decode_layers_reject_what_is_outside_the_caches(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", enable_prefix_caching=False, num_blocks=64)
    model, cache = llm.engine.model, llm.engine.kv_cache
    num_blocks, block_size = cache.shape[0], cache.shape[3]
    rows = 2
    hidden = model.weights.embed_tokens[torch.tensor([10, 11])]
    positions = torch.tensor([3, 5])
    slots = torch.tensor([3, block_size + 5])
    tables = torch.tensor([[0], [1]], dtype=torch.int32)
    lens = torch.tensor([4, 6], dtype=torch.int32)
    if not _expected(llm, "float32"):  # no fused float32 layers in this build: every step takes the loop
        assert model.fused_decode is None
        return
    assert model.fused_decode.takes(hidden, cache)
    before = cache.clone()
    cases = [
        ("position", dict(positions=torch.tensor([3, model.cos_sin_cache.shape[0]]))),
        ("slot", dict(slots=torch.tensor([3, num_blocks * block_size]))),
        ("block id", dict(tables=torch.tensor([[0], [num_blocks]], dtype=torch.int32))),
        ("length", dict(lens=torch.tensor([4, block_size + 1], dtype=torch.int32))),
    ]
    for what, bad in cases:
        args = dict(positions=positions, slots=slots, tables=tables, lens=lens) | bad
        with pytest.raises(ValueError):
            model.fused_decode.run(hidden.clone(), args["positions"], args["slots"], args["tables"], args["lens"],
                                    cache)
        assert torch.equal(cache, before), f"a bad {what} wrote to the cache"
    out, residual = model.fused_decode.run(hidden.clone(), positions, slots, tables, lens, cache)
    assert out.shape == residual.shape == (rows, model.config.hidden_size)
    assert not torch.equal(cache, before)  # the good step wrote its K/V


def test_batches_beyond_the_small_batch_kernels_take_the_loop(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu")
    model, cache = llm.engine.model, llm.engine.kv_cache
    if not _expected(llm, "float32"):
        assert model.fused_decode is None
        return
    assert model.fused_decode.takes(torch.zeros(64, model.config.hidden_size), cache)
    assert not model.fused_decode.takes(torch.zeros(65, model.config.hidden_size), cache)
    assert not model.fused_decode.takes(torch.zeros(8, model.config.hidden_size, dtype=torch.bfloat16), cache)
