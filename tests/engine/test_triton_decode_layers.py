"""The Triton backend's fused small-batch decode layers (kernels/triton/decode_layers.py) against the
layer loop they replace, on the same Triton kernels interpreted on the CPU (TRITON_INTERPRET=1): the
layers' output, the residual stream and the K/V written, on a Llama-shaped model, a Qwen2-shaped
one (projection biases) and the real SmolLM2's first two layers (9 query heads over 3 KV heads),
with the weights transposed and as stored (rotary inside the QKV
projection), in float32 (the interpreter rounds to bfloat16 otherwise than a GPU: the
bfloat16 roundings are the kernel tests', tests/kernels/test_small_linear.py); greedy decoding
through an engine equal with and without them; and the switch that turns them on
(PDSERVE_TRITON_FUSED_DECODE). On CUDA the same comparison runs through the engine with CUDA
graphs (test_decode_graphs.py)."""

from __future__ import annotations

import pytest
import torch

import engine.engine as engine_module
from engine.llm import LLM
from engine.model import AttentionMetadata
from engine.sampling_params import SamplingParams
from kernels.reference.backend import ReferenceBackend
from kernels.triton.backend import FUSED_DECODE_ENV, FUSED_MAX_ROWS_ENV, WEIGHTS_ENV, TritonBackend
from kernels.triton.decode_layers import SmallBatchLayers
from kernels.triton.small_linear import SMALL_ROWS
from tests.pdserve.real_model import cached_smollm2

NUM_BLOCKS = 64


def _llm(model_dir, dtype: str, transposed: bool = True) -> LLM:
    """The reference backend keeps its weights as the Triton backend does (TorchProjections): W^T by
    default, else as stored (where the fused layers run rotary inside the QKV projection)."""
    ReferenceBackend.store_transposed = transposed
    try:
        return LLM(str(model_dir), dtype=dtype, device="cpu", kernel_backend="reference", enable_prefix_caching=False,
                   num_blocks=NUM_BLOCKS)
    finally:
        del ReferenceBackend.store_transposed


def _decode_batch(model, block_size: int):
    """Three sequences at positions 4, 9 and 20, each on blocks of its own, one token each."""
    positions = torch.tensor([4, 9, 20])
    tables = torch.tensor([[5, 6], [7, 8], [9, 10]], dtype=torch.int32)
    slots = tables[torch.arange(3), positions // block_size].long() * block_size + positions % block_size
    lens = (positions + 1).to(torch.int32)
    hidden = model.weights.embed_tokens[torch.tensor([10, 300, 1999])]
    return hidden, positions, slots, tables, lens


@pytest.mark.parametrize("transposed", [True, False], ids=["W^T", "W"])
@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "qwen2_tiny_model_dir"])
def test_fused_layers_equal_the_triton_layer_loop(model_fixture, transposed, request):
    llm = _llm(request.getfixturevalue(model_fixture), "float32", transposed)
    _assert_fused_equal_the_loop(llm, transposed, num_layers=None)
    llm.close()


def test_fused_layers_equal_the_loop_on_smollm2s_first_layers(monkeypatch):
    """The real SmolLM2's weights and shape: 9 query heads over 3 KV heads (a group of three), head_dim
    64, hidden 576, MLP 1,536; its first two layers (all thirty interpreted would take minutes)."""
    llm = _llm(cached_smollm2(), "float32", transposed=False)
    config = llm.engine.model.config
    assert (config.num_heads, config.num_kv_heads, config.hidden_size, config.intermediate_size) == (9, 3, 576, 1536)
    _assert_fused_equal_the_loop(llm, False, num_layers=2, monkeypatch=monkeypatch)
    llm.close()


def _assert_fused_equal_the_loop(llm: LLM, transposed: bool, num_layers: int | None, monkeypatch=None) -> None:
    """The fused layers (the model's first num_layers, or all) against the layer loop over the same
    layers on the same interpreted Triton kernels: output, residual and every K/V written."""
    model, cache = llm.engine.model, llm.engine.kv_cache
    model.ops = TritonBackend("cpu")  # the loop on the same (interpreted) kernels
    layers = model.weights.layers[:num_layers]
    if num_layers is not None:
        monkeypatch.setattr(model.weights, "layers", layers)
    fused = SmallBatchLayers.create(layers, model.layer_shape, model.cos_sin_cache)
    assert fused is not None and fused.rotary_in_qkv == (not transposed)
    hidden, positions, slots, tables, lens = _decode_batch(model, cache.shape[3])
    assert fused.takes(hidden, cache)
    generator = torch.Generator().manual_seed(0)
    cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))  # earlier tokens' K/V
    looped_cache = cache.clone()
    out, residual = fused.run(hidden.clone(), positions, slots, tables, lens, cache)
    empty = torch.zeros(0, dtype=torch.int32)
    meta = AttentionMetadata(positions=positions, slot_mapping=slots, num_decode_tokens=3, decode_block_tables=tables,
                             decode_seq_lens=lens, prefill_block_tables=torch.zeros(0, 2, dtype=torch.int32),
                             prefill_cu_query_lens=torch.zeros(1, dtype=torch.int32), prefill_seq_lens=empty)
    looped_out, looped_residual = model._layers(hidden.clone(), meta, looped_cache, None)
    torch.testing.assert_close(out, looped_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(residual, looped_residual, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache, looped_cache, atol=1e-4, rtol=1e-4)


def test_greedy_decoding_on_the_fused_layers_equals_the_loop(tiny_model_dir):
    llm = _llm(tiny_model_dir, "float32", transposed=False)  # all five fused launches, rotary in QKV
    model = llm.engine.model
    fused = SmallBatchLayers.create(model.weights.layers, model.layer_shape, model.cos_sin_cache)
    assert fused.rotary_in_qkv
    rows, real = [], fused.run

    def spy(hidden, *args):
        rows.append(hidden.shape[0])
        return real(hidden, *args)

    fused.run = spy
    prompts = [[5, 6, 7, 8, 9] * 3, list(range(20, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    looped = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    model.fused_decode = fused
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert rows and all(0 < n <= len(prompts) for n in rows), "no decode step ran on the fused layers"
    assert got == looped
    llm.engine.check_leaks()
    llm.close()


def test_the_fused_layers_are_off_unless_turned_on_and_take_only_what_they_can(tiny_model_dir, monkeypatch):
    llm = _llm(tiny_model_dir, "float32")
    model, cache = llm.engine.model, llm.engine.kv_cache
    backend, layers, shape = TritonBackend("cpu"), model.weights.layers, model.layer_shape
    monkeypatch.delenv(FUSED_DECODE_ENV, raising=False)
    assert backend.fused_decode(layers, shape, model.cos_sin_cache) is None
    assert "fused" not in backend.describe()
    monkeypatch.setenv(FUSED_DECODE_ENV, "1")
    fused = backend.fused_decode(layers, shape, model.cos_sin_cache)
    assert isinstance(fused, SmallBatchLayers) and "fused small-batch decode" in backend.describe()
    width = model.config.hidden_size
    assert fused.takes(torch.zeros(SMALL_ROWS, width), cache)
    assert not fused.takes(torch.zeros(SMALL_ROWS + 1, width), cache)
    assert not fused.takes(torch.zeros(1, width, dtype=torch.bfloat16), cache)
    # a smaller largest batch: larger ones run the layer loop; a value outside 1..16 is refused naming it
    monkeypatch.setenv(FUSED_MAX_ROWS_ENV, "4")
    fused = backend.fused_decode(layers, shape, model.cos_sin_cache)
    assert fused.takes(torch.zeros(4, width), cache) and not fused.takes(torch.zeros(5, width), cache)
    assert "up to 4 rows" in backend.describe()
    monkeypatch.setenv(FUSED_MAX_ROWS_ENV, "17")
    with pytest.raises(ValueError, match="PDSERVE_TRITON_FUSED_DECODE_MAX_ROWS must be a whole number from 1 to 16"):
        backend.fused_decode(layers, shape, model.cos_sin_cache)
    # weights in another dtype than the rotary cache's (the model's), or in a form small_linear cannot read
    assert SmallBatchLayers.create(layers, shape, model.cos_sin_cache.to(torch.bfloat16)) is None
    assert SmallBatchLayers.create([], shape, model.cos_sin_cache) is None
    llm.close()


def test_the_weight_form_is_a_switch_a_server_takes_and_a_wrong_one_is_named(tiny_model_dir, monkeypatch):
    """PDSERVE_TRITON_WEIGHTS: what gpu_engine's decode_w and decode_fused phases time is what a node
    started with it runs (the five-launch fused layers need the weights as stored)."""
    monkeypatch.delenv(WEIGHTS_ENV, raising=False)
    assert TritonBackend("cpu").store_transposed
    monkeypatch.setenv(WEIGHTS_ENV, "as-stored")
    backend = TritonBackend("cpu")
    assert not backend.store_transposed and "weights as stored" in backend.describe()
    weight = torch.randn(96, 64)
    assert backend.prepare_linear(weight).weight_t.stride() == (1, 64)  # W's memory, read as W^T
    monkeypatch.setenv(FUSED_DECODE_ENV, "1")
    # an engine on the Triton backend as a GPU node builds it (interpreted here: the name is CUDA's alone)
    monkeypatch.setattr(engine_module, "select_backend", lambda device, name: TritonBackend(device))
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", enable_prefix_caching=False, num_blocks=NUM_BLOCKS)
    assert llm.engine.model.fused_decode is not None and llm.engine.model.fused_decode.rotary_in_qkv
    llm.close()
    monkeypatch.setenv(WEIGHTS_ENV, "W")
    with pytest.raises(ValueError, match="PDSERVE_TRITON_WEIGHTS must be one of transposed, as-stored, got 'W'"):
        TritonBackend("cpu")
