"""The cores this process may use: its affinity, cut to the CPU quota of its cgroup (a container's
CPU limit), so that thread counts follow what the scheduler grants rather than the host's cores.

A quota of 1.5 cores gives 1 thread: the threads of an op wait at its barrier for the slowest, and
a throttled one stalls them all until the next quota period."""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_quota(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = _CGROUP_ROOT) -> float | None:
    """The smallest CPU quota (in cores) on the path from this process's cgroup to the root, from
    cgroup v2's cpu.max or v1's cpu.cfs_quota_us / cpu.cfs_period_us; None where none is set or
    none can be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            quotas += _walk(root, path, _v2_quota)
        elif "cpu" in controllers.split(","):
            quotas += _walk(root / controllers, path, _v1_quota)
    return min(quotas) if quotas else None


def usable_cores() -> list[int]:
    """This process's cores (its affinity, sorted), the first floor(quota) of them where a cgroup
    CPU quota is lower (at least one)."""
    cores = sorted(os.sched_getaffinity(0))
    quota = cpu_quota()
    if quota is not None and quota < len(cores):
        return cores[:max(1, math.floor(quota))]
    return cores


def _walk(base: Path, path: str, read) -> list[float]:
    found = []
    folder = base / path.lstrip("/")
    while True:
        quota = read(folder)
        if quota is not None:
            found.append(quota)
        if folder == base or base not in folder.parents:
            return found
        folder = folder.parent


def _v2_quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
