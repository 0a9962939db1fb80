"""The float32 gate/up kernel in the engine (kernels/csrc/f32_gate_up.c): the model's layers get its
copy of the MLP's gate/up weight where the CPU backend's build has it (ProjectionKernels.has_gate_up),
prefill-sized batches run on it with SiLU-and-mul fused, and the greedy tokens equal those of the
oneDNN path it replaces."""

from __future__ import annotations

import random

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels.cpu.linear import ProjectionKernels
from tests.kernels.ops import CPU


def _generate(model_dir) -> tuple[LLM, list[tuple[list[int], list[float]]]]:
    llm = LLM(str(model_dir), dtype="float32", device="cpu", enable_prefix_caching=False)
    rng = random.Random(7)
    prompts = [[rng.randrange(8, 2048) for _ in range(n)] for n in (70, 129, 33, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [(list(o.outputs[0].token_ids), [next(iter(step.values())) for step in o.outputs[0].logprobs])
                 for o in outputs]


def test_prefills_run_the_gate_up_kernel_and_match_onednn(tiny_model_dir, gate_up_calls, monkeypatch):
    llm, fused = _generate(tiny_model_dir)
    has_gate_up = CPU.projections.has_gate_up  # the engine's backend loads the same (best) level
    assert llm.engine.backend.projections.has_gate_up == has_gate_up
    layers = llm.engine.model.weights.layers
    assert all((layer.gate_up.gate_up is not None) == has_gate_up for layer in layers)
    num_layers = len(layers)
    # one step prefills all 237 prompt tokens: every layer but the last (which runs its MLP on the
    # 4 logits rows alone) on the kernel; those rows and the decode steps' 4 take the small-batch one
    assert gate_up_calls == ([(237, True)] * (num_layers - 1) if has_gate_up else [])

    real_init = ProjectionKernels.__init__

    def without_gate_up(self, lib):  # oneDNN's copy instead
        real_init(self, lib)
        self.has_gate_up = False

    monkeypatch.setattr(ProjectionKernels, "__init__", without_gate_up)
    gate_up_calls.clear()
    llm_onednn, onednn = _generate(tiny_model_dir)
    assert all(layer.gate_up.gate_up is None for layer in llm_onednn.engine.model.weights.layers)
    assert gate_up_calls == []
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(fused, onednn):
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)
    llm.engine.check_leaks()
