"""CPU time of a running process, as the benchmarks report it beside their throughput."""

from __future__ import annotations

import os
import resource
from pathlib import Path


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of process pid so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def own_cpu_s() -> float:
    """This process's CPU seconds so far (a benchmark's in-process load generator)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
