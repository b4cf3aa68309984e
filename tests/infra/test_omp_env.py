"""The CLI sets libgomp's idle spin before torch loads (why: infra/omp_env.py)."""

import os
import subprocess
import sys


def _spin_seen_by_a_fresh_cli(env: dict) -> str:
    code = "import os, infra.cli; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_the_cli_shortens_libgomps_spin_unless_the_user_chose():
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    assert _spin_seen_by_a_fresh_cli(env) == "10000 None"
    assert _spin_seen_by_a_fresh_cli({**env, "GOMP_SPINCOUNT": "5"}) == "5 None"
    assert _spin_seen_by_a_fresh_cli({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "None ACTIVE"


def test_nothing_imports_torch_before_the_spin_is_set():
    code = "import sys, infra.omp_env; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
