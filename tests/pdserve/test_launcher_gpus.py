"""`pdserve up` on GPUs: which node gets which GPU (--gpus, per-pool lists, the visible GPUs), the
flags and environment a node is started with, a shared GPU's memory split, and the engine's GPU
memory budget from its share. No GPU needed: the plan and the argv are checked, nothing runs."""

import pytest

from engine.config import CacheConfig
from engine.kv_cache import gpu_budget_bytes
from pdserve import launcher
from pdserve.cluster import Cluster
from pdserve.gpus import gpu_plan, visible_gpus

GIB = 1 << 30


def test_nodes_spread_over_the_visible_gpus_round_robin():
    assert gpu_plan(1, 1, visible=["0", "1"]) == ["0", "1"]
    assert gpu_plan(2, 2, visible=["0", "1"]) == ["0", "1", "0", "1"]
    assert gpu_plan(1, 1, visible=[]) == [None, None]  # a CPU machine: each node's own device
    assert gpu_plan(1, 3, gpus=["2", "3"], visible=["0", "1", "2", "3"]) == ["2", "3", "2", "3"]


def test_per_pool_lists():
    assert gpu_plan(2, 2, prefill_gpus=["0"], decode_gpus=["1", "2"]) == ["0", "0", "1", "2"]
    assert gpu_plan(1, 2, decode_gpus=["3"], visible=["0", "1"]) == ["0", "3", "3"]
    assert gpu_plan(0, 2, decode_gpus=["1", "0"]) == ["1", "0"]
    with pytest.raises(ValueError, match="the other pool has no GPU"):
        gpu_plan(1, 1, decode_gpus=["1"])


def test_a_tensor_parallel_node_takes_that_many_consecutive_gpus():
    eight = [str(i) for i in range(8)]
    assert gpu_plan(0, 2, visible=eight, decode_tp=4) == ["0,1,2,3", "4,5,6,7"]
    assert gpu_plan(1, 2, visible=eight, prefill_tp=2, decode_tp=4) == ["0,1", "2,3,4,5", "0,1,2,3"]
    assert gpu_plan(0, 3, visible=["0", "1", "2"], decode_tp=2) == ["0,1", "0,1", "0,1"]  # "2" alone is no pair
    assert gpu_plan(2, 1, prefill_gpus=["0", "1"], decode_gpus=["2", "3"], prefill_tp=2, decode_tp=2) == [
        "0,1", "0,1", "2,3"]
    assert gpu_plan(0, 2, visible=[], decode_tp=2) == [None, None]  # the CPU: ranks are processes
    with pytest.raises(ValueError, match="tensor-parallel size 4 needs 4 GPUs; its pool has 2"):
        gpu_plan(0, 1, gpus=["0", "1"], decode_tp=4)


def test_up_refuses_a_tensor_parallel_size_under_one_in_one_line(capsys, tiny_model_dir):
    from pdserve.cli import main

    assert main(["up", "--model", str(tiny_model_dir), "--prefill-tp", "0"]) == 2
    assert capsys.readouterr().err.strip().endswith("--prefill-tp must be >= 1, got 0")


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert visible_gpus() == ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert visible_gpus() == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: no GPU
    assert visible_gpus() == []


@pytest.fixture
def started(monkeypatch, tiny_model_dir):
    """start_local's processes as (name, argv, env), none of them run."""
    calls = []
    monkeypatch.setattr(Cluster, "start",
                        lambda self, name, argv, log_dir=None, env=None: calls.append((name, argv, env or {})))

    def start(gpus, node_args=()):
        calls.clear()
        launcher.start_local(tiny_model_dir, num_prefill=1, num_decode=2, node_args=list(node_args), pin_cpus=False,
                             lend_cores=False, gpus=gpus)
        return {name: (argv, env) for name, argv, env in calls}

    return start


def _flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def test_each_node_sees_its_gpu_alone_and_shares_split_the_memory(started):
    nodes = started(["0", "1", "1"])
    assert nodes["prefill0"][1] == {"CUDA_VISIBLE_DEVICES": "0"} and _flag(nodes["prefill0"][0], "--device") == "cuda"
    assert _flag(nodes["prefill0"][0], "--gpu-memory-utilization") is None  # alone on GPU 0
    for name in ("decode0", "decode1"):
        argv, env = nodes[name]
        assert env == {"CUDA_VISIBLE_DEVICES": "1"}
        assert float(_flag(argv, "--gpu-memory-utilization")) == pytest.approx(0.45)
    assert nodes["proxy"][1] == {}


def test_a_users_budget_or_share_wins_and_no_gpus_changes_nothing(started):
    nodes = started(["0", "0", "0"], node_args=["--kv-cache-memory-gb", "10"])
    assert all(_flag(argv, "--gpu-memory-utilization") is None for argv, _ in nodes.values())
    nodes = started([None, None, None])
    assert all(env == {} and "--device" not in argv for argv, env in nodes.values())


def test_the_gpu_budget_is_the_share_less_the_weights_and_never_past_free_memory():
    # alone on a 141 GiB GPU, 2 GiB of weights: 0.9 x 141 - 2
    assert gpu_budget_bytes(139 * GIB, 141 * GIB, 2 * GIB, 0.9) == int(0.9 * 141 * GIB - 2 * GIB)
    # the second of two nodes on it (the first holds 63.45 GiB): its own half, not all that is free
    assert gpu_budget_bytes(75 * GIB, 141 * GIB, 2 * GIB, 0.45) == int(0.45 * 141 * GIB - 2 * GIB)
    # another process took most of it: what is free, less the reserve
    assert gpu_budget_bytes(20 * GIB, 141 * GIB, 2 * GIB, 0.9) == int(20 * GIB - 0.05 * 141 * GIB)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)
