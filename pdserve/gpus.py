"""Which GPUs each node of `pdserve up` runs on: the plan over the GPUs given or visible, the
checks on --gpus and the tensor-parallel sizes, and the flags that split a shared GPU's memory."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

from pdserve.cores import node_flag

# NOTE: the share of a GPU its nodes hold in all when several share it (split evenly).
_SHARED_GPU_UTILIZATION = 0.9


def gpu_plan(num_prefill: int, num_decode: int, gpus: list[str] | None = None, prefill_gpus: list[str] | None = None,
             decode_gpus: list[str] | None = None, visible: list[str] = (), prefill_tp: int = 1,
             decode_tp: int = 1) -> list[str | None]:
    """The GPUs of each node (prefill nodes first), as CUDA_VISIBLE_DEVICES names them: a node of
    tensor-parallel size k takes k consecutive GPUs, round robin over prefill_gpus / decode_gpus
    for its pool where given, else over gpus, else over the visible GPUs; all None (each node's
    own default device) where there are none. Raises ValueError when a pool has fewer GPUs than
    one of its nodes needs."""
    pool = gpus or list(visible)
    sizes = [prefill_tp] * num_prefill + [decode_tp] * num_decode
    if not (prefill_gpus or decode_gpus):
        return _gpu_groups(pool, sizes) if pool else [None] * len(sizes)
    prefill, decode = prefill_gpus or pool, decode_gpus or pool
    if (num_prefill and not prefill) or (num_decode and not decode):
        raise ValueError("--prefill-gpus / --decode-gpus: the other pool has no GPU; give it its own, or --gpus")
    return _gpu_groups(prefill, sizes[:num_prefill]) + _gpu_groups(decode, sizes[num_prefill:])


def _gpu_groups(pool: list[str], sizes: list[int]) -> list[str]:
    """Each node its size consecutive GPUs of pool, in turn; past the pool's end nodes share
    them from its start again."""
    groups, at = [], 0
    for size in sizes:
        if size > len(pool):
            raise ValueError(f"a node of tensor-parallel size {size} needs {size} GPUs; its pool has "
                             f"{len(pool)} ({','.join(pool)})")
        if at + size > len(pool):
            at = 0
        groups.append(",".join(pool[at : at + size]))
        at = (at + size) % len(pool)
    return groups


def check_tp(args: argparse.Namespace) -> None:
    """Raises ValueError for a tensor-parallel size under 1."""
    for flag, size in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        if size < 1:
            raise ValueError(f"{flag} must be >= 1, got {size}")


def gpu_flags(gpus: list[str | None], index: int, node_args: list[str] | tuple[str, ...]) -> list[str]:
    """A node's flags for its GPUs: the device, and where k nodes share one of them (wholly or a
    tensor-parallel group's part), a 1/k share of the memory the nodes may hold in all (the
    user's --gpu-memory-utilization, else 0.9); none where the user gave each node a budget
    (--kv-cache-memory-gb)."""
    flags = [] if node_flag(node_args, "--device") is not None else ["--device", "cuda"]
    mine = gpus[index].split(",")
    sharing = max(sum(1 for other in gpus if other is not None and gpu in other.split(",")) for gpu in mine)
    if sharing > 1 and node_flag(node_args, "--kv-cache-memory-gb") is None:
        share = float(node_flag(node_args, "--gpu-memory-utilization") or _SHARED_GPU_UTILIZATION)
        flags += ["--gpu-memory-utilization", f"{share / sharing:.4f}"]
    return flags


def gpu_list(text: str | None, flag: str) -> list[str] | None:
    """The GPUs a flag's value names (None where the flag was not given); ValueError where it names none."""
    if text is None:
        return None
    ids = [part.strip() for part in text.split(",") if part.strip()]
    if not ids:
        raise ValueError(f"{flag} {text!r} names no GPU (e.g. {flag} 0,1)")
    return ids


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as a child's CUDA_VISIBLE_DEVICES names them: that
    variable's entries where it is set, else one index per GPU nvidia-smi lists, else (no
    nvidia-smi, as in a container with the driver's devices alone) one per /dev/nvidiaN."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [part.strip() for part in listed.split(",") if part.strip() and part.strip() != "-1"]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        devices = [p for p in Path(_DEV).glob("nvidia*") if p.name.removeprefix("nvidia").isdigit()]
        return [str(i) for i in range(len(devices))]
    return [str(i) for i, line in enumerate(line for line in out.splitlines() if line.startswith("GPU "))]


_DEV = "/dev"
