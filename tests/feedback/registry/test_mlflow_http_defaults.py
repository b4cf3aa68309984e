"""The trainer and serving both reach MLflow through feedback/: importing it must shorten the
MLflow client's HTTP retries (its defaults retry a dead server for minutes per call)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SHORT = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


@pytest.mark.parametrize("module", ["feedback.registry.drafter_registry", "feedback.ops.ops_log"])
def test_importing_the_mlflow_path_sets_short_http_retries(module):
    env = {k: v for k, v in os.environ.items() if k not in SHORT}
    code = (f"import json, os, {module}; "
            f"print(json.dumps({{k: os.environ.get(k) for k in {sorted(SHORT)!r}}}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT,
                         timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == SHORT


def test_an_operators_own_setting_wins():
    env = {**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
    code = ("import os, feedback.registry.drafter_registry; "
            "print(os.environ['MLFLOW_HTTP_REQUEST_MAX_RETRIES'], os.environ['MLFLOW_HTTP_REQUEST_TIMEOUT'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT,
                         timeout=120, check=True)
    assert out.stdout.split() == ["3", "30"]
