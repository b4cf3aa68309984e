import json

import pytest

from infra.prompts import (
    PromptItem,
    default_prompts,
    interleave_categories,
    load_humaneval,
    load_jsonl,
    load_mtbench,
)


def test_wheels_provide_both_domains():
    chat, code = load_mtbench(), load_humaneval()
    assert len(chat) == 80 and {p.domain for p in chat} == {"chat"}
    assert len({p.category for p in chat}) == 8
    assert len(code) == 164 and all("def " in p.prompt for p in code)
    stream = default_prompts()
    assert [p.domain for p in stream].index("code") == 80


def test_interleave_covers_every_category_early():
    items = interleave_categories(load_mtbench())
    assert len({p.category for p in items[:8]}) == 8
    assert sorted(p.id for p in items) == sorted(p.id for p in load_mtbench())


def test_jsonl_loading_and_clear_errors(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"prompt": "hi", "domain": "x"}) + "\n\n"
                    + json.dumps({"messages": [{"role": "user", "content": "yo"}]}) + "\n")
    items = load_jsonl(good)
    assert [i.domain for i in items] == ["x", None] and items[1].messages
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"domain": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_jsonl(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        load_jsonl(bad)


def test_chat_items_use_the_chat_template():
    from serving.target import load_default_tokenizer

    tok = load_default_tokenizer()
    ids = PromptItem(id="a", messages=[{"role": "user", "content": "Hello"}]).token_ids(tok)
    text = tok.decode(ids)
    assert "<|im_start|>user\nHello<|im_end|>" in text and text.rstrip().endswith("assistant")
    assert PromptItem(id="b", prompt="def f():").token_ids(tok) == list(tok.encode("def f():"))


def test_sharegpt_heldout_stream_is_real_and_split_by_domain():
    from infra.prompts import _iter_json_array, load_prompts, load_sharegpt

    items = load_sharegpt(12, 12)
    assert [p.domain for p in items] == ["chat"] * 12 + ["code"] * 12
    assert len({p.id for p in items}) == 24
    assert all(20 <= len(p.messages[0]["content"]) <= 2000 for p in items)
    later = load_sharegpt(12, 12, skip=12)
    assert not {p.id for p in items} & {p.id for p in later}
    assert [p.id for p in load_prompts("sharegpt", 12, 12)] == [p.id for p in items]
    # the wheel's file is cut inside its last record: the reader stops there quietly
    assert [o["a"] for o in _iter_json_array('[{"a": 1}, {"a": 2}, {"a": "tru')] == [1, 2]
