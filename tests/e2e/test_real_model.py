"""The real default model (SmolLM2-135M-Instruct, converted by make-model) end to end: our offline
engine and the disaggregated deployment (real processes, the official openai client) give
transformers' greedy tokens on the same float32 checkpoint, and sensible answers."""

from __future__ import annotations

import openai
import pytest
import torch
import transformers

from engine.llm import LLM
from engine.model import CausalLM
from engine.sampling_params import SamplingParams
from kernels.select import select_backend
from pdserve.launcher import start_local, wait_healthy
from tests.e2e.conftest import KV_PATH_ONLY, assert_kv_path_only, node_load
from tests.pdserve.real_model import cached_smollm2

MAX_TOKENS = 16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
# 30 layers of 737 KB per block: 128 blocks (2,048 tokens) is ~94 MB per node.
NODE_ARGS = ("--num-blocks", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "256")


@pytest.fixture(scope="module")
def smollm2_dir():
    return cached_smollm2()


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def deployment(request, smollm2_dir, tmp_path_factory):
    """1 prefill + 1 decode node (KV over NIXL, local prefill off) and the proxy; or one
    colocated node and the proxy."""
    num_prefill = 1 if request.param == "disaggregated" else 0
    deployment = start_local(smollm2_dir, num_prefill=num_prefill, num_decode=1, proxy_args=KV_PATH_ONLY,
                             node_args=NODE_ARGS, pin_cpus=False,
                             log_dir=tmp_path_factory.mktemp(f"smollm2-{request.param}-logs"))
    try:
        wait_healthy(deployment, 180.0)
        yield deployment
        if num_prefill:
            assert_kv_path_only(deployment)
    finally:
        deployment.stop()


def chat_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def hf_greedy(hf, prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """transformers' greedy tokens; generation stops at <|im_end|> (the checkpoint's eos), which
    it keeps as the last token."""
    model, _ = hf
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def test_offline_engine_greedy_equals_transformers_and_answers_paris(smollm2_dir, hf, monkeypatch):
    """Where the CPU backend's build has the greedy head, its tokens come from it (counted)."""
    _, tokenizer = hf
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [chat_ids(tokenizer, QUESTION)]
    greedy_rows = []
    greedy_tokens = CausalLM.greedy_tokens

    def spy(self, hidden):
        greedy_rows.append(hidden.shape[0])
        return greedy_tokens(self, hidden)

    monkeypatch.setattr(CausalLM, "greedy_tokens", spy)
    llm = LLM(str(smollm2_dir), dtype="float32", num_blocks=64)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    takes_head = "greedy_head" in llm.engine.backend.capabilities  # the backend's own probe
    assert sum(greedy_rows) == (sum(len(o.outputs[0].token_ids) for o in outputs) if takes_head else 0)
    for prompt_ids, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt_ids), tokenizer.decode(prompt_ids)
    answer = outputs[-1].outputs[0]
    assert "Paris" in answer.text and answer.finish_reason == "stop", answer


def test_completions_through_the_deployment_equal_transformers_streaming_and_not(deployment, hf):
    _, tokenizer = hf
    client = openai.OpenAI(base_url=deployment.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    for prompt in PROMPTS:
        want_ids = hf_greedy(hf, tokenizer.encode(prompt))
        want_text = tokenizer.decode(want_ids, skip_special_tokens=True)
        full = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert full.choices[0].text == want_text
        assert full.usage.completion_tokens == len(want_ids)
        stream = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want_text


def test_a_prompt_prefilled_in_chunks_equals_transformers(deployment, hf):
    """A prompt of three prefill chunks (NODE_ARGS' budget of 256 tokens). On 1P+1D the proxy
    streams its KV (--kv-stream-min-tokens 0, the default): the decode node reads the first
    chunks' blocks while the prefill node runs the last, and both nodes count the stream."""
    _, tokenizer = hf
    prompt_ids = tokenizer.encode(" ".join(
        f"Chapter {n}. The lighthouse keeper counted the ships that passed the northern cape, wrote each name "
        f"in a ledger, and at dusk lit the lamp that had guided sailors home for {n + 40} years." for n in range(14)))
    assert 512 < len(prompt_ids) <= 768, len(prompt_ids)
    want_ids = hf_greedy(hf, prompt_ids)
    before = {name: node_load(address) for name, address in deployment.node_addresses.items()}
    client = openai.OpenAI(base_url=deployment.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    reply = client.completions.create(model=client.models.list().data[0].id, prompt=prompt_ids,
                                      max_tokens=MAX_TOKENS, temperature=0)
    assert reply.usage.prompt_tokens == len(prompt_ids) and reply.usage.completion_tokens == len(want_ids)
    assert reply.choices[0].text == tokenizer.decode(want_ids, skip_special_tokens=True)
    streamed = {name: node_load(address).num_kv_streamed - before[name].num_kv_streamed
                for name, address in deployment.node_addresses.items()}
    if "prefill0" in streamed:
        assert streamed == {"prefill0": 1, "decode0": 1}, streamed
    else:
        assert streamed == {"decode0": 0}, streamed


def test_chat_through_the_deployment_equals_transformers_and_answers_paris(deployment, hf):
    _, tokenizer = hf
    client = openai.OpenAI(base_url=deployment.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    prompt_ids = chat_ids(tokenizer, QUESTION)
    want_ids = hf_greedy(hf, prompt_ids)
    want_text = tokenizer.decode(want_ids, skip_special_tokens=True)
    reply = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.choices[0].message.content == want_text
    assert "Paris" in want_text and reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want_text


def test_bfloat16_greedy_head_narrows_the_real_heads_rows_and_agrees(hf):
    """The int8 screen of bfloat16 heads on SmolLM2's head and its final hidden states, whose
    channels run to ~13-20x their RMS: the pairs the screen takes out in bfloat16 keep it to a few
    dozen exact logits a row (thousands without them), and each token is the logits' argmax. The
    prompts' first positions (their hidden states the most extreme, and never a decode step's row)
    are checked for the token only: batched with the others, a few of them have more near-maxima
    than the candidate cap and take the full head."""
    model, tokenizer = hf
    texts = PROMPTS + ["Once upon a time there was a little girl who lived near the forest. Every day she",
                       "Q: What is 17 times 23? A: 17 times 20 is 340, and 17 times 3 is 51, so"]
    with torch.inference_mode():
        states = [model(torch.tensor([tokenizer.encode(t)]), output_hidden_states=True).hidden_states[-1][0]
                  for t in texts]
    weight = model.lm_head.weight.detach().to(torch.bfloat16).contiguous()
    backend = select_backend("cpu")
    full = backend.prepare_linear(weight, copy=False)
    head = backend.prepare_greedy_head(weight, full)
    # the backend's own probe: a screen where its build has one and the head has bfloat16 panels
    assert (head is not None) == ("greedy_head" in backend.capabilities and full.bf16 is not None)
    if head is None:
        return
    for hidden in (torch.cat(states), torch.cat([s[1:] for s in states])):
        hidden = hidden.to(torch.bfloat16)
        candidates = torch.empty(hidden.shape[0], dtype=torch.int64)
        assert torch.equal(backend.greedy_argmax(hidden, head, candidates),
                           backend.argmax(backend.linear(hidden, full)))
    assert float(candidates.float().mean()) < 64 and int(candidates.max()) < 1000, candidates.tolist()
