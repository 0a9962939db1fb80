"""`pdserve env`: what this machine offers pdserve, for an operator's first look and for a bug report:
the versions, the CPU and which compiled kernel levels it runs (and what the others would need),
the kernel backend each device gets, the GPUs torch sees, the NIXL build and its plugins, the RDMA
ports UCX could use and the UCX_* settings already in the environment."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform

# The distributions whose versions decide how pdserve behaves, in the order they are shown.
PACKAGES = ("torch", "triton", "transformers", "tokenizers", "safetensors", "nixl", "xgrammar", "fastapi",
            "uvicorn", "pyzmq", "msgspec")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")


def main(args: argparse.Namespace) -> int:
    report = collect()
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


def collect() -> dict:
    """Everything `pdserve env` reports, as plain data."""
    import torch

    from engine.config import resolve_device
    from kernels.cpu import native
    from kernels.cpu.levels import LEVELS
    from kv_transfer.ucx import rdma_ports
    from pdserve.cli import version

    features = native.cpu_features()
    levels = [{"name": level.name, "built": native.library_path(level) is not None,
               "missing_features": sorted(level.cpu_features - features)} for level in LEVELS]
    runs = [level["name"] for level in levels if level["built"] and not level["missing_features"]]
    auto = resolve_device("auto")
    return {
        "pdserve": version(),
        "python": platform.python_version(),
        "packages": {name: _version_of(name) for name in PACKAGES},
        "torch_cuda": torch.version.cuda,
        "cpu": {"name": native.cpu_name(), "cores_usable": len(os.sched_getaffinity(0)),
                "cores_online": os.cpu_count(),
                "features": sorted(features & set().union(*(level.cpu_features for level in LEVELS)))},
        "cpu_kernels": {"levels": levels, "runs": runs, "loaded": runs[-1] if runs else None},
        "device_auto": auto,
        "kernel_backends": _backends(auto),
        "gpus": _gpus(torch),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "nixl": _nixl(),
        "rdma_ports": rdma_ports(),
        "ucx_environment": {key: value for key, value in sorted(os.environ.items()) if key.startswith("UCX_")},
    }


def _version_of(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _backends(auto: str) -> dict[str, str]:
    """Each device kind's backend as `--kernel-backend auto` picks it (its start-up log line), or
    why it cannot run."""
    from kernels.select import select_backend

    found = {}
    for device in dict.fromkeys(["cpu", auto]):
        try:
            found[device] = select_backend(device).describe()
        except (ValueError, RuntimeError) as exc:
            found[device] = f"none: {exc}"
    return found


def _gpus(torch) -> list[dict] | str:
    """The GPUs torch sees: name, memory (total and free now), compute capability, UUID; a string
    saying why where CUDA cannot be asked."""
    if torch.version.cuda is None:
        return []
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        gpus = []
        for index in range(count):
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
            gpus.append({"index": index, "name": props.name, "memory_gib": round(total / 2**30, 1),
                         "free_gib": round(free / 2**30, 1), "compute_capability": f"{props.major}.{props.minor}",
                         "uuid": str(getattr(props, "uuid", ""))})
        return gpus
    except RuntimeError as exc:
        return f"CUDA error: {exc}"


def _nixl() -> dict | None:
    """The NIXL build `import nixl` would load (by the CUDA major version it detects, without loading
    it) and the plugins that build carries; None where NIXL is not installed."""
    version = _version_of("nixl")
    if version is None:
        return None
    try:
        from nixl_meta_utils import detect_cuda_major

        major = detect_cuda_major()
    except ImportError:
        major = None
    builds = [f"nixl-cu{major}"] if major is not None else ["nixl-cu13", "nixl-cu12"]
    for build in builds:
        try:
            files = importlib.metadata.distribution(build).files or []
        except importlib.metadata.PackageNotFoundError:
            continue
        plugins = sorted({f.name[len("libplugin_"):-len(".so")] for f in files
                          if f.name.startswith("libplugin_") and f.name.endswith(".so")})
        return {"version": version, "build": build, "plugins": plugins}
    return {"version": version, "build": None, "plugins": []}


def render(report: dict) -> str:
    """The report as lines for people."""
    packages = report["packages"]
    versions = "; ".join(f"{name} {value}" for name, value in packages.items() if value is not None)
    absent = [name for name, value in packages.items() if value is None]
    cpu = report["cpu"]
    kernels = report["cpu_kernels"]
    built = [level["name"] for level in kernels["levels"] if level["built"]]
    cannot = [f"{level['name']} needs {', '.join(level['missing_features'])}"
              for level in kernels["levels"] if level["missing_features"]]
    lines = [
        f"pdserve {report['pdserve']}",
        f"python {report['python']}; {versions}" + (f"; not installed: {', '.join(absent)}" if absent else ""),
        f"torch build: {'CUDA ' + report['torch_cuda'] if report['torch_cuda'] else 'CPU only'}",
        f"CPU: {cpu['name']}, {cpu['cores_usable']} cores usable of {cpu['cores_online']}; "
        f"features: {' '.join(cpu['features']) or 'none of the kernels'}",
        f"compiled CPU kernels: built {', '.join(built) or 'none'}; "
        f"this CPU runs {', '.join(kernels['runs']) or 'none'}"
        + (f" (loaded: {kernels['loaded']})" if kernels["loaded"] else "")
        + (f"; {'; '.join(cannot)}" if cannot else ""),
        f"--device auto: {report['device_auto']}",
    ]
    lines += [f"kernel backend on {device}: {text}" for device, text in report["kernel_backends"].items()]
    gpus = report["gpus"]
    if isinstance(gpus, str):
        lines.append(f"GPUs: {gpus}")
    elif not gpus:
        lines.append("GPUs: none visible to torch" + ("" if report["torch_cuda"] else " (a CPU-only torch)"))
    else:
        lines += [f"GPU {gpu['index']}: {gpu['name']}, {gpu['memory_gib']} GiB ({gpu['free_gib']} free), "
                  f"compute {gpu['compute_capability']}, {gpu['uuid']}" for gpu in gpus]
    if report["cuda_visible_devices"] is not None:
        lines.append(f"CUDA_VISIBLE_DEVICES={report['cuda_visible_devices']}")
    nixl = report["nixl"]
    lines.append("NIXL: not installed (--transfer-backend nixl unavailable)" if nixl is None else
                 f"NIXL {nixl['version']} ({nixl['build'] or 'no build for this machine'}); "
                 f"plugins: {', '.join(nixl['plugins']) or 'none'}")
    lines.append(f"RDMA ports: {', '.join(report['rdma_ports']) or 'none (UCX across hosts: TCP)'}")
    ucx = report["ucx_environment"]
    lines.append("UCX_* set: " + (" ".join(f"{k}={v}" for k, v in ucx.items()) if ucx else "none"))
    return "\n".join(lines)
