"""CPU time of a running process, as the benchmarks report it beside their throughput."""

from __future__ import annotations

import ctypes
import os
import resource
import time
from pathlib import Path

_LIBC = ctypes.CDLL(None, use_errno=True)


def process_cpu_s(pid: int) -> float:
    """CPU seconds of every thread of process pid so far, live and exited, to the nanosecond.

    The kernel's CPU clock of the process (clock_getcpuclockid); /proc/<pid>/stat's utime + stime
    where that clock is refused. /proc counts in clock ticks (10 ms), too coarse for a short run of
    a process that mostly waits: it reads 0.0 there."""
    clock = ctypes.c_int()
    if _LIBC.clock_getcpuclockid(pid, ctypes.byref(clock)) == 0:
        try:
            return time.clock_gettime(clock.value)
        except OSError:
            pass
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def own_cpu_s() -> float:
    """This process's CPU seconds so far (a benchmark's in-process load generator)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
