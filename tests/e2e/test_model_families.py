"""Each supported family besides Llama (tests/e2e/test_pipeline.py serves tiny) through 1 prefill +
1 decode node: Qwen2 (qwen2-tiny, whose tokenizer class replaces tokenizer.json's pre-tokenizer) and
Mistral (mistral-tiny: a SentencePiece-style BPE with byte fallback and "<s>", the [INST] template
in tokenizer_config.json). For text and chat, the prompt ids are AutoTokenizer's and the greedy
float32 output is transformers'; every prompt's KV is pulled (local prefill off, no fallback), a
long one streamed chunk by chunk."""

from __future__ import annotations

import httpx
import pytest
import torch
import transformers

from tests.e2e.conftest import KV_PATH_ONLY, _start, assert_kv_path_only, node_load
from tests.e2e.test_pipeline import client_for, hf_greedy, model_name, random_prompts

FAMILIES = {"qwen2-tiny": "qwen2_tiny_model_dir", "mistral-tiny": "mistral_tiny_model_dir"}
# The first: the file's own pre-tokenizer parts Qwen2's "\n    " otherwise (see test_tokenizer_equals_transformers);
# the second: multi-byte characters (byte-fallback tokens on Mistral).
PROMPTS = ["def fibonacci(n):\n    ", "naïve café — 日本語 😀 x ="]
# The indented line: Qwen2's split pattern and tokenizer.json's own pre-tokenizer part it otherwise.
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Fix it:\ndef f(x):\n    return"}]
MAX_TOKENS = 16


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(deployment, (model, tokenizer)): the family's checkpoint served by 1 prefill + 1 decode node
    (local prefill off), and transformers on the same checkpoint in float32."""
    model_dir = request.getfixturevalue(FAMILIES[request.param])
    hf = (transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
          transformers.AutoTokenizer.from_pretrained(model_dir))
    deployment = _start(model_dir, tmp_path_factory.mktemp(f"{request.param}-logs"), num_prefill=1, num_decode=1,
                        proxy_args=KV_PATH_ONLY)
    yield deployment, hf
    deployment.stop()


def _chat_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def test_prompt_ids_are_autotokenizers_for_text_and_chat(family):
    deployment, (_, tokenizer) = family
    assert tokenizer.chat_template, "every family's checkpoint here has a chat template"
    for prompt in PROMPTS:
        answer = httpx.post(deployment.base_url + "/tokenize", json={"prompt": prompt}, timeout=30).json()
        assert answer["tokens"] == tokenizer.encode(prompt), prompt
    answer = httpx.post(deployment.base_url + "/tokenize", json={"messages": MESSAGES}, timeout=30).json()
    assert answer["tokens"] == _chat_ids(tokenizer, MESSAGES)


def test_completion_greedy_equals_transformers_streaming_and_not(family):
    deployment, hf = family
    _, tokenizer = hf
    client = client_for(deployment)
    name = model_name(client)
    for prompt in PROMPTS:
        prompt_ids = tokenizer.encode(prompt)
        want_ids, want_logprobs = hf_greedy(hf, prompt_ids, MAX_TOKENS)
        want_text = tokenizer.decode(want_ids, skip_special_tokens=True)
        full = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
        assert full.choices[0].text == want_text, prompt
        assert full.system_fingerprint == "pdserve-kv:pulled"
        assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(prompt_ids), len(want_ids))
        got_logprobs = full.choices[0].logprobs.token_logprobs
        assert len(got_logprobs) == len(want_logprobs)
        assert max(abs(a - b) for a, b in zip(got_logprobs, want_logprobs)) < 1e-4
    stream = client.completions.create(model=name, prompt=PROMPTS[-1], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want_text
    assert_kv_path_only(deployment)


def test_chat_greedy_equals_transformers_streaming_and_not(family):
    deployment, hf = family
    _, tokenizer = hf
    client = client_for(deployment)
    name = model_name(client)
    prompt_ids = _chat_ids(tokenizer, MESSAGES)
    want_ids, want_logprobs = hf_greedy(hf, prompt_ids, MAX_TOKENS)
    want_text = tokenizer.decode(want_ids, skip_special_tokens=True)
    reply = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                           logprobs=True)
    assert reply.choices[0].message.content == want_text
    assert reply.system_fingerprint == "pdserve-kv:pulled"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), len(want_ids))
    got_logprobs = [c.logprob for c in reply.choices[0].logprobs.content]
    assert len(got_logprobs) == len(want_logprobs)
    assert max(abs(a - b) for a, b in zip(got_logprobs, want_logprobs)) < 1e-4
    stream = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want_text
    assert_kv_path_only(deployment)


def test_a_prompt_streamed_to_the_decode_node_in_chunks_equals_transformers(family):
    """600 tokens, three chunks of the nodes' 256-token budget: the decode node reads the first
    chunks' KV while the last is prefilled (both nodes count the stream). NOTE: a decode node whose
    loop was away meets the request and the prefill's end in one turn, and then pulls it whole
    (correctly): up to three prompts, until one was read while prefilled."""
    deployment, hf = family
    client = client_for(deployment)
    for attempt in range(3):
        prompt_ids = random_prompts(1, [600], seed=11 + attempt)[0]
        want_ids, want_logprobs = hf_greedy(hf, prompt_ids, MAX_TOKENS)
        before = {name: node_load(address) for name, address in deployment.node_addresses.items()}
        full = client.completions.create(model=model_name(client), prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                         temperature=0, logprobs=1)
        assert full.system_fingerprint == "pdserve-kv:pulled"
        assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(prompt_ids), len(want_ids))
        assert full.choices[0].text == hf[1].decode(want_ids, skip_special_tokens=True)
        got_logprobs = full.choices[0].logprobs.token_logprobs
        assert max(abs(a - b) for a, b in zip(got_logprobs, want_logprobs, strict=True)) < 1e-4
        streamed = {name: node_load(address).num_kv_streamed - before[name].num_kv_streamed
                    for name, address in deployment.node_addresses.items()}
        assert streamed["prefill0"] == 1, streamed
        if streamed["decode0"] == 1:
            break
    assert streamed == {"prefill0": 1, "decode0": 1}, f"no prompt of {attempt + 1} was read while prefilled"
    assert_kv_path_only(deployment)
