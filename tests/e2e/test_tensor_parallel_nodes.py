"""Split models served: two colocated nodes of TP=2 (`pdserve up --prefill 0 --decode-tp 2`, each
node a rank-0 process and one worker rank over gloo) answer greedy requests through the OpenAI
endpoint as transformers does; killing one node's worker rank fails that node as a whole (it
exits 1 and leaves no rank behind) while every stream in flight completes unchanged on the other."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import NODE_ARGS, _start
from tests.e2e.test_availability import MAX_TOKENS, _Streams
from tests.e2e.test_pipeline import client_for, hf, hf_greedy, model_name, random_prompts  # noqa: F401 - hf: fixture


@pytest.fixture(scope="module")
def split(tiny_model_dir, tmp_path_factory):
    deployment = _start(tiny_model_dir, tmp_path_factory.mktemp("tp-logs"), num_prefill=0, num_decode=2,
                        node_args=NODE_ARGS, tensor_parallel=(1, 2))
    yield deployment
    deployment.stop()


def worker_pids(pid: int) -> list[int]:
    """The child processes of pid (a TP node's worker ranks)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in children.read_text().split()] if children.exists() else []


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_greedy_through_the_endpoint_equals_transformers(split, hf):  # noqa: F811 - the fixture
    client = client_for(split)
    _, tokenizer = hf
    for prompt in random_prompts(4, [5, 40, 130]):
        want, want_logprobs = hf_greedy(hf, prompt, 16)
        response = client.completions.create(model=model_name(client), prompt=prompt, max_tokens=16,
                                             extra_body={"ignore_eos": True}, temperature=0.0, logprobs=1)
        choice = response.choices[0]
        assert choice.text == tokenizer.decode(want, skip_special_tokens=True)
        assert response.usage.completion_tokens == len(want)
        assert all(abs(a - b) < 1e-4 for a, b in zip(choice.logprobs.token_logprobs, want_logprobs))


def test_a_killed_rank_fails_its_node_and_every_stream_completes_elsewhere(split):
    client = client_for(split)
    prompts = [f"stream {i}: " + "the quick brown fox " * (2 + i) for i in range(4)]
    reference = [_text(client, p) for p in prompts]
    node = split.cluster.process("decode0")
    [worker] = worker_pids(node.pid)
    streams = _Streams(client, prompts)
    streams.wait_started(min_chunks=4)
    os.kill(worker, signal.SIGKILL)
    assert streams.results() == reference
    assert node.wait(timeout=30) == 1, "the node whose rank died exits 1 (its supervisor restarts it)"
    deadline = time.monotonic() + 10
    while is_alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_alive(worker)
    assert _text(client, prompts[0]) == reference[0]  # the other node serves on


def _text(client, prompt: str) -> str:
    response = client.completions.create(model=model_name(client), prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    return response.choices[0].text
