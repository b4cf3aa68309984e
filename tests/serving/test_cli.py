"""``specloop serve`` / ``specloop generate``: the engine is checked before anything else.

sglang is not installed in CI (it needs a CUDA GPU): these tests check that asking for it fails at
once, with the install command and no traceback, before settings that depend on the engine are
validated and before any model is loaded.
"""

from __future__ import annotations

import importlib.util
from typing import get_args

import pytest
from typer.testing import CliRunner

from infra.cli import app
from serving.config import DrafterKindName, ServingSettings

SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None
INSTALL = "pip install 'specloop[sglang]'"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for field in ServingSettings.model_fields:
        monkeypatch.delenv(f"SPECLOOP_{field.upper()}", raising=False)


def run(args, env=None):
    """(result, all output with rich's panel borders and line wraps flattened)."""
    result = CliRunner().invoke(app, args, env=env)
    out = result.output + (result.stderr or "")
    return result, " ".join(out.replace("│", " ").split())


@pytest.mark.skipif(SGLANG_INSTALLED, reason="sglang is installed")
@pytest.mark.parametrize("args, env", [
    (["serve", "--engine", "sglang"], None),
    (["serve", "--port", "0"], {"SPECLOOP_ENGINE": "sglang"}),
    (["generate", "hello", "--engine", "sglang"], None),
])
def test_sglang_without_sglang_fails_fast_naming_the_extra(args, env):
    result, out = run(args, env)
    assert result.exit_code == 1, out
    assert INSTALL in out and "Traceback" not in out
    assert isinstance(result.exception, SystemExit)  # a clean exit, not an escaped error


def test_an_unknown_engine_is_a_usage_error():
    result, out = run(["serve", "--engine", "vllm"])
    assert result.exit_code == 2 and "'torch' or 'sglang'" in out


def test_with_sglang_present_its_settings_are_checked_next(monkeypatch):
    """Wiring only: the sglang check is stubbed to pass (no sglang here)."""
    from serving.sglang import source_check

    monkeypatch.setattr(source_check, "require_sglang", lambda *a, **k: None)
    result, out = run(["serve", "--engine", "sglang", "--drafter", "suffix"])
    assert result.exit_code == 2
    assert "drafter=eagle" in out and "drafter_dir is required" in out


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_names_the_sglang_extra_and_every_drafter_kind(command):
    """Rich markup must not eat ``[sglang]`` from the install command, and --drafter lists every
    kind the settings accept."""
    result, out = run([command, "--help"])
    assert result.exit_code == 0, out
    assert INSTALL in out
    drafter_help = out.split("--drafter ", 1)[1].split("--", 1)[0]
    assert all(kind in drafter_help for kind in get_args(DrafterKindName)), drafter_help


@pytest.fixture
def no_model(monkeypatch):
    """A command that gets as far as building its engine fails the test loudly (nothing loads)."""
    import serving.builder

    def refuse(*args, **kwargs):
        raise AssertionError("the engine was built: the bad argument was not caught first")

    monkeypatch.setattr(serving.builder, "build_engine", refuse)


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize("args, expected", [
    (["serve", "--log-level", "loud"], "'loud': one of critical | error | warning | info | debug"),
    (["serve", "--drafter", "standalone", "--drafter-dir", "/no/such/artifact"], "does not exist"),
    (["generate", "hi", "--drafter", "eagle", "--drafter-dir", "/no/such/artifact"], "does not exist"),
    (["generate", "hi", "--drafter", "suffix", "--drafter-dir", "."], "drafter=suffix has none"),
    (["serve", "--drafter-dir", "."], "drafter=suffix has none"),  # suffix is the default
    (["generate", "hi", "--device", "gpu"], "'gpu' is not a torch device (e.g. cpu, cuda, cuda:0)"),
])
def test_bad_arguments_are_usage_errors_before_anything_loads(args, expected):
    result, out = run(args)
    assert result.exit_code == 2 and expected in out, out
    assert isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("args", [["serve"], ["generate", "hi"]])
def test_a_refused_artifact_or_missing_model_is_one_line_not_a_traceback(args, monkeypatch):
    import serving.builder
    from feedback.registry.artifact import DrafterArtifactError

    def refused(settings, **kwargs):
        raise DrafterArtifactError("/models/draft: drafter 7 was built for target other-1234")

    monkeypatch.setattr(serving.builder, "build_engine", refused)
    result, out = run(args + ["--drafter", "standalone", "--drafter-dir", "."])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), out
    assert "Error: /models/draft: drafter 7 was built for target other-1234" in out


def test_a_cuda_device_without_a_gpu_is_one_line_before_the_model_loads(monkeypatch):
    """torch's own errors for it come from deep inside the model's ``.to`` (an AssertionError on a
    CPU build): load_target checks the device first, and the CLI prints its ValueError as one line."""
    import torch

    import serving.target

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(serving.target, "resolve_model_path",
                        lambda model: pytest.fail("the model was looked up before the device"))
    with pytest.raises(ValueError, match="device cuda:1: no CUDA GPU is available to this process"):
        serving.target.load_target(device="cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"sees 1 CUDA GPU\(s\) \(cuda:0..cuda:0\)"):
        serving.target.load_target(device="cuda:1")
    serving.target.check_device("cuda:0")  # there: no error
    result, out = run(["generate", "hi", "--device", "cuda:3"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), out
    assert "Error: device cuda:3: this process sees 1 CUDA GPU(s)" in out
