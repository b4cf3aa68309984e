"""`bench spec --artifact` and `bench online --day0-artifact` are checked before the target loads (a
missing directory, one that is not a drafter artifact, an artifact of a kind the run does not
serve) and against the target's fingerprint before the suffix seed or anything else starts: a
usage error naming the option. Both were read only where the drafter was built, minutes in (bench
spec: after its whole target-only baseline), and failed with a traceback."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

FP = {"model_id": "the-target", "tokenizer_hash": "0" * 16, "vocab_size": 48}


class Reached(Exception):
    """The run got past the check to the step a test stops it at."""


def fingerprint(model_id: str = "the-target"):
    from feedback.target.fingerprint import TargetFingerprint

    return TargetFingerprint(**{**FP, "model_id": model_id})


def artifact(folder, kind: str = "selfspec", model_id: str = "the-target", config: str | None = None):
    """A directory whose config.json is ``config``, else a valid one of ``kind`` (no weights: the
    check reads config.json only)."""
    from feedback.registry.artifact import DrafterMeta

    folder.mkdir()
    if config is None:
        config = DrafterMeta(kind=kind, version="v1", target=fingerprint(model_id), config={}, dtype="float32",
                             files={}).model_dump_json()
    if config != "none":
        (folder / "config.json").write_text(config)
    return folder


@pytest.fixture
def stop_after_the_target(monkeypatch):
    """The target "loads" as a bare fingerprint; the suffix seed, the first step after the
    artifact's checks, raises ``Reached``. Nothing else (baseline, stack) may start."""
    import torch

    import benchmarks.bench_online
    import benchmarks.bench_spec
    import infra.root
    import serving.target

    loads = []
    threads = torch.get_num_threads()  # the benchmarks set theirs before the target loads

    def seed(*a, **k):
        raise Reached

    def refuse(*a, **k):
        raise AssertionError("the stack started before the artifact was checked")

    monkeypatch.setenv("COLUMNS", "1000")  # the usage panel folds no path across its lines
    monkeypatch.setattr(serving.target, "load_target",
                        lambda *a, **k: loads.append(a) or SimpleNamespace(fingerprint=fingerprint()))
    monkeypatch.setattr(benchmarks.bench_spec, "use_suffix_seed", seed)
    monkeypatch.setattr(benchmarks.bench_online, "use_suffix_seed", seed)
    monkeypatch.setattr(infra.root, "build_stack", refuse)
    yield loads
    torch.set_num_threads(threads)


def invoke(*args: str):
    from infra.cli import app

    out = CliRunner().invoke(app, ["bench", *args, "--no-verbose"])
    text = " ".join((out.output + (out.stderr or "")).replace("│", " ").split())
    return out, text


BAD = [  # (drafter, artifact: kind or config.json or "missing"/"none", what the refusal says)
    ("selfspec", "missing", "no such directory"),
    ("selfspec", "none", "no config.json"),
    ("eagle", "{not json", "invalid artifact config"),
    ("standalone", '{"kind": "standalone"}', "invalid artifact config"),
    ("selfspec", "standalone", "is a standalone drafter; --drafter selfspec serves a selfspec one"),
    ("eagle", "selfspec", "is a selfspec drafter; --drafter eagle serves an eagle one"),
    ("suffix", "selfspec", "the suffix drafter starts from no artifact"),
]


@pytest.mark.parametrize("drafter, given, why", BAD, ids=[f"{d}-{g[:10]}" for d, g, _ in BAD])
def test_bench_spec_refuses_a_bad_artifact_before_the_target_loads(stop_after_the_target, tmp_path, drafter,
                                                                   given, why):
    path = tmp_path / "art"
    if given != "missing":
        kind = given if given in ("selfspec", "standalone", "eagle") else None
        artifact(path, kind or "selfspec", config=None if kind else given)

    out, text = invoke("spec", "--drafter", drafter, "--artifact", str(path))

    assert out.exit_code == 2, text
    assert "--artifact" in text and why in text and "Traceback" not in text, text
    assert stop_after_the_target == []  # the target never loaded


def test_bench_spec_refuses_an_artifact_of_another_target_before_the_suffix_seed(stop_after_the_target, tmp_path):
    path = artifact(tmp_path / "art", "selfspec", model_id="another-model")

    out, text = invoke("spec", "--drafter", "selfspec", "--artifact", str(path))

    assert out.exit_code == 2, text
    assert "--artifact" in text and "built for target another-model" in text and "the-target" in text, text


@pytest.mark.parametrize("drafter, kind", [("selfspec", "selfspec"), ("hybrid", "standalone"), ("hybrid", "eagle")])
def test_bench_spec_takes_an_artifact_of_a_kind_it_serves(stop_after_the_target, tmp_path, drafter, kind):
    path = artifact(tmp_path / "art", kind)

    out, text = invoke("spec", "--drafter", drafter, "--artifact", str(path))

    assert isinstance(out.exception, Reached), text  # past the checks, at the suffix seed
    assert len(stop_after_the_target) == 1


NOT_SELFSPEC = "is a standalone drafter; the learned drafter starts from a selfspec artifact"


@pytest.mark.parametrize("given, why", [("missing", "no such directory"), ("none", "no config.json"),
                                        ("{not json", "invalid artifact config"),
                                        ("standalone", NOT_SELFSPEC)])
def test_bench_online_refuses_a_bad_day0_artifact_before_the_target_loads(stop_after_the_target, tmp_path, given,
                                                                          why):
    path = tmp_path / "art"
    if given != "missing":
        artifact(path, "standalone", config=None if given == "standalone" else given)

    out, text = invoke("online", "--day0-artifact", str(path))

    assert out.exit_code == 2, text
    assert "--day0-artifact" in text and why in text and "Traceback" not in text, text
    assert stop_after_the_target == []


def test_bench_online_refuses_a_day0_artifact_of_another_target_before_the_suffix_seed(stop_after_the_target,
                                                                                      tmp_path):
    path = artifact(tmp_path / "art", "selfspec", model_id="another-model")

    out, text = invoke("online", "--day0-artifact", str(path))

    assert out.exit_code == 2, text
    assert "--day0-artifact" in text and "built for target another-model" in text, text


def test_bench_online_takes_a_selfspec_day0_artifact_of_its_target(stop_after_the_target, tmp_path):
    out, text = invoke("online", "--day0-artifact", str(artifact(tmp_path / "art", "selfspec")))
    assert isinstance(out.exception, Reached), text
