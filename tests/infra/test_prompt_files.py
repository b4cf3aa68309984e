"""``--prompts`` values (infra/prompts.py): a JSONL file whose every line is a prompt object, or a
built-in set's name; anything else is a one-line ValueError naming the file (and the line), which
the benchmarks' option callback turns into a usage error before any model loads."""

from __future__ import annotations

import json

import pytest
import typer

from infra.prompts import check_prompts, load_jsonl, load_prompts, prompt_domains, prompts_callback


@pytest.mark.parametrize("line, kind", [('"x"', "a string"), ("[1, 2]", "an array"), ("3", "a number"),
                                        ("null", "null")])
def test_a_line_that_is_not_an_object_names_the_file_and_line(tmp_path, line, kind):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n" + line + "\n")
    with pytest.raises(ValueError) as e:
        load_jsonl(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:2: ") and "JSON object" in msg and kind in msg, msg
    assert "\n" not in msg


def test_a_line_with_wrong_fields_names_the_file_line_and_field(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": 5, "domain": "code"}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:1: prompt: .*string") as e:
        load_jsonl(path)
    assert "\n" not in str(e.value)
    path.write_text(json.dumps({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:1: .*exactly one of 'prompt' or 'messages'"):
        load_jsonl(path)


def test_missing_files_directories_and_empty_files_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.jsonl: no such file"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="not a file"):
        load_jsonl(tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no prompts"):
        load_jsonl(empty)
    binary = tmp_path / "blob.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match=r"blob\.jsonl"):
        load_jsonl(binary)


def test_a_misspelt_built_in_set_is_suggested(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no file of that name here
    for typo in ("shareGPT", "sharegtp"):
        with pytest.raises(ValueError, match=f"{typo}: no such file.*'sharegpt'.*did you mean 'sharegpt'"):
            check_prompts(typo)
        with pytest.raises(ValueError, match="did you mean 'sharegpt'"):
            load_prompts(typo)  # the benchmarks' loader says the same
    with pytest.raises(ValueError) as e:
        check_prompts("prompts.jsonl")
    assert "did you mean" not in str(e.value) and "'sharegpt'" in str(e.value)


def test_check_prompts_passes_the_built_in_sets_and_returns_a_files_items(tmp_path):
    assert check_prompts(None) is None and check_prompts("sharegpt") is None
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a", "domain": "x"}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    assert [i.prompt for i in check_prompts(str(path))] == ["a", "b"]
    assert prompt_domains(str(path)) == ("default", "x")
    assert prompt_domains(None) == prompt_domains("sharegpt") == ("chat", "code")


def test_the_option_callback_turns_the_error_into_a_usage_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('"x"\n')
    with pytest.raises(typer.BadParameter, match=r"bad\.jsonl:1"):
        prompts_callback(str(path))
    assert prompts_callback(None) is None and prompts_callback("sharegpt") == "sharegpt"
