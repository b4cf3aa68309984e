# syntax=docker/dockerfile:1
# Serving: SGLang's CUDA image + specloop with the sglang extra (build context: repo root).
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
FROM ${SGLANG_IMAGE}

WORKDIR /opt/specloop
COPY pyproject.toml README.md ./
COPY serving serving
COPY feedback feedback
COPY trainer trainer
COPY kernels kernels
COPY infra infra
COPY benchmarks benchmarks

# The image's sglang and CUDA torch satisfy `.[sglang]` and stay as they are. The checks fail the
# build, not the first request: pinned version, our plugin entry point visible to SGLang, and
# every SGLang symbol specloop relies on present in the installed source.
RUN python3 -m pip install --no-cache-dir ".[sglang]" \
 && python3 -c "import importlib.metadata as m; v = m.version('sglang'); assert v == '0.5.23', v" \
 && python3 -c "import importlib.metadata as m; assert 'specloop' in m.entry_points(group='sglang.srt.plugins').names" \
 && python3 -c "from serving.sglang.source_check import require_sglang; require_sglang()"

ENV SGLANG_PLUGINS=specloop \
    MLFLOW_DISABLE_TELEMETRY=true
EXPOSE 8000
CMD ["specloop", "serve"]
