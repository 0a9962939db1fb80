"""The bfloat16 option on the CPU (weights, activations and KV cache in bfloat16; the compiled
kernels' bfloat16 paths and oneDNN's bfloat16 projections where the CPU has them), and on CUDA
where there is a GPU (the Triton kernels, cuBLAS projections): its log-
probabilities, prompt (prefill path) and generated (decode path, reading the bfloat16 KV cache),
teacher-forced on the same tokens, are as far from transformers in float32 as transformers' own
bfloat16 is, and (on the CPU) follow transformers in bfloat16 more closely than that. Greedy tokens themselves are
not compared: near-ties of random-weight logits flip under any bfloat16 rounding difference (the
README states the real model's agreement)."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.kernels.conftest import ENGINE_DEVICES

# The engine and transformers round at different points (fused QKV and gate/up; attention, which
# the CPU kernels sum in float32 and round once, where torch's bfloat16 SDPA rounds on the way;
# the AVX512-BF16 and AMX prefill kernels round the probabilities to bfloat16 as SDPA does).
# Measured on the tiny model (mean |logprob difference|, nats): against transformers in
# float32 0.104 (max 0.74) where transformers in bfloat16 is 0.098 (max 0.65); against
# transformers in bfloat16 0.052. Attention computed exactly in float32 and rounded once measured
# the same, 0.104 and 0.063: so closeness to transformers' bfloat16 measures how alike two
# roundings are, and accuracy is judged against float32. (On SmolLM2-135M the engine measured
# 0.050 from float32 against transformers' bfloat16 0.051.) On an H100 (2026-11-26): 0.098 from
# float32 (max 0.44) where transformers' bfloat16 there is 0.099 (max 0.67), but 0.079 from it:
# cuBLAS and the Triton kernels round unlike transformers' CUDA path, so the closeness check is
# the CPU's alone, and a floor on the distance from float32 shows the engine runs in bfloat16.
FLOAT32_MEAN_SHARE = 1.15  # of transformers' bfloat16-vs-float32 mean
FLOAT32_MAX_SHARE = 1.25  # of its max
NOISE_SHARE = 0.75  # of the bfloat16-vs-float32 mean, on the CPU
BFLOAT16_FLOOR_SHARE = 0.5  # of the same: an engine that ran in float32 would be ~0 from float32


@pytest.mark.parametrize("device", ENGINE_DEVICES)
def test_bfloat16_logprobs_match_transformers_in_bfloat16(tiny_model_dir, device):
    rng = random.Random(5)
    prompts = [[rng.randrange(8, 2048) for _ in range(n)] for n in (7, 40, 130)]
    llm = LLM(str(tiny_model_dir), dtype="bfloat16", device=device, max_num_batched_tokens=64,
              num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    # transformers on the engine's device: its bfloat16 rounds as that device's kernels do (cuBLAS
    # and oneDNN differ), which the last assertion compares against.
    models = {dtype: transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).to(device).eval()
              for dtype in (torch.bfloat16, torch.float32)}
    diffs, diffs32, noise = [], [], []
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        tokens = prompt + completion.token_ids
        with torch.inference_mode():
            want, want32 = (torch.log_softmax(models[d](torch.tensor([tokens], device=device)).logits[0].float(), -1)
                            for d in (torch.bfloat16, torch.float32))
        got = [entry.logprob for entry in output.prompt_logprobs[1:]]  # prompt tokens 1..n-1
        got += [next(iter(step.values())) for step in completion.logprobs]  # each generated token
        assert len(got) == len(tokens) - 1
        for pos in range(1, len(tokens)):
            diffs.append(abs(got[pos - 1] - want[pos - 1, tokens[pos]].item()))
            diffs32.append(abs(got[pos - 1] - want32[pos - 1, tokens[pos]].item()))
            noise.append(abs(want[pos - 1, tokens[pos]].item() - want32[pos - 1, tokens[pos]].item()))
    mean, mean32, mean_noise = (sum(d) / len(d) for d in (diffs, diffs32, noise))
    print(f"\n{device}: mean |diff| from transformers float32 {mean32:.4f} (its bfloat16 {mean_noise:.4f}), "
          f"from its bfloat16 {mean:.4f}; max from float32 {max(diffs32):.4f} (its bfloat16 {max(noise):.4f})")
    assert mean32 < FLOAT32_MEAN_SHARE * mean_noise, f"mean |diff| from float32 {mean32:.4f}, tf {mean_noise:.4f}"
    worst, worst_noise = max(diffs32), max(noise)
    assert worst < FLOAT32_MAX_SHARE * worst_noise, f"max |diff| from float32 {worst:.4f}, tf {worst_noise:.4f}"
    assert mean32 > BFLOAT16_FLOOR_SHARE * mean_noise, f"mean |diff| from float32 {mean32:.4f}: not bfloat16?"
    if device == "cpu":
        assert mean < NOISE_SHARE * mean_noise, f"mean |diff| {mean:.4f}, bfloat16 vs float32 {mean_noise:.4f}"
    llm.engine.check_leaks()
