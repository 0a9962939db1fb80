"""UCX under NIXL: the settings a node chooses for its address and its KV memory, and the transport
UCX reports it picked for KV reads (its protocol report, UCX_PROTO_INFO, read from UCX's log file).

Settings (each only where the operator has not set that UCX_* variable):
- NET_DEVICES: on loopback `lo`; else the interface holding the advertised address, plus the
  machine's active RDMA ports (GPUDirect RDMA between hosts needs them; UCX's TCP interface alone
  would carry GPU memory at TCP's rate). UCX puts every usable interface's address into an agent's
  metadata; this keeps it to what peers can reach.
- CUDA_IPC_ENABLE_GET_ZCOPY=y for a KV cache in GPU memory: UCX turns GET over cuda_ipc off on GPUs
  without an active NVLink (one GPU alone, PCIe cards), and a READ (what a decode node does) then
  falls back to TCP through host memory ("software emulation" in the report).
- PROTO_INFO=y and LOG_FILE (a file of this process's): the protocol report and UCX's own warnings
  go there; the connector reads the transport of its reads from it and passes warnings on.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

logger = logging.getLogger(__name__)

SYSFS_INFINIBAND = Path("/sys/class/infiniband")


def ucx_settings(host: str, on_gpu: bool, interface: str | None, rdma_ports: list[str]) -> dict[str, str]:
    """The UCX_* settings (without the prefix) for a node advertising host, its KV cache in GPU
    memory or not; interface: the local interface holding host (None: none does, e.g. behind NAT);
    rdma_ports: the machine's active RDMA ports (rdma_ports())."""
    settings: dict[str, str] = {}
    if host.startswith("127.") or host == "localhost":
        # NOTE: measured to work on loopback, whereas UCX_TLS=sm,self fails to create the agent.
        settings["NET_DEVICES"] = "lo"
    elif interface is not None:
        settings["NET_DEVICES"] = ",".join([interface, *rdma_ports])
    if on_gpu:
        settings["CUDA_IPC_ENABLE_GET_ZCOPY"] = "y"
    return settings


def allocator_warning(on_gpu: bool, environ: dict[str, str]) -> str | None:
    """A warning when torch's CUDA allocator is set to expandable segments (PYTORCH_CUDA_ALLOC_CONF
    or PYTORCH_ALLOC_CONF): the KV cache is then virtual (VMM) memory, which UCX's cuda_ipc shares
    only through fabric handles (openucx/ucx#11548), and reads between processes on one host fall
    back to TCP through host memory. None where it does not apply."""
    if not on_gpu:
        return None
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        options = dict(part.split(":", 1) for part in environ.get(name, "").replace(" ", "").split(",") if ":" in part)
        if options.get("expandable_segments", "").lower() == "true":
            return (f"{name} sets expandable_segments: the KV cache is virtual (VMM) memory, which UCX may not "
                    "share over cuda_ipc, so KV reads can fall back to TCP; unset it on prefill and decode nodes")
    return None


def rdma_ports(root: Path = SYSFS_INFINIBAND) -> list[str]:
    """UCX names of this machine's RDMA ports whose state is ACTIVE (e.g. mlx5_0:1)."""
    ports = []
    for device in sorted(root.glob("*")) if root.is_dir() else []:
        for port in sorted((device / "ports").glob("*")):
            try:
                state = (port / "state").read_text()
            except OSError:
                continue
            if "ACTIVE" in state:
                ports.append(f"{device.name}:{port.name}")
    return ports


def apply_settings(settings: dict[str, str]) -> dict[str, str]:
    """Put settings into os.environ where unset; returns what is in effect for those names (the
    operator's value where there was one)."""
    for name, value in settings.items():
        os.environ.setdefault(f"UCX_{name}", value)
    return {name: os.environ[f"UCX_{name}"] for name in settings}


_report_file: Path | None = None  # this process's, once chosen (UCX reads its log file setting once)


def enable_protocol_report() -> Path | None:
    """Ask UCX for its protocol report in a log file of this process's (removed at exit), unless
    the operator set UCX_LOG_FILE or UCX_PROTO_INFO; returns the file UCX will write (None: not
    ours to read)."""
    global _report_file
    if _report_file is not None:
        # UCX took the setting when it loaded; a caller may have reset the environment since.
        pattern = str(_report_file.with_name("ucx.%p.log"))
        if os.environ.setdefault("UCX_LOG_FILE", pattern) == pattern:
            os.environ["UCX_PROTO_INFO"] = "y"
            return _report_file
        return None
    if "UCX_LOG_FILE" in os.environ or "UCX_PROTO_INFO" in os.environ:
        return None
    _remove_folders_of_ended_processes(Path(tempfile.gettempdir()))
    folder = Path(tempfile.mkdtemp(prefix=f"{_REPORT_PREFIX}{os.getpid()}-"))
    _report_file = folder / f"ucx.{os.getpid()}.log"
    os.environ["UCX_PROTO_INFO"] = "y"
    os.environ["UCX_LOG_FILE"] = str(folder / "ucx.%p.log")  # %p: a child process writes its own
    atexit.register(_remove_report_folder)
    return _report_file


_REPORT_PREFIX = "pdserve-ucx-"  # then the pid of the process whose report folder it is


def _remove_report_folder() -> None:
    if _report_file is not None:
        shutil.rmtree(_report_file.parent, ignore_errors=True)


def _remove_folders_of_ended_processes(parent: Path) -> None:
    """Remove this user's report folders in parent whose process is gone (one killed never removed
    its own)."""
    for folder in parent.glob(f"{_REPORT_PREFIX}*-*"):
        pid = folder.name.removeprefix(_REPORT_PREFIX).split("-")[0]
        with contextlib.suppress(OSError):
            if pid.isdigit() and folder.stat().st_uid == os.getuid() and not _alive(int(pid)):
                shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: alive, another user's
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def exit_now(code: int = 0) -> NoReturn:
    """End this process at once with code, after flushing its logs and its Python and C streams and
    removing its UCX report folder. For a process that loaded NIXL, whose exit-time teardown is not
    safe: UCX's aborts where a peer died first, and the libnl bundled in NIXL's wheel crashes in its
    destructor (SIGSEGV in rtnl_tc_unregister) where the host's own rdma-core (libibverbs and its
    providers, which load the system's libnl) is loaded beside it."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    _flush_c_streams()
    _remove_report_folder()
    os._exit(code)


@dataclass(frozen=True)
class Transport:
    """How UCX carries a READ of this memory kind: transport/device (e.g. cuda_ipc/cuda,
    rc_mlx5/mlx5_0:1, tcp/lo, cma/memory) and its method (zero-copy, software emulation, ...),
    for the largest messages."""

    transport: str
    method: str
    memory: str  # the reader's memory kind as UCX names it: host, cuda

    @property
    def is_tcp_fallback(self) -> bool:
        return self.transport.startswith("tcp/") or "emulation" in self.method


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def _flush_c_streams() -> None:
    with contextlib.suppress(OSError, AttributeError):
        _libc().fflush(None)


# "into host memory from host"; GPU memory with its device: "into cuda/GPU0 from cuda/dev[0]".
_TITLE = re.compile(r"remote memory read by ucp_get\S* into (\w[\w-]*)(?: memory|/\S+) from (\S+)")
_ROW = re.compile(r"\|\s*(\S+)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|\s*$")


class ProtocolReport:
    """Reads UCX's log file as it grows: the READ transport from the protocol report, and UCX's
    warnings and errors, passed to this module's logger once each."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # polled from a connector's progress thread and its node's loop
        self._offset = 0
        self._partial = ""
        self._in_read_table: str | None = None
        self._rows: list[re.Match] = []
        self.transport: Transport | None = None

    def poll(self) -> Transport | None:
        """Read what UCX wrote since the last call; returns the READ transport once known."""
        with self._lock:
            return self._poll()

    def _poll(self) -> Transport | None:
        _flush_c_streams()  # UCX writes its log file through a buffered C stream
        try:
            with open(self.path, encoding="utf-8", errors="replace") as file:
                file.seek(self._offset)
                text = file.read()
                self._offset = file.tell()
        except OSError:
            return self.transport
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self._line(line)
        return self.transport

    def _line(self, line: str) -> None:
        if " UCX  WARN" in line or " UCX  ERROR" in line:
            logger.warning("UCX: %s", line.split("UCX", 1)[1].strip(" :"))
            return
        title = _TITLE.search(line)
        if title:
            self._in_read_table, self._rows = title.group(1), []
            return
        if self._in_read_table is None:
            return
        row = _ROW.search(line)
        if row and ".." in row.group(1):
            self._rows.append(row)
        elif self._rows and re.search(r"\+-{3,}", line):  # the table's closing rule
            # NOTE: the rows go up by message size; the last one (..inf) is what a block takes.
            last = self._rows[-1]
            self.transport = Transport(last.group(3), last.group(2), self._in_read_table)
            self._in_read_table = None
