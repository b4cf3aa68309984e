# syntax=docker/dockerfile:1
# Trainer: Ray actor distilling the drafter (build context: repo root) on the GPU compose reserves
# it (SPECLOOP_TRAINER_DEVICE=cuda; trainer/device.py).
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends curl \
 && rm -rf /var/lib/apt/lists/*
# The default Linux x86_64 torch wheel bundles its CUDA runtime; the host only needs the driver.
RUN python -m pip install --no-cache-dir torch==2.13.0

WORKDIR /opt/specloop
COPY pyproject.toml README.md ./
COPY serving serving
COPY feedback feedback
COPY trainer trainer
COPY kernels kernels
COPY infra infra
COPY benchmarks benchmarks
RUN python -m pip install --no-cache-dir .

ENV RAY_AUTH_MODE=disabled \
    MLFLOW_DISABLE_TELEMETRY=true
CMD ["specloop", "train"]
