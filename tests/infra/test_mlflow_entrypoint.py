"""The MLflow image's entrypoint (infra/docker/mlflow-entrypoint.sh) decides like serving and the
trainer: dev mode on for every spelling pydantic reads as true, and a password refused exactly when
feedback/secrets.py would refuse it (compared trimmed and case-insensitively)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from feedback.secrets import DEFAULT_SECRETS, DefaultSecretError, check_secret

SCRIPT = Path(__file__).resolve().parents[2] / "infra/docker/mlflow-entrypoint.sh"
DEV_SPELLINGS = ["1", "true", "True", "TRUE", "t", "T", "yes", "YES", "y", "Y", "on", "ON", "On",
                 "0", "false", "FALSE", "f", "no", "n", "off", "OFF"]
PASSWORDS = sorted(DEFAULT_SECRETS) + ["MLflow", "Change-Me", " mlflow ", "ADMIN", "s3cr3t-x", "mlflow2"]


def _starts(password: str, dev: str) -> bool:
    out = subprocess.run(["sh", str(SCRIPT), "true"], capture_output=True, text=True, check=False,
                         env={"POSTGRES_PASSWORD": password, "SPECLOOP_DEV_MODE": dev, "PATH": "/usr/bin:/bin"})
    return out.returncode == 0


def _python_rule(password: str, dev: str) -> bool:
    try:
        check_secret("POSTGRES_PASSWORD", password, TypeAdapter(bool).validate_python(dev))
    except DefaultSecretError:
        return False
    return True


@pytest.mark.parametrize("dev", DEV_SPELLINGS)
def test_entrypoint_decides_like_feedback_secrets(dev):
    for password in PASSWORDS:
        assert _starts(password, dev) == _python_rule(password, dev), (password, dev)


def test_an_empty_password_needs_dev_mode():
    assert not _starts("", "0") and _starts("", "on")
