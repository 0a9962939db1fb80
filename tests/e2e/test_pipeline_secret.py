"""The disaggregated pipeline with a cluster secret (PDSERVE_CLUSTER_SECRET on every process):
with CURVE on every proxy-node and KV side-channel socket, answers are unchanged (greedy equal
to transformers), every prompt still goes through the KV path, and every block comes back."""

from __future__ import annotations

import asyncio

import openai
import pytest

from engine.protocol import curve_keys
from tests.e2e import test_pipeline as pipeline
from tests.e2e.conftest import CLUSTER_SECRET, assert_kv_path_only, wait_blocks_free
from tests.e2e.test_pipeline import hf, hf_greedy, random_prompts  # noqa: F401 - hf is a fixture

KEYS = curve_keys(CLUSTER_SECRET)


@pytest.fixture(autouse=True)
def _every_prompt_went_through_the_kv_path(secret_disaggregated):
    yield
    assert_kv_path_only(secret_disaggregated, KEYS)


def test_completion_greedy_equals_transformers_with_a_secret(secret_disaggregated, hf):  # noqa: F811
    pipeline.test_completion_greedy_equals_transformers_streaming_and_not(secret_disaggregated, hf)


def test_chat_greedy_equals_transformers_with_a_secret(secret_disaggregated, hf):  # noqa: F811
    pipeline.test_chat_greedy_equals_transformers(secret_disaggregated, hf)


def test_n_stop_strings_and_include_usage_with_a_secret(secret_disaggregated):
    pipeline.test_n_stop_strings_and_include_usage(secret_disaggregated)


def test_metrics_and_health_with_a_secret(secret_disaggregated):
    pipeline.test_metrics_and_health(secret_disaggregated)


def test_16_concurrent_mixed_requests_with_a_secret_equal_transformers_and_free_every_block(
        secret_disaggregated, hf):  # noqa: F811
    prompts = random_prompts(16, [1, 16, 17, 60, 300], seed=55)
    expected = [hf_greedy(hf, p, 8)[0] for p in prompts]
    _, tokenizer = hf

    async def run_all():
        client = openai.AsyncOpenAI(base_url=secret_disaggregated.base_url + "/v1", api_key="unused",
                                    max_retries=0, timeout=300)
        name = (await client.models.list()).data[0].id
        return await asyncio.gather(*(client.completions.create(model=name, prompt=p, max_tokens=8, temperature=0)
                                      for p in prompts))

    for i, (result, want) in enumerate(zip(asyncio.run(run_all()), expected)):
        assert result.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), f"prompt {i}"
    for name, address in secret_disaggregated.node_addresses.items():
        report = wait_blocks_free(address, keys=KEYS)
        assert report.num_free_blocks == report.num_total_blocks and report.num_leases == 0, name
