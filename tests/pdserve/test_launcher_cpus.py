"""Where `pdserve up` puts its nodes: cores split among them with none left over, and for small
models one core kept for the proxy and its clients when every node still gets one of its own."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from pdserve import cli, cores, launcher, ports
from pdserve.cluster import Cluster


def test_cores_are_split_evenly_and_all_used():
    assert cores.cpu_plan([0, 1], 1) == ["0,1"]
    assert cores.cpu_plan([0, 1], 2) == ["0", "1"]
    assert cores.cpu_plan([0, 1, 2, 3, 4], 2) == ["0,1", "2,3,4"]
    assert cores.cpu_plan([0, 1], 3) == ["0,1"] * 3  # fewer cores than nodes: all share
    assert cores.cpu_plan([0, 1], 0) == []


def test_a_tensor_parallel_node_gets_a_share_per_rank_where_the_cores_cover_them():
    assert cores.cpu_plan([0, 1, 2], 2, weights=[1, 2]) == ["0", "1,2"]
    assert cores.cpu_plan([0, 1, 2, 3, 4, 5], 2, weights=[2, 1]) == ["0,1,2,3", "4,5"]
    assert cores.cpu_plan([0, 1, 2], 2, proxy_cores=1, weights=[1, 1]) == ["1", "2"]
    assert cores.cpu_plan([0, 1], 2, weights=[1, 2]) == ["0", "1"]  # too few for the ranks: one share each


def test_up_pins_a_tensor_parallel_node_to_a_core_per_rank_and_lends_none(tiny_model_dir, monkeypatch):
    started = {}
    monkeypatch.setattr(launcher, "usable_cores", lambda: [0, 1, 2, 3, 4, 5])
    monkeypatch.setattr(Cluster, "start", lambda self, name, argv, log_dir=None, env=None: started.update({name: argv}))

    def flag(argv, name):
        return argv[argv.index(name) + 1] if name in argv else None

    launcher.start_local(tiny_model_dir, num_prefill=2, num_decode=1, tensor_parallel=(1, 2), proxy_cores=1,
                         lend_cores=True).cluster.stop()  # removes any lending flag file (no process was started)
    assert [flag(started[n], "--cpus") for n in ("prefill0", "prefill1", "decode0")] == ["1", "2", "3,4,5"]
    assert [flag(started[n], "--tensor-parallel-size") for n in ("prefill0", "decode0")] == [None, "2"]
    assert not any("--lend-flag" in argv or "--borrow-flag" in argv for argv in started.values())
    launcher.start_local(tiny_model_dir, num_prefill=1, num_decode=1, proxy_cores=0, lend_cores=True).cluster.stop()
    assert "--lend-flag" in started["prefill0"] and "--borrow-flag" in started["decode0"]  # one rank each: lent


def test_proxy_cores_come_off_the_front_while_a_core_is_left():
    assert cores.cpu_plan([0, 1], 1, proxy_cores=1) == ["1"]
    assert cores.cpu_plan([0, 1, 2, 3], 2, proxy_cores=1) == ["1", "2,3"]
    assert cores.cpu_plan([4, 5, 6, 7], 1, proxy_cores=2) == ["6,7"]
    assert cores.cpu_plan([0], 1, proxy_cores=1) == ["0"]  # nothing would be left: no reservation


def test_parameters_are_counted_from_the_headers(tiny_model_dir):
    tensors = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    assert cores._num_parameters(tiny_model_dir) == sum(t.numel() for t in tensors.values())


def test_a_small_model_gets_a_proxy_core_only_when_each_node_keeps_one(tiny_model_dir, monkeypatch):
    assert cores.auto_proxy_cores(tiny_model_dir, num_cores=2, num_nodes=1, dtype="bfloat16") == 1
    assert cores.auto_proxy_cores(tiny_model_dir, num_cores=2, num_nodes=2, dtype="bfloat16") == 0
    assert cores.auto_proxy_cores(tiny_model_dir, num_cores=1, num_nodes=1, dtype="bfloat16") == 0
    # tiny's float32 weights (13.6 MB) are past the line: its node measured faster on both cores
    assert cores.auto_proxy_cores(tiny_model_dir, num_cores=2, num_nodes=1) == 0
    assert cores.auto_proxy_cores(tiny_model_dir, num_cores=2, num_nodes=1, dtype="auto") == 0  # auto: float32 here
    monkeypatch.setattr(cores, "_num_parameters", lambda _: 135_000_000)  # SmolLM2-135M's size
    assert cores.auto_proxy_cores(tiny_model_dir, num_cores=2, num_nodes=1, dtype="bfloat16") == 0


def test_the_dtype_for_the_proxy_core_rule_comes_from_the_node_flags():
    assert cores.node_dtype(["--num-blocks", "8", "--dtype", "bfloat16"]) == "bfloat16"
    assert cores.node_dtype(["--dtype=float16"]) == "float16"
    assert cores.node_dtype(["--num-blocks", "8"]) is None


def test_the_launchers_dtype_sizes_are_the_engines():
    from engine.config import DTYPES

    assert {name: dtype.itemsize for name, dtype in DTYPES.items()} == cores._BYTES_PER_ELEMENT


def test_the_torch_free_dtype_choices_are_the_engines():
    from engine.config import DTYPES
    from engine.protocol import DTYPE_CHOICES

    assert ("auto", *DTYPES) == DTYPE_CHOICES


def test_a_colocated_small_model_runs_beside_the_proxy(tiny_model_dir, tmp_path):
    """Live: the node of a colocated `tiny` deployment in bfloat16 (the dtype read from the node
    flags) is pinned off the first core (on a machine of one core, to that core) and answers; the
    node and the proxy froze their start-up objects."""
    all_cores = sorted(os.sched_getaffinity(0))
    expected = set(all_cores[1:]) or set(all_cores)
    deployment = launcher.start_local(tiny_model_dir, num_prefill=0, num_decode=1, log_dir=tmp_path,
                                      node_args=["--dtype", "bfloat16"])
    try:
        launcher.wait_healthy(deployment, 120)
        node = deployment.cluster.process("decode0")
        assert os.sched_getaffinity(node.pid) == expected
        reply = httpx.post(deployment.base_url + "/v1/completions", timeout=60,
                           json={"model": Path(tiny_model_dir).name, "prompt": "def f(", "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    finally:
        deployment.stop()
    # start-up's objects frozen out of the collector's reach (engine.gc_policy), in both processes
    for name in ("decode0", "proxy"):
        frozen = re.findall(r"(\d+) start-up objects frozen", (tmp_path / f"{name}.log").read_text())
        assert len(frozen) == 1 and int(frozen[0]) > 20_000, (name, frozen)


def test_lending_pairs_prefill_node_i_with_decode_node_i_only_where_cores_are_their_own(tmp_path):
    cluster = Cluster()
    flags = cores.lending_flags(cluster, ["0", "1"], num_prefill=1, num_decode=1)
    assert list(flags) == [0] and flags[0].read_bytes() == b"\x01" and cluster.files == [flags[0]]
    assert list(cores.lending_flags(cluster, ["0", "1", "2"], num_prefill=2, num_decode=1)) == [0]
    assert cores.lending_flags(cluster, ["0,1"] * 3, num_prefill=2, num_decode=1) == {}  # shared cores
    assert cores.lending_flags(cluster, ["0", "1", "2"], num_prefill=1, num_decode=2) == {}  # two borrowers
    assert cores.lending_flags(cluster, ["0,1"], num_prefill=0, num_decode=1) == {}  # colocated
    assert cores.lending_flags(cluster, [], num_prefill=1, num_decode=1) == {}  # not pinned
    cluster.stop()
    assert not any(path.exists() for path in cluster.files)


def test_cores_are_lent_for_models_of_64_mb_and_up(tiny_model_dir, monkeypatch):
    assert not cores.auto_lend_cores(tiny_model_dir)  # 13.6 MB in float32: measured slower with it
    assert not cores.auto_lend_cores(tiny_model_dir, "bfloat16")
    monkeypatch.setattr(cores, "_num_parameters", lambda _: 111_000_000)  # `small`
    assert cores.auto_lend_cores(tiny_model_dir, "bfloat16") and cores.auto_lend_cores(tiny_model_dir)


def test_free_ports_come_from_below_the_ephemeral_range(monkeypatch):
    """Ports the kernel hands out itself (outgoing connections, bind(0): UCX's, say) can take a
    port between free_port and the server's bind; free_port draws below that range, distinct
    ports, each bindable now."""
    import socket

    monkeypatch.delenv(ports.PORT_RANGE_VARIABLE, raising=False)  # set for pytest-xdist's workers

    low = ports._ephemeral_range()[0]
    drawn = [ports.free_port() for _ in range(64)]
    assert len(set(drawn)) == 64
    assert all(ports._LOWEST_PORT <= port < low for port in drawn)
    for port in drawn:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_free_port_takes_the_kernels_choice_where_the_range_leaves_no_room(monkeypatch):
    monkeypatch.delenv(ports.PORT_RANGE_VARIABLE, raising=False)
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (ports._LOWEST_PORT + 100, 60999))
    assert ports.port_range() is None
    drawn = {ports.free_port() for _ in range(8)}
    assert len(drawn) == 8 and all(port >= ports._LOWEST_PORT + 100 for port in drawn)


def test_free_ports_come_from_the_range_the_environment_names(monkeypatch):
    monkeypatch.setenv(ports.PORT_RANGE_VARIABLE, "41000-41031")
    drawn = {ports.free_port() for _ in range(16)}
    assert len(drawn) == 16 and all(41000 <= port <= 41031 for port in drawn)


def test_side_by_side_processes_get_disjoint_shares_of_the_ports(monkeypatch):
    monkeypatch.setenv(ports.PORT_RANGE_VARIABLE, "41000-41999")
    assert [ports.share_of_range(i, 3) for i in range(3)] == ["41000-41332", "41333-41665", "41666-41998"]
    assert ports.share_of_range(0, 4) is None  # 250 ports each: too few
    monkeypatch.delenv(ports.PORT_RANGE_VARIABLE)
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (ports._LOWEST_PORT + 100, 60999))
    assert ports.share_of_range(1, 2) == "63268-65535"  # no room below: above the ephemeral range


@pytest.mark.parametrize("text", ["41000", "41000-", "a-b", "500-600", "41000-40000", "41000-70000"])
def test_a_malformed_port_range_is_a_value_error_naming_it(monkeypatch, text):
    monkeypatch.setenv(ports.PORT_RANGE_VARIABLE, text)
    with pytest.raises(ValueError, match=f"PDSERVE_PORT_RANGE={text!r}: two port numbers LOW-HIGH"):
        ports.free_port()


def test_up_with_a_malformed_port_range_is_one_line_before_anything_starts(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setenv(ports.PORT_RANGE_VARIABLE, "9000")
    monkeypatch.setattr(Cluster, "start", lambda *_, **__: pytest.fail("a process was started"))
    assert cli.main(["up", "--model", str(tiny_model_dir)]) == 2
    *_, last = capsys.readouterr().err.strip().splitlines()  # after the settings it read
    assert last.startswith("pdserve up: PDSERVE_PORT_RANGE='9000': two port numbers LOW-HIGH")


def test_free_port_skips_a_port_in_use(monkeypatch):
    import socket

    monkeypatch.delenv(ports.PORT_RANGE_VARIABLE, raising=False)

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        draws = iter([taken, taken + 1 if taken < 65535 else taken - 1])
        monkeypatch.setattr(ports.random, "choice", lambda _: next(draws))
        monkeypatch.setattr(ports, "_ephemeral_range", lambda: (65536, 65536))
        assert ports.free_port() != taken


def test_metrics_port_base_gives_node_i_port_base_plus_i(tiny_model_dir, monkeypatch):
    started = {}
    monkeypatch.setattr(Cluster, "start", lambda self, name, argv, log_dir, env=None:
                        started.__setitem__(name, argv))
    deployment = launcher.start_local(tiny_model_dir, num_prefill=2, num_decode=1, metrics_port_base=19100,
                                      pin_cpus=False)
    health_ports = {name: argv[argv.index("--health-port") + 1] for name, argv in started.items() if name != "proxy"}
    assert health_ports == {"prefill0": "19100", "prefill1": "19101", "decode0": "19102"}
    assert deployment.health_urls["decode0"] == "http://127.0.0.1:19102"


def test_metrics_port_base_names_a_port_in_use(monkeypatch):
    import argparse
    import socket

    # NOTE: the first port free and the second taken here, both outside the kernel's ephemeral range
    # (ports.free_port), where any other process's outgoing connection could take the first meanwhile.
    with socket.socket() as taken:
        for _ in range(20):
            base = ports.free_port()
            try:
                taken.bind(("127.0.0.1", base + 1))
                break
            except OSError:
                continue
        taken.listen()
        port = base + 1
        args = argparse.Namespace(metrics_port_base=base, prefill=1, decode=1, host="0.0.0.0", node_host=None)
        try:
            launcher._check_node_addresses(args)
        except ValueError as exc:
            assert f"port {port} (decode0's /metrics)" in str(exc)
        else:
            raise AssertionError("a port in use was not named")


def test_a_proxy_on_every_interface_keeps_its_nodes_on_loopback(tiny_model_dir, monkeypatch):
    started = {}
    monkeypatch.setattr(Cluster, "start", lambda self, name, argv, log_dir, env=None:
                        started.__setitem__(name, argv))
    deployment = launcher.start_local(tiny_model_dir, host="0.0.0.0", pin_cpus=False)
    hosts = {name: argv[argv.index("--host") + 1] for name, argv in started.items()}
    assert hosts == {"prefill0": "127.0.0.1", "decode0": "127.0.0.1", "proxy": "0.0.0.0"}
    assert started["proxy"][started["proxy"].index("--decode") + 1].startswith("127.0.0.1:")
    assert deployment.base_url.startswith("http://127.0.0.1:")
    import argparse

    wildcard = argparse.Namespace(metrics_port_base=None, prefill=1, decode=1, host="0.0.0.0", node_host="0.0.0.0")
    try:
        launcher._check_node_addresses(wildcard)
    except ValueError as exc:
        assert "--node-host 0.0.0.0" in str(exc)
    else:
        raise AssertionError("a wildcard node host was taken")
