"""An engine's warm-up before serving: throwaway prompts that pay its one-time costs."""

from __future__ import annotations

import torch

from engine.engine import LLMEngine, PrefillRate
from engine.grammar import warm_up_masking
from engine.protocol import num_blocks_for
from engine.request import FinishReason
from engine.sampling_params import SamplingParams


def warm_up(engine: LLMEngine, num_tokens: int | None = None, measure_warm: bool | None = None) -> None:
    """Run throwaway prompts of num_tokens in all (by default one full step: the scheduler's
    max_num_batched_tokens) before serving, twice: one-time costs (kernel builds, and the
    memory a full step's activations take) happen here, and prefill_rate starts from a
    measurement. The prompts are up to max_total_tokens - 2 tokens each, each with a first
    token of its own, and the first run computes them in one step where the cache allows (a
    smaller warm-up left a full chunk's first run page-faulting its larger activations). Call
    only while the engine has no requests; leaves no block allocated. On CUDA, structured
    output's masking is warmed up too (engine.grammar.warm_up_masking). measure_warm (default:
    on CUDA, where the first run's time is mostly Triton compiling its kernels): prefill_rate is
    measured afresh on a third run of other prompts (the second's are cached prefixes), warm."""
    budget = engine.config.scheduler.max_num_batched_tokens if num_tokens is None else num_tokens
    longest = max(1, engine.max_total_tokens - 2)  # room for the 2 output tokens
    prompts: list[list[int]] = []
    free_blocks = engine.block_pool.num_blocks
    while budget > 0:
        length = min(budget, longest, (free_blocks - 1) * engine.block_size - 2)
        if length < 1:
            break
        first = len(prompts)
        prompts.append([(first + t) % engine.config.model.vocab_size for t in range(length)])
        free_blocks -= num_blocks_for(length + 2, engine.block_size)
        budget -= length
    if not prompts:
        prompts = [[0]]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    # Every other prompt of the first two runs draws its tokens (seeded, truncated): the sampler's
    # device path and its pinned staging are set up here, not by the first sampled request served.
    drawn = SamplingParams(max_tokens=2, temperature=1.0, top_p=0.9, seed=0, ignore_eos=True)
    is_cuda = torch.device(engine.config.device).type == "cuda"
    runs = [prompts, prompts]
    if is_cuda if measure_warm is None else measure_warm:
        vocab = engine.config.model.vocab_size
        runs.append([[(t + vocab // 2) % vocab for t in prompt] for prompt in prompts])  # no prefix of the others
    for run, batch in enumerate(runs):
        if run == 2:
            engine.prefill_rate = PrefillRate(engine.prefill_rate.min_tokens, engine.prefill_rate.weight)
            engine.forget_prefixes()
        for i, prompt in enumerate(batch):
            engine.add_request(f"__warm_up_{run}_{i}__", prompt, drawn if run < 2 and i % 2 else params)
        while engine.has_unfinished():
            for output in engine.step():
                if output.finish_reason is FinishReason.PREFILLED:
                    engine.free_blocks(output.block_ids)
    engine.forget_prefixes()  # the throwaway prompts' blocks are nobody's prefix
    engine.check_leaks()
    model = engine.config.model
    if is_cuda:  # NOTE: on the CPU xgrammar stays unimported until used
        warm_up_masking(model.vocab_size, engine.config.device)
