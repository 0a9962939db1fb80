"""Sampler: seeded repeatability, truncation never leaks, temperature 0 is greedy, penalties."""

import random

import pytest
import torch

from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from tests.kernels.conftest import ENGINE_DEVICES

VOCAB = 50


def req(params: SamplingParams, outputs=(), prompt=(1, 2, 3)) -> Request:
    r = Request("x", list(prompt), params, max_total_tokens=1000)
    r.output_token_ids = list(outputs)
    return r


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_equals_argmax():
    logits = random_logits(8)
    sampler = Sampler(VOCAB, eos_token_ids=(0,))
    tokens = sampler.sample(logits, [req(SamplingParams(temperature=0.0))] * 8)
    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()


def test_bfloat16_logits_give_the_float32_choices_with_and_without_the_plain_greedy_path():
    """A batch of plain greedy requests takes the argmax of the bfloat16 logits as they are; any
    request that needs float32 logits (logprobs, penalties, min_tokens, sampling) widens them
    for the whole batch. Either way each row's choice is that of the float32 copy, and logprobs
    are the float32 log-softmax of the bfloat16 values."""
    logits = random_logits(6, seed=4).to(torch.bfloat16)
    wide = logits.float()
    sampler = Sampler(VOCAB, eos_token_ids=(0,))
    plain = sampler.sample(logits, [req(SamplingParams(temperature=0.0))] * 6)
    assert [t.token_id for t in plain] == wide.argmax(-1).tolist()
    mixed = [req(SamplingParams(temperature=0.0)), req(SamplingParams(temperature=0.0, logprobs=2)),
             req(SamplingParams(temperature=0.0, repetition_penalty=1.5), outputs=[7]),
             req(SamplingParams(temperature=0.0, min_tokens=3)), req(SamplingParams(temperature=0.0)),
             req(SamplingParams(temperature=0.8, seed=3))]
    tokens = sampler.sample(logits, mixed)
    assert [t.token_id for t in tokens[:2]] == wide[:2].argmax(-1).tolist()
    assert tokens[4].token_id == wide[4].argmax().item()
    assert tokens[1].logprob == pytest.approx(torch.log_softmax(wide[1], -1)[tokens[1].token_id].item(), abs=1e-6)
    assert tokens[3].token_id != 0 and 0 <= tokens[5].token_id < VOCAB


@pytest.mark.parametrize(
    "params_kwargs",
    [dict(top_k=5), dict(top_p=0.3), dict(min_p=0.2), dict(top_k=8, top_p=0.5, min_p=0.05)],
)
def test_truncation_never_emits_a_token_outside_the_allowed_set(params_kwargs):
    logits = random_logits(1, seed=3)[0]
    params = SamplingParams(temperature=1.0, **params_kwargs)
    probs = torch.softmax(logits, -1)
    allowed = allowed_set(probs, params)
    sampler = Sampler(VOCAB, eos_token_ids=(0,), seed=1)
    batch = 64
    seen = set()
    for _ in range(40):
        tokens = sampler.sample(logits.expand(batch, VOCAB).clone(), [req(params)] * batch)
        seen |= {t.token_id for t in tokens}
    assert seen <= allowed, f"emitted {seen - allowed} outside {sorted(allowed)}"
    assert len(seen) >= min(2, len(allowed))  # it does sample, not always the top token


def allowed_set(probs: torch.Tensor, params: SamplingParams) -> set[int]:
    order = probs.argsort(descending=True).tolist()
    keep, mass = [], 0.0
    for rank, token in enumerate(order):
        if params.top_k and rank >= params.top_k:
            break
        if mass >= params.top_p:
            break
        keep.append(token)
        mass += probs[token].item()
    top = probs.max().item()
    return {t for t in keep if probs[t].item() >= params.min_p * top}


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0] + [-30.0] * (VOCAB - 3)])
    sampler = Sampler(VOCAB, eos_token_ids=(), seed=0)
    tokens = sampler.sample(logits.expand(20000, VOCAB).clone(), [req(SamplingParams())] * 20000)
    counts = torch.bincount(torch.tensor([t.token_id for t in tokens]), minlength=3)[:3].float()
    want = torch.softmax(logits[0, :3], -1)
    assert torch.allclose(counts / counts.sum(), want, atol=0.02)


def test_seeded_rows_repeat_regardless_of_batch_neighbours():
    logits = random_logits(1, seed=5)
    params = SamplingParams(temperature=1.0, seed=1234)
    sampler = Sampler(VOCAB, eos_token_ids=(0,), seed=0)
    alone = sampler.sample(logits, [req(params)])[0].token_id
    for neighbours in (1, 5, 17):
        batch = torch.cat([random_logits(neighbours, seed=neighbours), logits])
        others = [req(SamplingParams(temperature=1.0))] * neighbours
        assert sampler.sample(batch, others + [req(params)])[-1].token_id == alone


def test_penalties_change_the_greedy_choice():
    logits = torch.full((1, VOCAB), -1.0)
    logits[0, 4] = 2.0
    logits[0, 5] = 1.5
    sampler = Sampler(VOCAB, eos_token_ids=())
    plain = sampler.sample(logits, [req(SamplingParams(temperature=0.0), outputs=[4])])
    assert plain[0].token_id == 4
    for kwargs in (dict(frequency_penalty=1.0), dict(presence_penalty=1.0), dict(repetition_penalty=2.0)):
        r = req(SamplingParams(temperature=0.0, **kwargs), outputs=[4])
        assert sampler.sample(logits, [r])[0].token_id == 5, kwargs


def test_min_tokens_blocks_eos_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 10.0  # eos is by far the most likely
    sampler = Sampler(VOCAB, eos_token_ids=(0,))
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=5)
    assert sampler.sample(logits, [req(params, outputs=[3])])[0].token_id != 0
    assert sampler.sample(logits, [req(params, outputs=[3, 3])])[0].token_id == 0


def test_min_tokens_gives_way_where_a_stop_is_all_that_is_left_and_rows_stay_apart():
    """A row whose only finite logits are stop tokens (as where a finished grammar allows only
    them) keeps them; in the same batch another row under min_tokens loses its stops, and a row past it keeps
    them."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 0] = 10.0  # eos the most likely everywhere
    logits[0, :] = float("-inf")
    logits[0, 7] = 1.0  # row 0: the stop id 7 alone allowed
    logits[1, 7] = 10.0  # row 1: stop id 7 as likely as eos
    sampler = Sampler(VOCAB, eos_token_ids=(0,))
    under = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=5, stop_token_ids=[7])
    tokens = sampler.sample(logits, [req(under, outputs=[3]), req(under, outputs=[3]),
                                     req(under, outputs=[3, 3])])
    assert tokens[0].token_id == 7 and tokens[1].token_id not in (0, 7) and tokens[2].token_id in (0, 7)


def test_logprobs_are_log_softmax_with_top_n():
    logits = random_logits(2, seed=9)
    sampler = Sampler(VOCAB, eos_token_ids=())
    tokens = sampler.sample(logits, [req(SamplingParams(temperature=0.0, logprobs=3))] * 2)
    want = torch.log_softmax(logits, -1)
    for row, token in enumerate(tokens):
        assert token.logprob == pytest.approx(want[row, token.token_id].item(), abs=1e-6)
        assert [t for t, _ in token.top] == want[row].topk(3).indices.tolist()


@pytest.mark.parametrize("device", ENGINE_DEVICES)
def test_every_kind_of_row_samples_where_the_logits_are(device):
    """One batch of every kind (greedy, logprobs, penalties, min_tokens, logit_bias, seeded and
    unseeded temperature, top-k, top-p, min-p) with its logits on the device: seeded and greedy
    rows choose what they choose on the CPU, the rest stay in range."""
    logits = random_logits(10, seed=11)
    batch = [req(SamplingParams(temperature=0.0)), req(SamplingParams(temperature=0.0, logprobs=2)),
             req(SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5,
                                presence_penalty=0.5), outputs=[7, 7]),
             req(SamplingParams(temperature=0.0, min_tokens=3)),
             req(SamplingParams(temperature=0.0, logit_bias={3: 50})),
             req(SamplingParams(temperature=0.7, seed=5)), req(SamplingParams(temperature=1.0, top_k=4, seed=6)),
             req(SamplingParams(temperature=1.0, top_p=0.5, seed=7)), req(SamplingParams(temperature=1.0, min_p=0.1)),
             req(SamplingParams(temperature=1.2, repetition_penalty=1.3, seed=8), outputs=[1])]
    on_cpu = Sampler(VOCAB, eos_token_ids=(0,)).sample(logits, batch)
    tokens = Sampler(VOCAB, eos_token_ids=(0,)).sample(logits.to(device), batch)
    chosen = [t.token_id for t in tokens]
    assert chosen[:8] + chosen[9:] == [t.token_id for t in on_cpu[:8] + on_cpu[9:]]
    assert chosen[4] == 3 and chosen[3] != 0 and 0 <= chosen[8] < VOCAB
    assert tokens[1].logprob == pytest.approx(on_cpu[1].logprob, abs=1e-5)


@pytest.mark.parametrize("device", ENGINE_DEVICES)
def test_a_draw_on_the_device_chooses_what_sample_chooses_and_never_waits_for_it(device):
    """Sampler.draw (an async step's tokens, left on the device): greedy rows take the tokens given
    (the graph's argmax), seeded rows draw what sample() draws, unseeded rows stay inside their
    truncation; all-greedy hands the given tensor back. On CUDA nothing in it waits for the device
    (torch's sync debug mode raises on a stream or device sync)."""
    logits = random_logits(7, seed=12).to(torch.bfloat16).to(device)
    batch = [req(SamplingParams(temperature=0.0)), req(SamplingParams(temperature=0.7, seed=5), outputs=[4, 9]),
             req(SamplingParams(temperature=1.0, top_k=4, seed=6)), req(SamplingParams(temperature=0.0)),
             req(SamplingParams(temperature=1.0, top_p=0.5, seed=7)),
             req(SamplingParams(temperature=1.0, min_p=0.3, seed=8)), req(SamplingParams(temperature=1.0, top_k=3))]
    greedy = torch.full((7,), 41, dtype=torch.long, device=device)  # not the argmax: the rows must take it
    sampler = Sampler(VOCAB, eos_token_ids=(0,))
    greedy_logits = logits[[0, 3]]  # NOTE: indexing by a list copies the index to the device: not under the check
    if device == "cuda":
        sampler.draw(logits, greedy, batch)  # first use: pinned host blocks and the generator made
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        drawn = sampler.draw(logits, greedy, batch)
        only_greedy = sampler.draw(greedy_logits, greedy[:2], [batch[0], batch[3]])
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert only_greedy is not None and only_greedy.data_ptr() == greedy.data_ptr()
    assert drawn.device.type == device and drawn.dtype == torch.long
    chosen = drawn.tolist()
    sampled = [t.token_id for t in Sampler(VOCAB, eos_token_ids=(0,)).sample(logits.cpu(), batch)]
    assert chosen[0] == chosen[3] == 41
    assert [chosen[i] for i in (1, 2, 4, 5)] == [sampled[i] for i in (1, 2, 4, 5)]
    assert chosen[6] in logits[6].float().topk(3).indices.tolist()
    all_drawn = sampler.draw(logits[[1, 2]], greedy[:2], [batch[1], batch[2]]).tolist()
    assert all_drawn == [sampled[1], sampled[2]]


@pytest.mark.parametrize(
    "bad", [dict(max_tokens=0), dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
            dict(top_k=-2), dict(min_p=1.5), dict(logprobs=21), dict(repetition_penalty=0.0)],
)
def test_bad_sampling_params_raise_value_error_naming_the_parameter(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)


def test_seeded_requests_repeat_alone_and_in_any_batch(tiny_model_dir):
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.engine import LLMEngine

    config = EngineConfig(
        model=ModelConfig.from_pretrained(tiny_model_dir),
        cache=CacheConfig(num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=512),
    )
    engine = LLMEngine(config)
    rng = random.Random(0)
    prompt = [rng.randrange(8, 1000) for _ in range(40)]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=16, ignore_eos=True)

    def run(extra_prompts):
        engine.add_request("seeded", prompt, params)
        for i, p in enumerate(extra_prompts):
            engine.add_request(f"other{i}", p, SamplingParams(temperature=1.0, max_tokens=20))
        tokens = []
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == "seeded":
                    tokens += [t.token_id for t in out.new_tokens]
        return tokens

    alone = run([])
    assert run([]) == alone
    others = [[rng.randrange(8, 1000) for _ in range(rng.randint(1, 90))] for _ in range(7)]
    assert run(others) == alone
    assert run(others[:3]) == alone
    engine.check_leaks()
