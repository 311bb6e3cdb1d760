# One image for the control plane (web, worker, beat) and the host worker, which runs node agents
# and replica supervisors. Build target `gpu` adds a CUDA build of torch and vLLM in its own
# environment (/opt/vllm, as tools/vllm_env.sh keeps it apart on a developer machine).
FROM python:3.11-slim-bookworm AS fathom
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 FATHOM_DATA_DIR=/data OMP_NUM_THREADS=1
# util-linux: flock, which starts node agents under their lock.
RUN apt-get update && apt-get install -y --no-install-recommends util-linux && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY training training
COPY serving serving
COPY hostworker hostworker
RUN pip install --index-url "$TORCH_INDEX" torch==2.13.0 && pip install .
COPY . .
RUN useradd --create-home fathom && mkdir -p /data && chown fathom /data
USER fathom
EXPOSE 8000
WORKDIR /app/platform
CMD ["python", "-m", "controlplane.web", "8000"]

# A GPU host: build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 --target gpu.
FROM fathom AS gpu
USER root
RUN python -m venv /opt/vllm && /opt/vllm/bin/pip install "vllm==0.32.0"
ENV FATHOM_VLLM_PYTHON=/opt/vllm/bin/python FATHOM_SERVING_DEVICE=cuda
USER fathom

# `docker build .` builds the control-plane image (the last stage is the default target).
FROM fathom
