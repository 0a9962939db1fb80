"""The cores this process may use: its affinity, cut to the CPU quota of its cgroup (a container's
CPU limit), so that thread counts follow what the scheduler grants rather than the host's cores;
and how busy cores are (/proc/stat), for core lending and for starting background work when the
host is quiet.

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


def read_core_times(cores: set[int], pid: int, path: str = "/proc") -> tuple[int, int] | None:
    """(busy, total) ticks of the given cores since boot, from /proc/stat's per-core lines, less the
    CPU time of process pid (the lender, which runs on those cores only; 0: none); None where that
    cannot be read (not Linux, a core missing, the process gone)."""
    busy = total = found = 0
    try:
        with open(f"{path}/stat") as f:
            for line in f:
                if not line.startswith("cpu") or line[3] == " ":
                    continue
                name, *fields = line.split()
                if int(name[3:]) in cores:
                    ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                    total += sum(ticks)
                    busy += sum(ticks) - ticks[3] - ticks[4]
                    found += 1
        if pid:
            with open(f"{path}/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            busy -= int(fields[11]) + int(fields[12])  # utime, stime of the whole process, in the same ticks
    except (OSError, ValueError, IndexError):
        return None
    return (busy, total) if found == len(cores) else None


class HostLoad:
    """Called again and again: the busy share of this process's usable cores since the last call
    (None the first time, or where /proc/stat cannot be read)."""

    def __init__(self) -> None:
        self._cores = set(usable_cores())
        self._last: tuple[int, int] | None = None

    def __call__(self) -> float | None:
        now = read_core_times(self._cores, 0)
        last, self._last = self._last, now
        if now is None or last is None or now[1] <= last[1]:
            return None
        return (now[0] - last[0]) / (now[1] - last[1])
