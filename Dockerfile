# The control plane and the training node agent (web, worker, beat share this image).
# GPU hosts use a CUDA build of torch: pass --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
FROM python:3.11-slim-bookworm
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 FATHOM_DATA_DIR=/data OMP_NUM_THREADS=1
RUN apt-get update && apt-get install -y --no-install-recommends util-linux && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY training training
COPY serving serving
RUN pip install --index-url "$TORCH_INDEX" torch==2.13.0 && pip install .
COPY . .
RUN useradd --create-home fathom && mkdir -p /data && chown fathom /data
USER fathom
EXPOSE 8000
WORKDIR /app/platform
CMD ["python", "-m", "controlplane.web", "8000"]
