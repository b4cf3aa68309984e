"""`specloop bench`'s options are checked when they are parsed: a misspelt choice, a missing or
malformed `--prompts` file is a usage error (exit code 2, one message naming the option and what
it takes), never a traceback after the model loaded, and never a run of something else."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner


@pytest.fixture
def refuse_work(monkeypatch):
    """Every benchmark's first step raises: a test that gets there was not refused at parse time."""
    import benchmarks.bench_capture
    import benchmarks.bench_spec
    import benchmarks.bench_train
    import serving.target

    def refuse(*a, **k):
        raise AssertionError("the benchmark started: the option was not checked first")

    for module, name in ((benchmarks.bench_spec, "run"), (benchmarks.bench_train, "run"),
                         (benchmarks.bench_capture, "run"), (serving.target, "load_target")):
        monkeypatch.setattr(module, name, refuse)


def invoke(*args: str):
    from infra.cli import app

    out = CliRunner().invoke(app, ["bench", *args])
    text = " ".join((out.output + (out.stderr or "")).replace("│", " ").split())
    return out, text


TYPOS = [
    ("spec", "--policy", "sometimes", ("adaptive", "fixed", "both")),
    ("spec", "--dtype", "fp32", ("float32", "bfloat16")),
    ("spec", "--drafter", "eagel", ("suffix", "eagle", "standalone", "selfspec", "hybrid")),
    ("spec", "--domain", "chta", ("chat", "code")),
    ("capture", "--dtype", "fp32", ("float32", "bfloat16")),
    ("online", "--static", "snapshop", ("offline", "snapshot")),
    ("online", "--drafter", "hybird", ("hybrid", "suffix", "standalone")),
    ("online", "--learned", "self-spec", ("target-layers", "selfspec")),
    ("train", "--student", "eagel", ("eagle", "standalone", "selfspec")),
    ("train", "--domain", "chta", ("chat", "code")),
    ("train", "--adapter-init", "first", ("next", "last")),
]


@pytest.mark.parametrize("bench, option, bad, allowed", TYPOS, ids=[f"{b}{o}" for b, o, _, _ in TYPOS])
def test_a_misspelt_choice_is_a_usage_error_naming_the_option_and_its_values(refuse_work, bench, option, bad,
                                                                            allowed):
    out, text = invoke(bench, option, bad)
    assert out.exit_code == 2, text
    assert option in text and repr(bad) in text, text
    assert all(value in text for value in allowed), text
    assert "Traceback" not in text


def test_the_allowed_values_reach_the_benchmark_as_plain_strings(monkeypatch):
    import benchmarks.bench_spec
    import benchmarks.bench_train

    seen = {}
    monkeypatch.setattr(benchmarks.bench_spec, "run", lambda *a: seen.setdefault("spec", a) and {})
    monkeypatch.setattr(benchmarks.bench_train, "run", lambda args: seen.setdefault("train", args) and {})
    out, text = invoke("spec", "--policy", "both", "--dtype", "bfloat16", "--drafter", "selfspec",
                       "--domain", "code", "--no-verbose")
    assert out.exit_code == 0, text
    _, _, _, _, drafter, _, _, _, dtype, domains, policy, *_ = seen["spec"]
    assert (drafter, dtype, domains, policy) == ("selfspec", "bfloat16", ["code"], "both")
    assert all(type(v) is str for v in (drafter, dtype, policy))
    out, text = invoke("train", "--student", "selfspec", "--domain", "code", "--prompts", "sharegpt")
    assert out.exit_code == 0, text
    args = seen["train"]
    assert (args.student, args.domain, args.prompts, args.adapter_init) == ("selfspec", "code", "sharegpt", "next")


@pytest.mark.parametrize("bench", ["spec", "online", "capture"])
def test_a_misspelt_prompt_set_or_a_missing_file_is_refused_before_anything_loads(refuse_work, tmp_path,
                                                                                  monkeypatch, bench):
    monkeypatch.chdir(tmp_path)
    out, text = invoke(bench, "--prompts", "shareGPT")
    assert out.exit_code == 2 and "--prompts" in text and "did you mean 'sharegpt'" in text, text
    out, text = invoke(bench, "--prompts", "missing.jsonl")
    assert out.exit_code == 2 and "missing.jsonl: no such file" in text, text
    (tmp_path / "adir").mkdir()
    out, text = invoke(bench, "--prompts", "adir")
    assert out.exit_code == 2 and "adir: not a file" in text, text
    assert "Traceback" not in text


@pytest.mark.parametrize("bench", ["spec", "online", "capture"])
@pytest.mark.parametrize("line", ['"x"', '[{"prompt": "hi"}]', '{"domain": "chat"}', "{not json"])
def test_a_malformed_prompts_file_names_the_file_and_line(refuse_work, tmp_path, monkeypatch, bench, line):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "fine", "domain": "chat"}) + "\n" + line + "\n")
    out, text = invoke(bench, "--prompts", "bad.jsonl")
    assert out.exit_code == 2, text
    assert "--prompts" in text and "bad.jsonl:2:" in text, text
    assert "Traceback" not in text


def test_bench_spec_domains_are_the_prompt_files_own(monkeypatch, tmp_path):
    import benchmarks.bench_spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"prompt": f"p{i}", "domain": d})
                                                for i, d in enumerate(["sql", "prose"])) + "\n")
    seen = []
    monkeypatch.setattr(benchmarks.bench_spec, "run", lambda *a: seen.append(a) or {})
    out, text = invoke("spec", "--prompts", "p.jsonl", "--domain", "chat", "--no-verbose")
    assert out.exit_code == 2 and "--domain" in text and "prose, sql" in text and not seen, text
    out, text = invoke("spec", "--prompts", "p.jsonl", "--domain", "sql", "--no-verbose")
    assert out.exit_code == 0 and seen[0][9] == ["sql"], text


def test_bench_train_refuses_a_prompts_file_it_would_have_ignored(refuse_work, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "domain": "chat"}) + "\n")
    out, text = invoke("train", "--prompts", str(path))
    assert out.exit_code == 2, text
    assert "--prompts" in text and "sharegpt" in text and "no prompt files" in text, text


@pytest.mark.parametrize("option", ["--train-prompts", "--chunks", "--steps-per-chunk", "--batch-traces", "--k"])
def test_bench_train_counts_below_one_are_usage_errors(refuse_work, option):
    """They took 0 (an empty training set, no curve point) and failed or reported nothing later."""
    out, text = invoke("train", option, "0")
    assert out.exit_code == 2 and option in text and "Traceback" not in text, text


def test_callers_of_the_benchmarks_are_refused_too():
    import asyncio
    from types import SimpleNamespace

    from benchmarks.bench_online import adapted_and_frozen
    from benchmarks.bench_spec import bench_spec_async
    from benchmarks.bench_train import _check_choices

    with pytest.raises(ValueError, match="drafter must be one of"):
        asyncio.run(bench_spec_async([], drafter_kind="eagel"))
    with pytest.raises(ValueError, match="dtype must be"):
        asyncio.run(bench_spec_async([], dtype="fp32"))
    with pytest.raises(ValueError, match="static must be one of offline, snapshot"):
        asyncio.run(adapted_and_frozen(None, None, [], None, static="snapshop"))
    for bad in ({"student": "eagel"}, {"domain": "chta"}, {"prompts": "p.jsonl"}):
        args = SimpleNamespace(**{"student": "eagle", "domain": "chat", "prompts": None, **bad})
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be one of"):
            _check_choices(args)
