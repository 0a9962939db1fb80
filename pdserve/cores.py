"""Which cores each node of `pdserve up` runs on: each node's own cores, the core kept for the
proxy and its clients on small models, and the flag files of core lending between node pairs."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

from pdserve.cluster import Cluster

# NOTE: below this many bytes of weights a node's work per token is of the order of the proxy's
# and the client's (~0.2 ms of CPU per streamed token together), and a node whose OpenMP threads
# share their cores with them waits at every op's barrier for the one that was preempted.
# Measured on a 2-core Xeon with AMX, 64 streams of 64 tokens, one colocated node, 3 alternated
# pairs, on one core beside the proxy against both: `tiny` (3.4M parameters) in bfloat16 (6.8 MB)
# 6,377-7,338 tok/s against 4,573-5,423, in float32 (13.6 MB) 2,908-3,425 against 3,270-3,701;
# SmolLM-135M's shape in bfloat16 (268 MB) 445 against 650-692. The crossover lies between 6.8
# and 13.6 MB on this CPU; where exactly was not measured.
_PROXY_CORE_BELOW_WEIGHT_BYTES = 10_000_000
# NOTE: core lending (node.core_lending) from this many bytes of weights. Measured on a 2-core
# Zen 5 (AVX-512, AVX512-BF16), 1P+1D, 64 streams of 256 + 64 tokens, pdserve alone, alternated
# pairs, lending against none: `small` (111M parameters) in bfloat16 583.8 / 583.5 / 605.4 tok/s
# against 512.4 / 554.4 / 544.8, in float32 298.4 / 296.8 / 314.7 against 276.9 / 269.4 / 278.8;
# `tiny` (3.4M), 6 pairs, medians, float32 (13.6 MB) ~4,740 against ~5,190 (its two threads' step
# is mostly OpenMP barriers, which the proxy and client preempt), bfloat16 (6.8 MB) ~7,350
# against ~6,910. Between 13.6 MB and `small`'s 222 MB was not measured.
_LEND_CORES_FROM_WEIGHT_BYTES = 64 << 20
_BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}  # engine.config.DTYPES' sizes, torch-free


def auto_lend_cores(model_dir: Path, dtype: str | None = None) -> bool:
    """Core lending for models whose weights in the nodes' dtype (None or auto: float32, the CPU's)
    take at least _LEND_CORES_FROM_WEIGHT_BYTES."""
    return _num_parameters(model_dir) * _element_bytes(dtype) >= _LEND_CORES_FROM_WEIGHT_BYTES


def auto_proxy_cores(model_dir: Path, num_cores: int, num_nodes: int, dtype: str | None = None) -> int:
    """1 for a model whose weights in the nodes' dtype (None or auto: float32, the CPU's) take
    under _PROXY_CORE_BELOW_WEIGHT_BYTES, when every node still gets a core of its own; else 0."""
    if num_cores - 1 < num_nodes:
        return 0
    weight_bytes = _num_parameters(model_dir) * _element_bytes(dtype)
    return int(weight_bytes < _PROXY_CORE_BELOW_WEIGHT_BYTES)


def _element_bytes(dtype: str | None) -> int:
    """Core lending and the proxy's core are CPU matters: auto there is float32."""
    return _BYTES_PER_ELEMENT["float32" if dtype in (None, "auto") else dtype]


def node_flag(node_args: list[str] | tuple[str, ...], flag: str) -> str | None:
    """flag's value among a node's arguments (`--flag value` or `--flag=value`; the last one
    wins), or None."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument(flag, dest="value", default=None)
    return parser.parse_known_args(list(node_args))[0].value


def node_dtype(node_args: list[str] | tuple[str, ...]) -> str | None:
    """The --dtype among a node's arguments, or None."""
    return node_flag(node_args, "--dtype")


def _num_parameters(model_dir: Path) -> int:
    """From the safetensors headers (no weights read); 0 when there are none."""
    from safetensors import safe_open

    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="numpy") as f:  # NOTE: not "pt": that imports torch (~200 MB)
            names = f.keys()  # a safe_open handle is not iterable itself
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in names)
    return total


def cpu_plan(cores: list[int], num_nodes: int, proxy_cores: int = 0, weights: list[int] | None = None) -> list[str]:
    """Give each node its own cores where the machine has enough, after the first proxy_cores
    (kept for the proxy and clients while at least one core is left); else all nodes share.
    weights: each node's share (a tensor-parallel node's rank count), where the cores cover
    their sum; else every node gets an equal share."""
    if 0 < proxy_cores < len(cores):
        cores = cores[proxy_cores:]
    if num_nodes <= 0:
        return []
    if len(cores) < num_nodes:
        return [",".join(map(str, cores))] * num_nodes
    if weights is None or len(weights) != num_nodes or min(weights) < 1 or len(cores) < sum(weights):
        weights = [1] * num_nodes
    # Sizes follow the weights within one core, and every core goes to a node.
    ends = [sum(weights[:i]) for i in range(num_nodes + 1)]
    bounds = [end * len(cores) // ends[-1] for end in ends]
    return [",".join(map(str, cores[bounds[i]:bounds[i + 1]])) for i in range(num_nodes)]


def lending_flags(cluster: Cluster, cpus: list[str], num_prefill: int, num_decode: int) -> dict[int, Path]:
    """A core-lending flag file (node.core_lending) for each pair of prefill node i and decode
    node i, where every node has cores of its own and num_prefill >= num_decode; on tmpfs where
    there is one. Cluster.stop() removes them."""
    if not cpus or len(set(cpus)) < len(cpus) or not 0 < num_decode <= num_prefill:
        return {}
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    flags = {}
    for pair in range(num_decode):
        fd, name = tempfile.mkstemp(prefix=f"pdserve-lend-{os.getpid()}-{pair}-", dir=folder)
        os.close(fd)
        flags[pair] = Path(name)
        cluster.files.append(flags[pair])
        flags[pair].write_bytes(b"\x01")  # NOTE: node.core_lending's "busy": nothing lent until the lender says
    return flags
