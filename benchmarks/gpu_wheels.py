"""The wheels a lent GPU machine needs (its python3 is 3.12 and has no network; see
benchmarks/gpu_checks.sh): pdserve's runtime dependencies the device image lacks, at the versions
this checkout's venv runs, downloaded as cp312 manylinux wheels into .whl/ (git-ignored), and the
NIXL wheel cut to what pdserve loads (the UCX plugin and the libraries NIXL itself links; not the
expert-parallel kernels, the other transfer plugins, UCX's perftest or the telemetry exporters),
so the lot fits the 64 MiB a device call carries. Prints the total.

    .venv/bin/python benchmarks/gpu_wheels.py [--dir .whl]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Missing from the device image (KINDS.md lists what it has).
# With their own requirements the image lacks (opentelemetry-api: fastapi imports it; apache-tvm-ffi:
# xgrammar) or may hold too old (typing-extensions >= 4.16 for pydantic, yarl >= 1.25.1 for aiohttp,
# anyio and idna for openai's httpx2).
PACKAGES = ("msgspec", "pyzmq", "fastapi", "starlette", "uvicorn", "httptools", "uvloop", "pydantic", "pydantic_core",
            "annotated-types", "annotated-doc", "typing-inspection", "typing-extensions", "opentelemetry-api",
            "xgrammar", "apache-tvm-ffi", "gguf", "httpx", "aiohttp", "yarl", "nixl", "nixl-cu13",
            # the e2e tests' OpenAI client, with what it needs beyond the image (or newer)
            "openai", "httpx2", "httpcore2", "truststore", "jiter", "sniffio", "anyio", "idna")
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64",
                                                                                      "manylinux1_x86_64"]
# In the NIXL wheel: paths (prefixes or fragments) pdserve never loads.
NIXL_DROPPED = ("nixl_ep_", "libucx_perftest", "libplugin_AZURE_BLOB", "libplugin_GDS", "libplugin_GPUNETIO",
                "libplugin_GUSLI", "libplugin_INFINIA", "libplugin_LIBFABRIC", "libplugin_OBJ", "libplugin_POSIX",
                "libtelemetry_exporter", "libtrace_backend")


def download(folder: Path) -> None:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in PACKAGES]
    argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
            "3.12", "--implementation", "cp", "-d", str(folder), *[f"--platform={p}" for p in PLATFORMS], *pins]
    subprocess.run(argv, check=True)


def strip_wheel(path: Path) -> None:
    """Rewrite the wheel without the dropped files (and their RECORD lines)."""
    kept = path.with_suffix(".tmp")
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(kept, "w", zipfile.ZIP_DEFLATED) as target:
        record_name = next(n for n in source.namelist() if n.endswith(".dist-info/RECORD"))
        dropped = {n for n in source.namelist() if any(part in n for part in NIXL_DROPPED)}
        for info in source.infolist():
            if info.filename in dropped or info.filename == record_name:
                continue
            target.writestr(info, source.read(info.filename))
        lines = [line for line in source.read(record_name).decode().splitlines()
                 if line and line.split(",", 1)[0] not in dropped]
        target.writestr(record_name, "\n".join(lines) + "\n")
    kept.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=str(REPO / ".whl"))
    folder = Path(parser.parse_args().dir)
    folder.mkdir(exist_ok=True)
    download(folder)
    for wheel in folder.glob("nixl_cu13-*.whl"):
        strip_wheel(wheel)
    total = sum(p.stat().st_size for p in folder.glob("*.whl"))
    for wheel in sorted(folder.glob("*.whl")):
        print(f"{wheel.stat().st_size / 2**20:8.1f} MiB  {wheel.name}")
    print(f"{total / 2**20:8.1f} MiB in all (a device call carries 64 MiB with the working tree)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
