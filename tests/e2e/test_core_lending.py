"""Core lending live (`pdserve up`'s default where nodes have cores of their own): a pinned
1P+1D deployment on this host, a burst whose decoding outlasts its prefills. The decode node runs
steps on the prefill node's core once that one has nothing to prefill, and every output still
equals transformers' greedy one, every prompt through the KV path."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.launcher import start_local, wait_healthy
from tests.e2e import test_pipeline as pipeline
from tests.e2e.conftest import KV_PATH_ONLY, NODE_ARGS, assert_kv_path_only, borrowed_steps
from tests.e2e.test_pipeline import client_for, hf_greedy, model_name, random_prompts

hf = pipeline.hf  # transformers on the same checkpoint, the oracle (a module fixture)


# NOTE: the control, a deployment without lending whose decode node never counts a borrowed step,
# runs on test_pipeline's disaggregated deployment (test_completion_greedy_equals_transformers...).
@pytest.mark.parametrize("lend", [True])
def test_the_decode_node_borrows_the_idle_prefill_core_and_stays_exact(tiny_model_dir, tmp_path, hf, lend):
    assert len(os.sched_getaffinity(0)) >= 2, "core lending needs a core for each node (CI has two)"
    deployment = start_local(tiny_model_dir, num_prefill=1, num_decode=1, log_dir=tmp_path, proxy_cores=0,
                             node_args=NODE_ARGS, proxy_args=KV_PATH_ONLY, lend_cores=lend)
    try:
        wait_healthy(deployment, 120)
        assert len(deployment.cluster.files) == int(lend)
        client = client_for(deployment)
        name = model_name(client)
        prompts = random_prompts(6, [20, 60, 120], seed=11)
        expected = [hf_greedy(hf, p, 48)[0] for p in prompts]
        _, tokenizer = hf
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: client.completions.create(model=name, prompt=p, max_tokens=48,
                                                                        temperature=0), prompts))
        for i, (result, want) in enumerate(zip(results, expected)):
            assert result.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), f"prompt {i}"
        assert_kv_path_only(deployment)
        steps = borrowed_steps(deployment.health_urls["decode0"])
        assert steps > 0 if lend else steps == 0
    finally:
        deployment.stop()
    assert all(not path.exists() for path in deployment.cluster.files)
