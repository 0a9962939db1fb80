"""The disaggregated pipeline end to end: real processes, the official openai client, and
transformers on the same checkpoint as the oracle."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import random
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from pdserve.huge_heap import huge_heap_environ_here
from tests.e2e.conftest import borrowed_steps, node_load, wait_blocks_free


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    return model, tokenizer


def hf_greedy(hf, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    model, _ = hf
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(logits[0].float(), -1)[t].item() for logits, t in zip(out.logits, tokens)]
    return tokens, logprobs


# transformers renamed the forward's and the output's past_key_values to cache (the old name warns
# and goes in 5.40); older releases know only past_key_values.
CACHE_NAME = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters \
    else "past_key_values"


def hf_greedy_ignoring_eos(hf, prompt_ids: list[int], num_tokens: int) -> list[int]:  # noqa: F811
    """transformers' greedy tokens, going on past EOS as ignore_eos does (generate() stops there)."""
    model, _ = hf
    ids, past, out = torch.tensor([prompt_ids]), None, []
    with torch.inference_mode():
        for _ in range(num_tokens):
            step = model(input_ids=ids, use_cache=True, **{CACHE_NAME: past})
            past, ids = getattr(step, CACHE_NAME), step.logits[:, -1:].argmax(-1)
            out.append(int(ids))
    return out


def client_for(deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployment.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def random_prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, 1500) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


PROMPT = "def fibonacci(n):\n    "


def test_completion_greedy_equals_transformers_streaming_and_not(disaggregated, hf):
    client = client_for(disaggregated)
    _, tokenizer = hf
    prompt_ids = tokenizer.encode(PROMPT)
    want_ids, want_logprobs = hf_greedy(hf, prompt_ids, 20)
    want_text = tokenizer.decode(want_ids, skip_special_tokens=True)
    name = model_name(client)

    full = client.completions.create(model=name, prompt=PROMPT, max_tokens=20, temperature=0, logprobs=2)
    assert full.choices[0].text == want_text
    assert full.system_fingerprint == "pdserve-kv:pulled"  # how the KV came, visible per request
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.completion_tokens == len(want_ids)
    assert full.usage.total_tokens == len(prompt_ids) + len(want_ids)
    got_logprobs = full.choices[0].logprobs.token_logprobs
    assert len(got_logprobs) == len(want_logprobs)
    assert max(abs(a - b) for a, b in zip(got_logprobs, want_logprobs)) < 1e-4

    stream = client.completions.create(model=name, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want_text
    assert {c.system_fingerprint for c in chunks if c.system_fingerprint} == {"pdserve-kv:pulled"}
    assert chunks[-1].usage.completion_tokens == len(want_ids)
    # The control of test_core_lending: nothing lends here, and the decode node counts no borrowed step.
    assert not disaggregated.cluster.files
    assert borrowed_steps(disaggregated.health_urls["decode0"]) == 0


def test_chat_greedy_equals_transformers(disaggregated, hf):
    client = client_for(disaggregated)
    _, tokenizer = hf
    messages = [{"role": "user", "content": "Write a loop in Python."}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    want_ids, want_logprobs = hf_greedy(hf, prompt_ids, 16)
    want_text = tokenizer.decode(want_ids, skip_special_tokens=True)
    name = model_name(client)

    reply = client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0,
                                           logprobs=True, top_logprobs=2)
    assert reply.choices[0].message.content == want_text
    assert reply.usage.prompt_tokens == len(prompt_ids)
    got = [c.logprob for c in reply.choices[0].logprobs.content]
    assert max(abs(a - b) for a, b in zip(got, want_logprobs)) < 1e-4

    stream = client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want_text


def test_disaggregated_and_colocated_agree_greedy_and_seeded(disaggregated, colocated):
    prompts = random_prompts(4, [3, 40, 130, 300], seed=3)
    outputs = {}
    for mode, deployment in (("pd", disaggregated), ("colo", colocated)):
        client = client_for(deployment)
        name = model_name(client)
        greedy = [client.completions.create(model=name, prompt=p, max_tokens=12, temperature=0).choices[0].text
                  for p in prompts]
        seeded = [client.completions.create(model=name, prompt=p, max_tokens=12, temperature=1.0, top_p=0.9,
                                            seed=1234).choices[0].text for p in prompts]
        outputs[mode] = (greedy, seeded)
    assert outputs["pd"][0] == outputs["colo"][0]
    assert outputs["pd"][1] == outputs["colo"][1]


def test_32_concurrent_mixed_requests_complete_and_free_every_block(disaggregated, hf):
    # Some prompts are longer than the prefill token budget (256), so they are chunked.
    prompts = random_prompts(32, [1, 7, 16, 17, 60, 200, 300, 520], seed=5)
    max_tokens = 8
    expected = [hf_greedy(hf, p, max_tokens)[0] for p in prompts]
    _, tokenizer = hf
    before = {name: node_load(addr) for name, addr in disaggregated.node_addresses.items()}

    async def run_all():
        client = openai.AsyncOpenAI(base_url=disaggregated.base_url + "/v1", api_key="unused", max_retries=0,
                                    timeout=300)
        name = (await client.models.list()).data[0].id
        calls = [client.completions.create(model=name, prompt=p, max_tokens=max_tokens, temperature=0) for p in prompts]
        return await asyncio.gather(*calls)

    results = asyncio.run(run_all())
    for i, (result, want) in enumerate(zip(results, expected)):
        assert result.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), f"prompt {i}"
        assert result.usage.completion_tokens == len(want)
    streamed = {}
    for name, address in disaggregated.node_addresses.items():
        after = wait_blocks_free(address)
        assert after.num_free_blocks == before[name].num_free_blocks == after.num_total_blocks, name
        streamed[name] = after.num_kv_streamed - before[name].num_kv_streamed
    # Every chunked prompt's KV was offered as a stream (leased from its first chunk): those over the
    # budget, and shorter ones that shared a step's budget. The decode node read parts of those it
    # took in before their prefill ended (one whose last KVProgress came first is read whole).
    assert streamed["prefill0"] >= sum(len(p) > 256 for p in prompts) > 0, streamed
    assert 0 < streamed["decode0"] <= streamed["prefill0"], streamed


def test_client_disconnect_mid_stream_frees_blocks_on_both_nodes(disaggregated):
    name = model_name(client_for(disaggregated))
    body = {"model": name, "prompt": random_prompts(1, [200], seed=9)[0], "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", disaggregated.base_url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        num_chunks = 0
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                num_chunks += 1
            if num_chunks >= 5:
                break
    disconnected_at = time.monotonic()
    for node, address in disaggregated.node_addresses.items():
        report = wait_blocks_free(address, timeout_s=1.0)
        assert report.num_free_blocks == report.num_total_blocks, f"{node} still holds blocks"
        assert report.num_running == 0, node
    assert time.monotonic() - disconnected_at < 2.0


@pytest.mark.parametrize(
    "body, status",
    [
        ("{not json", 400),
        (json.dumps({"prompt": "hi"}), 400),  # missing model
        (json.dumps({"model": "MODEL", "prompt": "hi", "max_tokens": "ten"}), 400),
        (json.dumps({"model": "MODEL", "prompt": "hi", "temperature": -1}), 400),
        (json.dumps({"model": "MODEL", "prompt": "hi", "top_p": 0}), 400),
        (json.dumps({"model": "MODEL", "prompt": "hi", "max_tokens": 0}), 400),
        (json.dumps({"model": "no-such-model", "prompt": "hi"}), 404),
        (json.dumps({"model": "MODEL", "prompt": [5] * 5000}), 400),  # longer than the context
        (json.dumps({"model": "MODEL", "prompt": [10**7]}), 400),  # unknown token id
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(disaggregated, body, status):
    name = model_name(client_for(disaggregated))
    response = httpx.post(disaggregated.base_url + "/v1/completions", content=body.replace("MODEL", name),
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    ok = client_for(disaggregated).completions.create(model=name, prompt="x = 1", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_n_stop_strings_and_include_usage(disaggregated):
    client = client_for(disaggregated)
    name = model_name(client)
    prompt = random_prompts(1, [30], seed=11)[0]
    plain = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    stop = plain[len(plain) // 2: len(plain) // 2 + 3]
    cut = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == plain[: plain.index(stop)]
    assert cut.choices[0].finish_reason == "stop"

    many = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=1.0, seed=5, n=3)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert many.usage.prompt_tokens == len(prompt)
    assert many.usage.completion_tokens == 24

    stream = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                            temperature=0, stream=True, stream_options={"include_usage": True}, n=2)
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_metrics_and_health(disaggregated):
    assert httpx.get(disaggregated.base_url + "/health", timeout=5).status_code == 200
    text = httpx.get(disaggregated.base_url + "/metrics", timeout=5).text
    for metric in ("pdserve_time_to_first_token_seconds_bucket", "pdserve_inter_token_latency_seconds_bucket",
                   "pdserve_node_free_blocks", "pdserve_requests_total", "pdserve_node_kv_fallbacks"):
        assert metric in text, metric
    # The nodes' vllm:* series too, one set per node (its `engine` label), as each node's own page has them.
    for node, series in (("prefill0", "vllm:prompt_tokens_total"), ("decode0", "vllm:generation_tokens_total")):
        own = _sample(httpx.get(disaggregated.health_urls[node] + "/metrics", timeout=5).text, series, node)
        assert own > 0 and _sample(text, series, node) == own, (node, series)
    assert _sample(text, "vllm:num_requests_running", "decode0") == 0


def _sample(page: str, name: str, engine: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    [value] = [s.value for f in text_string_to_metric_families(page) for s in f.samples
               if s.name == name and s.labels.get("engine") == engine]
    return value


def test_killed_prefill_node_is_named_by_health_and_the_decode_node_prefills(deployment_factory, tiny_model_dir):
    deployment = deployment_factory(tiny_model_dir, num_prefill=1, num_decode=1)
    client = client_for(deployment)
    name = model_name(client)
    assert client.completions.create(model=name, prompt="x", max_tokens=2, temperature=0).usage.completion_tokens >= 1
    [(_, prefill)] = [(n, p) for n, p in deployment.cluster.procs if n == "prefill0"]
    prefill.kill()
    prefill.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and httpx.get(deployment.base_url + "/health", timeout=5).status_code == 200:
        time.sleep(0.2)
    health = httpx.get(deployment.base_url + "/health", timeout=5)
    assert health.status_code == 503 and "prefill" in health.text
    response = httpx.post(deployment.base_url + "/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 2},
                          timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2  # prefilled on decode


def environ_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.partition("=")[::2] for entry in entries if entry)


def test_the_nodes_restarted_with_their_heap_on_huge_pages(disaggregated):
    """The node processes run with glibc's heap on huge pages where this machine has it
    (pdserve.huge_heap: the tunable added to what they inherited); the proxy, which runs no
    model, with the environment it inherited."""
    inherited = os.environ.get("GLIBC_TUNABLES", "")
    expected = (huge_heap_environ_here(os.environ) or os.environ).get("GLIBC_TUNABLES", "")
    for name in ("prefill0", "decode0"):
        assert environ_of(disaggregated.cluster.process(name).pid).get("GLIBC_TUNABLES", "") == expected
    assert environ_of(disaggregated.cluster.process("proxy").pid).get("GLIBC_TUNABLES", "") == inherited
