"""Requests written from the installed packages, and ``specloop train --requests``: the target's own
answers to them as day-0 training data."""

from trainer.corpus import EXCLUDED_DISTRIBUTIONS, canonical_name
from trainer.package_prompts import CHAT_TEMPLATES, _docstring_tasks, _paragraphs, package_requests

SOURCE = '''
class Box:
    def area(self, scale: float = 1.0) -> float:
        """Return the area of the box in square units, multiplied by the given scale factor."""

def _hidden(x):
    """A private helper whose docstring is long enough to be a task but should not be one."""

def tiny(x):
    """Too short."""

def merge(a, b):
    """Merge two sorted lists into one sorted list without using the built-in sort.

    Longer explanation that is not part of the task.
    """
'''

README = """# Title

A paragraph of plain prose that explains what this library does, why somebody would reach for it,
and how it fits with the rest of the ecosystem of tools that people already use every day.

```python
import thing  # a code block is never a request
```

- a list item
- another list item that is long enough to count if lists were allowed in the requests at all

| a | table |
"""


def test_public_documented_functions_become_tasks():
    tasks = dict(_docstring_tasks(SOURCE))
    assert tasks == {
        "area(scale: float=1.0)": "Return the area of the box in square units, multiplied by the given scale factor.",
        "merge(a, b)": "Merge two sorted lists into one sorted list without using the built-in sort.",
    }
    assert _docstring_tasks("def broken(:\n") == []


def test_only_prose_paragraphs_become_chat_requests():
    paras = _paragraphs(README)
    assert len(paras) == 1 and paras[0].startswith("A paragraph of plain prose") and "\n" not in paras[0]


def test_requests_come_from_many_packages_none_of_the_evaluation_sets():
    reqs = package_requests(8, per_source=2)
    assert [r.domain for r in reqs].count("code") == 8 and [r.domain for r in reqs].count("chat") == 8
    for domain in ("code", "chat"):
        assert len({r.source for r in reqs if r.domain == domain}) >= 4  # at most 2 per source
    assert not {canonical_name(r.source.split(":")[0]) for r in reqs} & EXCLUDED_DISTRIBUTIONS
    for r in reqs:
        assert len(r.messages) == 1 and r.messages[0]["role"] == "user"
        text = r.messages[0]["content"]
        if r.domain == "code":
            assert text.startswith("Write a Python function `")
        else:
            assert any(text.startswith(t.split("{text}")[0]) for t in CHAT_TEMPLATES)
    assert [r.messages for r in package_requests(8, per_source=2)] == [r.messages for r in reqs]  # seeded
    assert [r.source for r in package_requests(8, per_source=2, seed=1)] != [r.source for r in reqs]


def test_sources_give_more_in_later_passes_where_one_pass_falls_short():
    one_pass = package_requests(1, distributions=["typer"], per_source=1)
    reqs = package_requests(4, distributions=["typer"], per_source=1)  # typer has one README
    chat = [r for r in reqs if r.domain == "chat"]
    assert len(chat) == 4 and len({r.source for r in chat}) == 1
    assert len({r.messages[0]["content"] for r in chat}) == 4  # four different paragraphs
    assert reqs[0].messages == one_pass[0].messages  # the first pass is what it was


def test_asking_for_more_requests_than_the_packages_hold_is_an_error():
    import pytest

    with pytest.raises(ValueError, match="installed packages gave"):
        package_requests(10**4, distributions=["typer"])


def test_train_requests_answers_them_with_the_target_and_caches_the_answers(target_dir, tmp_path, selfspec_env):
    from feedback.registry.artifact import read_meta
    from trainer.cli import run_offline

    target, d = target_dir
    cache = tmp_path / "cache"
    res = run_offline(str(d), None, tmp_path / "a", target.model_id, max_new_tokens=6, steps=2, requests=3,
                      corpus_cache=cache)
    assert res["package_requests"] == 6 and res["prompts"] == 6 and res["traces"] == 6
    assert read_meta(tmp_path / "a").extra["package_requests_per_domain"] == 3
    cached = list(cache.glob("responses-*.traces"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    again = run_offline(str(d), None, tmp_path / "b", target.model_id, max_new_tokens=6, steps=1, requests=3,
                        corpus_cache=cache)
    assert again["traces"] == 6 and cached[0].stat().st_mtime_ns == stamp  # read back, not regenerated
