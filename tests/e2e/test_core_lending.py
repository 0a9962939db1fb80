"""Core lending live (`pdserve up`'s default where nodes have cores of their own): a pinned
1P+1D deployment on this host, a burst whose decoding outlasts its prefills. The decode node runs
steps on the prefill node's core once that one has nothing to prefill, and every output still
equals transformers' greedy one, every prompt through the KV path. With another process busy on
the prefill node's core (a bounded busy loop started here), it never borrows that core."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.launcher import start_local, wait_healthy
from tests.e2e import test_pipeline as pipeline
from tests.e2e.conftest import KV_PATH_ONLY, NODE_ARGS, assert_kv_path_only, borrowed_steps
from tests.e2e.test_pipeline import client_for, hf_greedy, model_name, random_prompts

hf = pipeline.hf  # transformers on the same checkpoint, the oracle (a module fixture)


# NOTE: the control, a deployment without lending whose decode node never counts a borrowed step,
# runs on test_pipeline's disaggregated deployment (test_completion_greedy_equals_transformers...).
@pytest.mark.parametrize("busy_loop", [False, True])
def test_the_decode_node_borrows_the_idle_prefill_core_and_stays_exact(tiny_model_dir, tmp_path, hf, busy_loop):
    assert len(os.sched_getaffinity(0)) >= 2, "core lending needs a core for each node (CI has two)"
    prefill_core = sorted(os.sched_getaffinity(0))[0]  # _cpu_plan gives prefill0 the first core (no proxy core)
    hog = subprocess.Popen([sys.executable, "-c", BUSY_LOOP],
                           preexec_fn=lambda: os.sched_setaffinity(0, {prefill_core})) if busy_loop else None
    deployment = start_local(tiny_model_dir, num_prefill=1, num_decode=1, log_dir=tmp_path, proxy_cores=0,
                             node_args=NODE_ARGS, proxy_args=KV_PATH_ONLY, lend_cores=True)
    try:
        wait_healthy(deployment, 120)
        assert len(deployment.cluster.files) == 1
        client = client_for(deployment)
        name = model_name(client)
        prompts = random_prompts(6, [20, 60, 120], seed=11)
        expected = [hf_greedy(hf, p, 48)[0] for p in prompts]
        _, tokenizer = hf
        decode = deployment.health_urls["decode0"]
        # The decode node's verdict on the prefill core, from its windows while both idle (this
        # process's transformers run above kept both cores busy for a while).
        assert _lent_cores_free(decode, until=not busy_loop) == (not busy_loop)
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: client.completions.create(model=name, prompt=p, max_tokens=48,
                                                                        temperature=0), prompts))
        for i, (result, want) in enumerate(zip(results, expected)):
            assert result.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), f"prompt {i}"
        assert_kv_path_only(deployment)
        steps = borrowed_steps(decode)
        assert steps == 0 if busy_loop else steps > 0
    finally:
        deployment.stop()
        if hog is not None:
            hog.kill()
            hog.wait()
    assert all(not path.exists() for path in deployment.cluster.files)


BUSY_LOOP = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end:\n    pass\n"


def _lent_cores_free(health_url: str, until: bool, timeout_s: float = 30.0) -> bool:
    """The decode node's pdserve_node_lent_cores_free, polled until it reads `until` or for timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        page = httpx.get(health_url + "/metrics", timeout=5).text
        [line] = [x for x in page.splitlines() if x.startswith("pdserve_node_lent_cores_free{")]
        value = float(line.rsplit(" ", 1)[1]) == 1.0
        if value == until or time.monotonic() > deadline:
            return value
        time.sleep(0.1)
