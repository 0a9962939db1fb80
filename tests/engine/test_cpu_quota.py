"""engine.cpu_quota: a container's CPU limit (cgroup v2 cpu.max, v1 cfs quota), the smallest on the
way to the root, cuts the cores a node sizes its threads to and pdserve up plans with."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_quota
from engine.cpu_quota import cpu_quota as read_quota
from engine.cpu_quota import usable_cores


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_takes_the_smallest_quota_on_the_way_up(tmp_path):
    root = tmp_path / "cgroup"
    _write(tmp_path / "self", "0::/kubepods/pod1/ctr\n")
    _write(root / "kubepods" / "cpu.max", "max 100000\n")
    _write(root / "kubepods" / "pod1" / "cpu.max", "150000 100000\n")
    _write(root / "kubepods" / "pod1" / "ctr" / "cpu.max", "400000 100000\n")
    assert read_quota(tmp_path / "self", root) == 1.5


def test_cgroup_v2_without_a_limit_and_a_namespaced_root(tmp_path):
    root = tmp_path / "cgroup"
    _write(tmp_path / "self", "0::/\n")  # inside a cgroup namespace: the container's own is the root
    _write(root / "cpu.max", "max 100000\n")
    assert read_quota(tmp_path / "self", root) is None
    _write(root / "cpu.max", "100000 100000\n")
    assert read_quota(tmp_path / "self", root) == 1.0


def test_cgroup_v1_cfs_quota(tmp_path):
    root = tmp_path / "cgroup"
    _write(tmp_path / "self", "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    folder = root / "cpu,cpuacct" / "docker" / "abc"
    _write(folder / "cpu.cfs_quota_us", "250000\n")
    _write(folder / "cpu.cfs_period_us", "100000\n")
    assert read_quota(tmp_path / "self", root) == 2.5
    _write(folder / "cpu.cfs_quota_us", "-1\n")
    assert read_quota(tmp_path / "self", root) is None


def test_nothing_readable_is_no_quota(tmp_path):
    assert read_quota(tmp_path / "missing", tmp_path) is None


@pytest.mark.parametrize(("quota", "expected"), [(None, 2), (8.0, 2), (1.0, 1), (1.5, 1), (0.5, 1)])
def test_usable_cores_are_the_affinity_cut_to_the_quota(monkeypatch, quota, expected):
    monkeypatch.setattr(cpu_quota, "cpu_quota", lambda: quota)
    monkeypatch.setattr(cpu_quota.os, "sched_getaffinity", lambda pid: {3, 1})
    assert usable_cores() == [1, 3][:expected]


def test_a_node_without_cores_given_sizes_its_threads_to_the_quota(monkeypatch):
    from node import process

    monkeypatch.setattr(process, "usable_cores", lambda: [0])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    process.pin_cpus(None)
    assert threads == [1]


def test_cores_are_numbers_and_ranges_as_taskset_writes_them():
    from node.process import _cores

    assert _cores("0,1") == {0, 1} and _cores("0-3") == {0, 1, 2, 3} and _cores("0-1,8-9, 12") == {0, 1, 8, 9, 12}
    for bad in ("", "a", "3-1", "0-x"):
        with pytest.raises(ValueError, match="core numbers and ranges"):
            _cores(bad)
