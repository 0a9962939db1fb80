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


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch, tmp_path):
    from pdserve import gpus

    monkeypatch.setattr(gpus, "_DEV", str(tmp_path))  # no driver devices either
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


def test_nodes_sharing_part_of_a_tensor_parallel_group_split_that_memory(started):
    nodes = started(["0", "0,1", "1"])  # decode0's ranks on GPUs 0 and 1, each shared with another node
    assert all(float(_flag(argv, "--gpu-memory-utilization")) == pytest.approx(0.45) for argv, _ in
               (nodes[n] for n in ("prefill0", "decode0", "decode1")))
    nodes = started(["0", "1,2", "3"])
    assert all(_flag(argv, "--gpu-memory-utilization") is None for argv, _ in nodes.values())


@pytest.mark.parametrize("given", [["--gpu-memory-utilization", "0.8"], ["--gpu-memory-utilization=0.8"]])
def test_a_users_share_is_what_the_nodes_on_a_gpu_hold_in_all(started, given):
    nodes = started(["0", "0", "1"], node_args=given)
    for name, share in (("prefill0", 0.4), ("decode0", 0.4)):
        argv = nodes[name][0]
        assert float(argv[len(argv) - 1 - argv[::-1].index("--gpu-memory-utilization") + 1]) == pytest.approx(share)
    argv = nodes["decode1"][0]  # alone on GPU 1: the user's own flag, as given, and no other
    assert argv.count("--gpu-memory-utilization") == given.count("--gpu-memory-utilization") and given[-1] in argv


def test_up_with_device_cuda_n_puts_every_node_on_that_gpu_splitting_it(monkeypatch, tiny_model_dir, capsys):
    from pdserve.cli import main

    calls = {}
    monkeypatch.setattr(launcher, "start_local", lambda *a, **kw: calls.update(kw) or (_ for _ in ()).throw(
        KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        main(["up", "--model", str(tiny_model_dir), "--device", "cuda:1"])
    assert calls["gpus"] == ["1", "1"]
    node_args = calls["node_args"]
    assert node_args[node_args.index("--device") + 1] == "cuda"  # the node sees GPU 1 alone, as cuda
    assert main(["up", "--model", str(tiny_model_dir), "--device", "cuda:1", "--gpus", "0"]) == 2
    assert "give --device cuda" in capsys.readouterr().err.strip().splitlines()[-1]


def test_gpu_nodes_lend_no_cores(monkeypatch, tiny_model_dir):
    started = {}
    monkeypatch.setattr(launcher, "usable_cores", lambda: [0, 1, 2, 3, 4, 5])
    monkeypatch.setattr(Cluster, "start", lambda self, name, argv, log_dir=None, env=None: started.update({name: argv}))
    for gpus, node_args in (([None, None], []), (["0", "0"], []), ([None, None], ["--device", "cuda"])):
        started.clear()
        launcher.start_local(tiny_model_dir, num_prefill=1, num_decode=1, proxy_cores=0, lend_cores=True, gpus=gpus,
                             node_args=node_args).cluster.stop()
        lends = "--lend-flag" in started["prefill0"] and "--borrow-flag" in started["decode0"]
        assert lends == (gpus == [None, None] and not node_args), (gpus, node_args)


def test_visible_gpus_without_nvidia_smi_count_the_driver_devices(monkeypatch, tmp_path):
    from pdserve import gpus

    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-modeset"):
        (tmp_path / name).touch()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(gpus, "_DEV", str(tmp_path))
    assert visible_gpus() == ["0", "1"]


def test_a_start_cut_short_stops_what_it_started(monkeypatch, tiny_model_dir):
    """A failure (or a signal's exception) part way through start_local leaves no process behind."""
    started, stopped = [], []

    def start(self, name, argv, log_dir=None, env=None):
        if name == "decode0":
            raise KeyboardInterrupt
        started.append(name)

    monkeypatch.setattr(Cluster, "start", start)
    monkeypatch.setattr(Cluster, "stop", lambda self, *a, **kw: stopped.append(True))
    with pytest.raises(KeyboardInterrupt):
        launcher.start_local(tiny_model_dir, num_prefill=1, num_decode=1, pin_cpus=False, gpus=["0", "0"])
    assert started == ["prefill0"] and stopped == [True]
