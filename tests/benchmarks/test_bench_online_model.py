"""`specloop bench online` serves, and fits its static baseline on, the target the demo and
`specloop serve` would: --model, else SPECLOOP_MODEL through the settings tree."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner


class Reached(Exception):
    """The benchmark got to its streams with the loaders it was given."""


@pytest.mark.parametrize("how", ["--model", "SPECLOOP_MODEL"])
def test_bench_online_serves_and_fits_the_target_it_is_given(how, tmp_path, monkeypatch):
    import infra.root
    import serving.target
    from benchmarks import bench_online
    from infra.cli import app

    loads = []

    def load_target(*a, **k):
        loads.append(a)
        return SimpleNamespace(fingerprint=None, tokenizer=None)

    class Stack:
        def up(self):
            return None

        def down(self):
            return None

    loaders = []

    async def run_all(*a, load_target=None, **k):
        loaders.append(load_target)
        raise Reached

    monkeypatch.setattr(serving.target, "load_target", load_target)
    monkeypatch.setattr(bench_online, "use_suffix_seed", lambda *a, **k: None)
    monkeypatch.setattr(bench_online, "encode", lambda *a, **k: [])
    monkeypatch.setattr(infra.root, "build_stack", lambda *a, **k: Stack())
    monkeypatch.setattr(bench_online, "run_all", run_all)
    given = {"--model": ["--model", str(tmp_path)], "SPECLOOP_MODEL": []}[how]
    if not given:
        monkeypatch.setenv("SPECLOOP_MODEL", str(tmp_path))
    out = CliRunner().invoke(app, ["bench", "online", "--drafter", "standalone", *given])
    assert isinstance(out.exception, Reached), (out.exception, out.output)
    assert loads == [(str(tmp_path),)]  # served
    loaders[0]()  # what the static baseline's own process loads
    assert loads == [(str(tmp_path),)] * 2


def test_bench_online_refuses_a_model_that_does_not_exist_before_anything_starts(tmp_path, monkeypatch):
    import infra.root
    from infra.cli import app

    def refuse(*a, **k):
        raise AssertionError("the stack started for a model that does not exist")

    monkeypatch.setattr(infra.root, "build_stack", refuse)
    monkeypatch.setenv("COLUMNS", "1000")
    out = CliRunner().invoke(app, ["bench", "online", "--model", str(tmp_path / "nope")])
    text = " ".join((out.output + (out.stderr or "")).replace("│", " ").split())
    assert out.exit_code == 2 and "--model" in text and "no such directory" in text, text
