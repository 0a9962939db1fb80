"""Prefill and decode nodes of different tensor-parallel degrees, real processes: 1P(TP=1)+1D(TP=2),
1P(TP=2)+1D(TP=1) and 1P(TP=2)+1D(TP=2), over NIXL (DRAM) and over gloo. Through the OpenAI
endpoint greedy output equals transformers' (so a colocated one-rank node's), every prompt's KV
went through the pull (local prefill off, zero fallbacks), every decode rank's cache got every
pulled block (its own heads), and a client gone mid-pull leaves no block held on either node."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.e2e.conftest import KV_PATH_ONLY, NODE_ARGS, _start, assert_kv_path_only, wait_blocks_free
from tests.e2e.test_pipeline import client_for, hf, hf_greedy, model_name, random_prompts  # noqa: F401 - hf: fixture

COMBOS = [("nixl", 1, 2), ("nixl", 2, 1), ("nixl", 2, 2), ("gloo", 1, 2), ("gloo", 2, 1), ("gloo", 2, 2)]


@pytest.fixture(scope="module", params=COMBOS, ids=[f"{b}-P{p}-D{d}" for b, p, d in COMBOS])
def split_pair(request, tiny_model_dir, tmp_path_factory):
    backend, prefill_tp, decode_tp = request.param
    deployment = _start(tiny_model_dir, tmp_path_factory.mktemp(f"tp-{backend}-{prefill_tp}-{decode_tp}"),
                        num_prefill=1, num_decode=1, node_args=(*NODE_ARGS, "--transfer-backend", backend),
                        proxy_args=KV_PATH_ONLY, tensor_parallel=(prefill_tp, decode_tp))
    yield deployment, decode_tp
    deployment.stop()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of series name with labels (among others) in a Prometheus text page."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} {labels} not in the page")


def test_greedy_through_the_pull_equals_transformers_and_every_rank_gets_every_block(split_pair, hf):  # noqa: F811
    deployment, decode_tp = split_pair
    client = client_for(deployment)
    _, tokenizer = hf
    for prompt in random_prompts(3, [7, 40, 150], seed=5):
        want, want_logprobs = hf_greedy(hf, prompt, 12)
        response = client.completions.create(model=model_name(client), prompt=prompt, max_tokens=12, temperature=0.0,
                                             logprobs=1, extra_body={"ignore_eos": True})
        choice = response.choices[0]
        assert choice.text == tokenizer.decode(want, skip_special_tokens=True)
        assert all(abs(a - b) < 1e-4 for a, b in zip(choice.logprobs.token_logprobs, want_logprobs))
        assert response.system_fingerprint == "pdserve-kv:pulled"
    page = httpx.get(deployment.health_urls["decode0"] + "/metrics", timeout=5).text
    pulled = metric(page, "pdserve_node_kv_pulled_blocks_total")
    assert pulled >= 1 + 3 + 10  # the three prompts' blocks (16-token blocks)
    assert [metric(page, "pdserve_node_kv_pulled_rank_blocks_total", rank=str(r)) for r in range(decode_tp)] == \
        [pulled] * decode_tp
    assert not re.search(rf'pdserve_node_kv_pulled_rank_blocks_total{{[^}}]*rank="{decode_tp}"', page)
    assert_kv_path_only(deployment)


def test_a_client_gone_during_the_pull_leaves_no_block_held(split_pair):
    deployment, _ = split_pair
    body = {"model": model_name(client_for(deployment)), "prompt": random_prompts(1, [300], seed=8)[0],
            "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", deployment.base_url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # the first token: the prefill node's, while the decode node pulls
    for node, address in deployment.node_addresses.items():
        report = wait_blocks_free(address, timeout_s=10)
        assert report.num_free_blocks == report.num_total_blocks, f"{node} still holds blocks"
        assert report.num_running == 0 and report.num_leases == 0, node
    assert_kv_path_only(deployment)
