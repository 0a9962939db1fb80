"""The processes of one local deployment: Cluster starts, restarts (through a standby process)
and stops them in drain order; Supervisor restarts any that ends on its own, with backoff."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.cpu_quota import HostLoad
from pdserve.huge_heap import huge_heap_environ_here
from pdserve.settings import CONFIG_ENV
from pdserve.standby import NODE_COMMANDS as STANDBY_COMMANDS

# NOTE: the order processes stop in: the proxy first (it stops accepting and lets open streams
# finish within its grace period while the nodes still serve them), then the prefill nodes, then
# the decode nodes (whose running requests the proxy no longer waits for).
_STOP_ORDER = ("proxy", "prefill", "decode")


# How the launcher runs pdserve's commands; a standby process (pdserve.standby) becomes these.
PDSERVE_COMMAND = (sys.executable, "-m", "pdserve.cli")


# The host's cores at most this busy (all of them together, between two supervisor ticks) count
# as quiet for starting the standby process.
_QUIET_HOST_SHARE = 0.3


@dataclass
class Cluster:
    """The processes of one local deployment, each restartable with the argv it started with;
    stop() ends every one of them (by process group: each child leads its own session)."""

    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    argvs: dict[str, list[str]] = field(default_factory=dict)
    envs: dict[str, dict[str, str]] = field(default_factory=dict)  # each process's additions to the environment
    log_dir: Path | None = None
    files: list[Path] = field(default_factory=list)  # removed by stop() (core-lending flags)
    standby: subprocess.Popen | None = None  # a node process with its imports done (pdserve.standby)

    def start(self, name: str, argv: list[str], log_dir: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        self.log_dir = log_dir or self.log_dir
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        stdout = open(self.log_dir / f"{name}.log", "ab") if self.log_dir else None  # noqa: SIM115
        # NOTE: children get every setting on their command line; the launcher's config file is
        # not theirs (its flat keys are `pdserve up`'s).
        self.envs[name] = dict(env or {})
        child_env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV} | self.envs[name]
        proc = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
                                start_new_session=True, env=child_env)
        if stdout:
            stdout.close()  # the child holds its own copy
        self.argvs[name] = list(argv)
        self.procs = [(n, p) for n, p in self.procs if n != name] + [(name, proc)]
        return proc

    def restart(self, name: str) -> subprocess.Popen:
        """Start name again with its argv (same ports); the old process must have ended. A node
        becomes the standby process where one is up (start_standby), which is then replaced."""
        argv = self.argvs[name]
        standby, self.standby = self.standby, None
        if (standby is not None and standby.poll() is None and tuple(argv[:3]) == PDSERVE_COMMAND
                and argv[3] in STANDBY_COMMANDS):
            log = str(self.log_dir / f"{name}.log") if self.log_dir else None
            order = {"argv": argv[3:], "env": self.envs.get(name) or {}, "log": log}
            try:
                standby.stdin.write(json.dumps(order).encode() + b"\n")
                standby.stdin.close()
            except OSError:  # it died meanwhile: a fresh start below
                pass
            else:
                self.procs = [(n, p) for n, p in self.procs if n != name] + [(name, standby)]
                self.start_standby()
                return standby
        elif standby is not None:
            self.standby = standby
        return self.start(name, argv, env=self.envs.get(name))

    @property
    def has_standby(self) -> bool:
        return self.standby is not None and self.standby.poll() is None

    def start_standby(self) -> None:
        """Have a standby node process ready for restart() (pdserve.standby), unless one is up."""
        if self.standby is not None and self.standby.poll() is None:
            return
        env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
        self.standby = subprocess.Popen([sys.executable, "-m", "pdserve.standby"], stdin=subprocess.PIPE,
                                        start_new_session=True, env=huge_heap_environ_here(env) or env)

    def process(self, name: str) -> subprocess.Popen:
        return dict(self.procs)[name]

    def dead(self) -> list[str]:
        return [f"{name} (exit {p.returncode})" for name, p in self.procs if p.poll() is not None]

    def dead_names(self) -> list[str]:
        return [name for name, p in self.procs if p.poll() is not None]

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM each group of processes in _STOP_ORDER, waiting up to timeout_s for each
        group before SIGKILL."""
        for kind in _STOP_ORDER:
            group = [p for name, p in self.procs if name.startswith(kind)]
            for proc in group:
                if proc.poll() is None:
                    _signal_group(proc, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for proc in group:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(proc, signal.SIGKILL)
                    proc.wait()
        if self.standby is not None:
            _signal_group(self.standby, signal.SIGKILL)  # it serves nothing yet
            self.standby.wait()
            self.standby = None
        for path in self.files:
            path.unlink(missing_ok=True)


@dataclass
class Supervisor:
    """Restarts processes of a cluster that end on their own, with exponential backoff per
    process (initial_backoff_s doubling up to max_backoff_s; back to the start after a process
    has run healthy for reset_after_s). Driven by tick() from the launcher's loop."""

    cluster: Cluster
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 30.0
    reset_after_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    _backoff_s: dict[str, float] = field(default_factory=dict)
    _restart_at: dict[str, float] = field(default_factory=dict)
    _started_at: dict[str, float] = field(default_factory=dict)
    num_restarts: int = 0
    # Keep a standby node process ready (Cluster.start_standby): a restart then skips the imports.
    # A new standby starts standby_after_s after the last restart, not beside the restarting node
    # (its imports took a core from that node's start on two cores), and once the host has been
    # quiet (host_load at most _QUIET_HOST_SHARE) for standby_when_quiet_s, or standby_at_latest_s
    # after it was due: its imports (seconds of CPU) took a core from the first requests after ready.
    keep_standby: bool = False
    standby_after_s: float = 5.0
    standby_when_quiet_s: float = 1.0
    standby_at_latest_s: float = 15.0
    host_load: Callable[[], float | None] | None = None  # None: HostLoad() (engine.cpu_quota)
    _standby_due_at: float | None = None
    _quiet_since: float | None = None

    def tick(self) -> list[str]:
        """Schedule or carry out restarts; returns a line for each event (for the console)."""
        now, events = self.clock(), []
        last_restart = max(self._started_at.values(), default=-math.inf)
        if (self.keep_standby and not self._restart_at and now - last_restart >= self.standby_after_s
                and not self.cluster.has_standby and self._host_quiet(now)):
            self.cluster.start_standby()
            self._standby_due_at = self._quiet_since = None
        for name in self.cluster.dead_names():
            if name not in self._restart_at:
                code = self.cluster.process(name).returncode
                backoff = self._next_backoff(name, now)
                self._restart_at[name] = now + backoff
                events.append(f"{name} ended (exit {code}); restarting in {backoff:g} s")
            elif now >= self._restart_at[name]:
                del self._restart_at[name]
                had_standby = self.cluster.standby is not None
                proc = self.cluster.restart(name)
                self._started_at[name] = now
                self.num_restarts += 1
                how = "the standby process" if had_standby and self.cluster.standby is not proc else "a new process"
                events.append(f"{name} restarted (pid {proc.pid}, {how})")
        return events

    def _host_quiet(self, now: float) -> bool:
        """Whether the host has been quiet for standby_when_quiet_s, or the standby has waited
        standby_at_latest_s (counted from the first call since the last start)."""
        if self.host_load is None:
            self.host_load = HostLoad()
        share = self.host_load()
        if self._standby_due_at is None:
            self._standby_due_at = now
        if share is None or share > _QUIET_HOST_SHARE:
            self._quiet_since = None
        elif self._quiet_since is None:
            self._quiet_since = now
        return (now - self._standby_due_at >= self.standby_at_latest_s
                or (self._quiet_since is not None and now - self._quiet_since >= self.standby_when_quiet_s))

    def _next_backoff(self, name: str, now: float) -> float:
        ran_s = now - self._started_at.get(name, now)
        previous = self._backoff_s.get(name)
        if previous is None or ran_s >= self.reset_after_s:
            backoff = self.initial_backoff_s
        else:
            backoff = min(previous * 2, self.max_backoff_s)
        self._backoff_s[name] = backoff
        return backoff


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # the child leads its own session: only what we started
