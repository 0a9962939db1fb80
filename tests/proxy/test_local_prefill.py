"""Conditional disaggregation: when the prefill pool's queue wait (its queued prompt tokens over
its measured prefill rate) passes the threshold, some prompts are prefilled on their decode node
instead; every request still completes with the same tokens, and the metric counts them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from engine import protocol
from proxy.tokenizer import ModelTokenizer
from tests.proxy.conftest import MODEL_NAME
from tests.proxy.fake_node import next_token

NUM_REQUESTS = 8
PROMPT_LEN = 50
# 100 tokens/s: each queued 50-token prompt adds 0.5 s to the pool's estimated wait.
SLOW_NODES = {"prefill_tokens_per_s": 100.0, "prefill_s": 0.3}


def _complete_all(proxy) -> list[dict]:
    prompts = [[10 + i] * PROMPT_LEN for i in range(NUM_REQUESTS)]

    def one(prompt):
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
        response = httpx.post(proxy.base_url + "/v1/completions", content=json.dumps(body), timeout=20,
                              headers={"Content-Type": "application/json"})
        assert response.status_code == 200, response.text
        return prompt, response.json()

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        return list(pool.map(one, prompts))


def _expected_text(proxy, prompt: list[int]) -> str:
    """What the fake model generates for the prompt (the same wherever it is prefilled)."""
    outputs: list[int] = []
    for _ in range(3):
        outputs.append(next_token(prompt, outputs, proxy.decode[0].config.vocab_size))
    return ModelTokenizer.from_dir(proxy.config.model_dir, proxy.config.chat_template_timeout_s).decode(outputs)


def test_backed_up_prefill_pool_sends_some_prompts_to_the_decode_node(start_proxy):
    proxy = start_proxy(node=SLOW_NODES)
    results = _complete_all(proxy)
    local = [m for m in proxy.decode[0].messages(protocol.DecodeRequest) if m.kv_handle is None]
    remote = proxy.prefill[0].messages(protocol.PrefillRequest)
    assert local and remote and len(local) + len(remote) == NUM_REQUESTS
    assert all(m.first_token is None for m in local)
    local_prompts = {tuple(m.prompt_token_ids) for m in local}
    for prompt, body in results:
        assert body["choices"][0]["text"] == _expected_text(proxy, prompt)
        assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["finish_reason"] == "length"
        assert (tuple(prompt) in local_prompts) != any(m.prompt_token_ids == prompt for m in remote)
    metrics = httpx.get(proxy.base_url + "/metrics", timeout=5).text
    assert f"pdserve_local_prefills_total {float(len(local))}" in metrics


def test_without_the_policy_every_prompt_goes_to_the_prefill_pool(start_proxy):
    proxy = start_proxy(node=SLOW_NODES, local_prefill_min_wait_s=None)
    _complete_all(proxy)
    assert len(proxy.prefill[0].messages(protocol.PrefillRequest)) == NUM_REQUESTS
    assert all(m.kv_handle is not None for m in proxy.decode[0].messages(protocol.DecodeRequest))


def test_unmeasured_prefill_rates_keep_prompts_in_the_pool(start_proxy):
    proxy = start_proxy(node={"prefill_s": 0.3})  # nodes report no rate yet
    _complete_all(proxy)
    assert len(proxy.prefill[0].messages(protocol.PrefillRequest)) == NUM_REQUESTS
