"""Chat requests written from the installed packages, for the target to answer before any traffic.

A drafter learns what the target *says*: served traffic is the target's own (greedy or sampled)
assistant replies, in its chat template, and those are far more predictable than human-written
text. Teacher-forcing package text (trainer/corpus.py) teaches the target's distribution on
README prose and library source; answering requests teaches its distribution on what it actually
generates. With no hub and no data set download, the requests are written from the same packages:

- ``code``: a public function with a docstring becomes "Write a Python function ``name(args)``
  that ...", the docstring's first paragraph as the task (HumanEval's shape, none of its tasks);
- ``chat``: a README paragraph becomes one of a few plain requests (``CHAT_TEMPLATES``: summarise
  it, explain it to a beginner, list its points, rewrite it, say what it solves, introduce it).

Evaluation sets and the target's own package are excluded by name, as in the corpus.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass

from trainer.corpus import canonical_name, package_sources, read_source

CHAT_TEMPLATES = (
    "Summarize the following text in a few sentences:\n\n{text}",
    "Explain this to a beginner:\n\n{text}",
    "What are the main points of this passage?\n\n{text}",
    "Rewrite the following more clearly:\n\n{text}",
    "Read this and answer: what problem does it solve, and how?\n\n{text}",
    "Write a short blog post introduction based on this:\n\n{text}",
)


@dataclass
class PackageRequest:
    messages: list[dict]
    domain: str
    source: str


def _docstring_tasks(source: str) -> list[tuple[str, str]]:
    """(signature, first docstring paragraph) of the public, documented functions in a file."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node) or ""
        first = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
        first = " ".join(first.split())
        if not 40 <= len(first) <= 400:
            continue
        args = [a for a in ast.unparse(node.args).split(", ") if a not in ("self", "cls")]
        out.append((f"{node.name}({', '.join(args)})", first))
    return out


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs of a README: no code blocks, tables, headings or link lists."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    paras = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in block.strip().splitlines()]
        if not lines or any(ln.startswith(("#", "|", "*", "-", ">", "..", "[", "<", "=", ":")) for ln in lines):
            continue
        para = " ".join(lines)
        if 150 <= len(para) <= 1200 and para.count("http") <= 1 and sum(c.isalpha() for c in para) > 0.7 * len(para):
            paras.append(para)
    return paras


def _take(domain: str, sources, candidates, render, n: int, per_source: int, rng) -> list[PackageRequest]:
    """``n`` requests of ``domain``: ``candidates(item)`` of each source in turn (shuffled, at most
    ``per_source`` of them), each written as a user turn by ``render``. Where one pass over the
    sources falls short (README prose: ~350 chat requests at 4 a README), further passes take the
    next ``per_source`` of each; the first pass's requests stay what they were."""
    out: list[PackageRequest] = []

    def take(label: str, found: list) -> bool:
        """The next ``per_source`` of a source's candidates (removed from ``found``); True once
        ``n`` are taken."""
        for c in found[: min(per_source, n - len(out))]:
            out.append(PackageRequest([{"role": "user", "content": render(c)}], domain, label))
        del found[:per_source]
        return len(out) >= n

    rest: list[tuple[str, list]] = []  # each source's candidates not taken yet
    for label, item in sources:
        found = candidates(item)
        rng.shuffle(found)
        if take(label, found):
            return out
        rest.append((label, found))
    while any(found for _, found in rest):
        for label, found in rest:
            if take(label, found):
                return out
    raise ValueError(f"installed packages gave {len(out)} {domain} requests, {n} asked")


def package_requests(n_per_domain: int, *, seed: int = 0, per_source: int = 4,
                     distributions: list[str] | None = None) -> list[PackageRequest]:
    """``n_per_domain`` code and as many chat requests, ``per_source`` from each file or README in
    turn (more passes where one falls short). Raises ValueError when the installed packages cannot
    fill the request."""
    only = None if distributions is None else {canonical_name(d) for d in distributions}
    code, prose = package_sources(seed, only)
    rng = random.Random(seed)
    return (
        _take("code", code, lambda item: _docstring_tasks(read_source(item) or ""),
              lambda task: f"Write a Python function `{task[0]}` that does the following: {task[1]}",
              n_per_domain, per_source, rng)
        + _take("chat", prose, _paragraphs, lambda para: rng.choice(CHAT_TEMPLATES).format(text=para),
                n_per_domain, per_source, rng)
    )
