"""UCX under NIXL: the settings chosen per address and memory kind, the RDMA ports found, an
operator's settings winning, and the READ transport read from UCX's protocol report (a written
report, and a real NIXL read of host memory between two processes)."""

import logging
import os
import time
from pathlib import Path

import pytest

from kv_transfer import ucx
from kv_transfer.ucx import ProtocolReport, Transport, apply_settings, rdma_ports, ucx_settings
from tests.kv_transfer.helpers import poll_until
from tests.kv_transfer.test_connectors import holders, reader  # noqa: F401 - holders: a fixture


@pytest.mark.parametrize(("host", "on_gpu", "interface", "ports", "expected"), [
    ("127.0.0.1", False, None, [], {"NET_DEVICES": "lo"}),
    ("127.0.0.1", True, None, [], {"NET_DEVICES": "lo", "CUDA_IPC_ENABLE_GET_ZCOPY": "y"}),
    ("10.0.0.5", False, "eth0", [], {"NET_DEVICES": "eth0"}),
    ("10.0.0.5", True, "eth0", ["mlx5_0:1", "mlx5_1:1"],
     {"NET_DEVICES": "eth0,mlx5_0:1,mlx5_1:1", "CUDA_IPC_ENABLE_GET_ZCOPY": "y"}),
    ("203.0.113.9", True, None, ["mlx5_0:1"], {"CUDA_IPC_ENABLE_GET_ZCOPY": "y"}),  # behind NAT: UCX's choice
    ("203.0.113.9", False, None, [], {}),
])
def test_settings_for_each_address_and_memory_kind(host, on_gpu, interface, ports, expected):
    assert ucx_settings(host, on_gpu, interface, ports) == expected


def test_expandable_segments_are_named_as_a_risk_to_gpu_kv_reads_only():
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        warning = ucx.allocator_warning(True, {name: "max_split_size_mb:128, expandable_segments:True"})
        assert warning is not None and name in warning and "cuda_ipc" in warning
    assert ucx.allocator_warning(False, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) is None
    assert ucx.allocator_warning(True, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) is None
    assert ucx.allocator_warning(True, {}) is None


def test_rdma_ports_are_the_active_ones(tmp_path):
    for device, port, state in [("mlx5_0", "1", "4: ACTIVE"), ("mlx5_1", "1", "1: DOWN"), ("mlx5_2", "1", "4: ACTIVE"),
                                ("mlx5_2", "2", "2: INIT")]:
        folder = tmp_path / device / "ports" / port
        folder.mkdir(parents=True)
        (folder / "state").write_text(state + "\n")
    assert rdma_ports(tmp_path) == ["mlx5_0:1", "mlx5_2:1"]
    assert rdma_ports(tmp_path / "absent") == []


def test_an_operators_settings_win(monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "eth1")
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    assert apply_settings({"NET_DEVICES": "lo", "CUDA_IPC_ENABLE_GET_ZCOPY": "y"}) == {
        "NET_DEVICES": "eth1", "CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


REPORT = """\
[1.0] [h:1:0]   | r self cfg#0                                              |
[1.0] [h:1:0]   | remote memory write by ucp_put* from host memory to host  |
[1.0] [h:1:0]   | 0..inf | zero-copy   | cma/memory                          |
[1.0] [h:1:0]   +--------+-------------+-------------------------------------+
[1.1] [h:1:0]           ucp_worker.c:1912 UCX  WARN  some transport warning
[1.2] [h:1:0]   | r intra-node cfg#2                                        |
[1.2] [h:1:0]   | remote memory read by ucp_get*(multi) into cuda memory from cuda |
[1.2] [h:1:0]   +--------+--------------------+------------------+
[1.2] [h:1:0]   | Range  | Description        | Config           |
[1.2] [h:1:0]   +--------+--------------------+------------------+
[1.2] [h:1:0]   | 0..8K  | short              | tcp/lo           |
[1.2] [h:1:0]   | 8K..inf | software emulation | tcp/lo          |
[1.2] [h:1:0]   +--------+--------------------+------------------+
"""


def test_the_read_transport_and_warnings_come_from_the_report(tmp_path, caplog):
    path = tmp_path / "ucx.1.log"
    report = ProtocolReport(path)
    assert report.poll() is None  # no file yet
    cut = REPORT.index("software")  # a line half written
    path.write_text(REPORT[:cut])
    with caplog.at_level(logging.WARNING, logger="kv_transfer.ucx"):
        assert report.poll() is None
    assert any("some transport warning" in r.getMessage() for r in caplog.records)
    with open(path, "a") as file:
        file.write(REPORT[cut:])
    transport = report.poll()
    assert transport == Transport("tcp/lo", "software emulation", "cuda") and transport.is_tcp_fallback
    assert not Transport("cuda_ipc/cuda", "zero-copy", "cuda").is_tcp_fallback


def test_gpu_memory_is_named_with_its_device_in_the_report(tmp_path):
    """UCX names GPU memory by its system device ("cuda/GPU0", "cuda/dev[0]"), host memory as
    "host memory" (as in UCX_PROTO_INFO=y logs of NIXL pulls between GPUs)."""
    path = tmp_path / "ucx.1.log"
    path.write_text("""\
[2.0] [h:1:0]   | ucp_context_0 intra-node cfg#3                                     |
[2.0] [h:1:0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0] |
[2.0] [h:1:0]   +--------+-----------+---------------+
[2.0] [h:1:0]   | 0..inf | zero-copy | cuda_ipc/cuda |
[2.0] [h:1:0]   +--------+-----------+---------------+
""")
    transport = ProtocolReport(path).poll()
    assert transport == Transport("cuda_ipc/cuda", "zero-copy", "cuda") and not transport.is_tcp_fallback


def test_a_real_read_reports_its_transport(holders, monkeypatch):  # noqa: F811 - the fixture imported above
    """NIXL on host memory between two processes: the connector names what UCX chose."""
    if ucx._report_file is None:  # UCX's logging is the connector's to choose here, not the caller's
        monkeypatch.delenv("UCX_LOG_FILE", raising=False)
        monkeypatch.delenv("UCX_PROTO_INFO", raising=False)
    holder = holders("nixl", seed=2)
    connector, _ = reader("nixl")
    try:
        connector.start_read("t-0", holder.lease("t-0", [1, 2, 3]), [4, 5, 6])
        results = poll_until(connector, {"t-0"}, timeout_s=30)
        assert results["t-0"].is_ok
        deadline = time.monotonic() + 10
        while connector.transport is None and time.monotonic() < deadline:
            connector._report_checked_at = 0.0
            connector._check_ucx_report()
            time.sleep(0.05)
        transport = connector.transport
        assert transport is not None and transport.memory == "host" and "/" in transport.transport, transport
    finally:
        connector.close()


def test_the_gpu_read_benchmark_runs_on_host_memory(tmp_path):
    """benchmarks/kv_transfer_gpu.py (the GPU slot's NIXL check) at toy size on the CPU: each
    setting's processes read the holder's blocks, and the transport is named. Its reader and holder processes keep
    the PYTHONPATH they were given (the GPU check installs its wheels there): a sitecustomize on
    it notes every process that starts."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nwith open(os.path.join(os.path.dirname(__file__), 'pids'), 'a') "
                                           "as f:\n    f.write(f'{os.getpid()}\\n')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")} | {"PDSERVE_RESULTS_DIR": str(tmp_path),
                                                                               "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "benchmarks/kv_transfer_gpu.py", "--device", "cpu", "--blocks", "8",
                           "--repeats", "1"], cwd=repo, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [record] = tmp_path.glob("kv_transfer_gpu-*.json")
    settings = json.loads(record.read_text())["result"]["settings"]
    assert set(settings) == {"pdserve", "ucx", "ucx-poll", "ucx-streams", "before"}
    for result in settings.values():
        assert result["gb_s"] > 0 and "/" in result["transport"] and result["equal"] is True, result
    assert settings["before"]["env"]["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "auto"
    assert settings["ucx-poll"]["env"]["UCX_CUDA_IPC_MAX_POLL"] == "256"
    assert settings["ucx-streams"]["env"]["UCX_CUDA_IPC_MAX_STREAMS"] == "64"
    # a descriptor per scattered block; the nodes' settings also read into contiguous blocks, merged into one
    contiguous = [settings[name].pop("contiguous") for name in ("pdserve", "ucx", "ucx-poll", "ucx-streams")]
    assert all(c["descriptors"] == 1 and c["equal"] is True for c in contiguous)
    assert "contiguous" not in settings["before"]
    for result in (*settings.values(), *contiguous):
        assert 0 < result["transfer_ms"] <= result["ms"], result
    assert all(result["descriptors"] == 8 for result in settings.values())
    assert len(set((site / "pids").read_text().split())) == 1 + 5 * 2  # this run, each setting's reader and holder
    # The docs' renderer takes such a record (CPU runs are left out there: taken as a GPU run here).
    from benchmarks import render_results

    [record] = render_results.load(tmp_path)
    record["result"]["device"] = "cuda"
    block = render_results.render([record])[0]["kv_transfer_gpu"]
    assert all(f"{result['transport']}" in block for result in settings.values()) and "GB/s" in block, block
    assert "| pdserve | contiguous | 1 |" in block, block


def test_a_killed_processs_report_folder_is_removed_by_the_next_and_nothing_else(tmp_path):
    import subprocess
    import sys

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    gone = tmp_path / f"pdserve-ucx-{ended.stdout.strip()}-abc"
    alive = tmp_path / f"pdserve-ucx-{os.getpid()}-def"
    other = tmp_path / "pdserve-ucx-notapid-ghi"
    for folder in (gone, alive, other):
        folder.mkdir()
        (folder / "ucx.1.log").write_text("x")
    ucx._remove_folders_of_ended_processes(tmp_path)
    assert not gone.exists() and alive.exists() and other.exists()


def test_exit_now_flushes_output_removes_the_report_folder_and_exits_with_the_code(tmp_path):
    """A process ends through exit_now (skipping NIXL's teardown) having written what it printed, both
    Python's buffers and C's, and with its UCX report folder gone."""
    import subprocess
    import sys

    code = ("import ctypes, logging, os, sys\n"
            "from kv_transfer import ucx\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
            "report = ucx.enable_protocol_report()\n"
            "report.write_text('x')\n"
            "print(report.parent, end='')\n"
            "logging.getLogger('t').info('logged')\n"
            "libc = ctypes.CDLL(None)\n"
            "libc.fputs(b' from C', ctypes.c_void_p.in_dll(libc, 'stdout'))\n"
            "ucx.exit_now(3)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_") and k != "PYTHONUNBUFFERED"}
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 3, proc.stderr
    folder, c_part = proc.stdout.split(" ", 1)
    assert c_part == "from C" and "logged" in proc.stderr
    assert Path(folder).parent == tmp_path and not Path(folder).exists()
