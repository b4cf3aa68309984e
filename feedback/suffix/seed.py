"""A suffix index that knows the target before any traffic: its own answers, as a seed file.

SuffixDecoding's global tree only helps once traffic has filled it, so a day-0 index drafts from
the request's own context alone. The target's greedy answers to requests written from the
installed packages (trainer/package_prompts.py, the same requests ``make pretrain`` distils a
learned drafter on) hold its habits: how it opens an answer, its code fences, docstring sections,
list phrasing. A seed file carries those token sequences and the fingerprint of the target that
wrote them; every tenant's index starts with them as a shared, read-only oldest generation
(``SuffixIndex(seed=...)``), which traffic evicts like any generation.

The file is JSON: ``{"format": 1, "fingerprint": {...}, "source": str, "sequences": [[int]]}``.
Serving and the trainer's gate read the same file (``SuffixConfig.seed_file``), so the gate
simulates the index serving drafts from. infra/suffix_seed.py writes it.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ValidationError

from feedback.suffix.index import SuffixAutomaton
from feedback.target.fingerprint import TargetFingerprint

SEED_FORMAT = 1


class SuffixSeedError(ValueError):
    """A seed file that cannot be used (unreadable, malformed, or for another target)."""


class SuffixSeed(BaseModel):
    format: Literal[1] = SEED_FORMAT
    fingerprint: TargetFingerprint
    source: str
    """How the sequences were made (e.g. ``package requests: 640 code + 640 chat, seed 0, 96 tokens,
    greedy``)."""
    sequences: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def write_seed(path: str | Path, seed: SuffixSeed) -> Path:
    """Write atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(seed.model_dump_json())
    tmp.replace(path)
    return path


def read_seed(path: str | Path, expected: TargetFingerprint | None = None) -> SuffixSeed:
    """The seed at ``path`` (parsed once per process and file version: the builder, serving's
    ``build_drafter`` check, the automaton and the runs' summaries all read it; callers must not
    modify it); raises SuffixSeedError if it is unreadable, malformed, holds a token outside the
    target's vocabulary, or was written by another target than ``expected``."""
    seed = _parsed(*_version(path))
    if expected is not None and not seed.fingerprint.matches(expected):
        raise SuffixSeedError(f"suffix seed {path} was written by {seed.fingerprint.key()}, "
                              f"not by the target served ({expected.key()})")
    return seed


def seed_automaton(path: str | Path) -> SuffixAutomaton:
    """The read-only automaton of the seed at ``path``, built once per process and file version
    (the trainer's gate builds a fresh proposer every round; the seed is the same each time).
    Drafters of several engines may share it without a common lock: nothing appends to it, so a
    reader only fills its top-children cache, with the same values any other reader would."""
    return _automaton(*_version(path))


def _version(path: str | Path) -> tuple[str, int, int]:
    """(resolved path, mtime, size): what the caches below are keyed on."""
    try:
        st = Path(path).stat()
    except OSError as e:
        raise SuffixSeedError(f"suffix seed {path}: {type(e).__name__}: {e.strerror}") from e
    return str(Path(path).resolve()), st.st_mtime_ns, st.st_size


@lru_cache(maxsize=4)
def _parsed(path: str, mtime_ns: int, size: int) -> SuffixSeed:
    try:
        seed = SuffixSeed.model_validate(json.loads(Path(path).read_text()))
    except ValidationError as e:
        what = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'file'}: {err['msg']}" for err in e.errors()[:3])
        raise SuffixSeedError(f"suffix seed {path}: {what}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SuffixSeedError(f"suffix seed {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    vocab = seed.fingerprint.vocab_size
    for seq in seed.sequences:
        bad = next((t for t in seq if not 0 <= t < vocab), None)
        if bad is not None:
            raise SuffixSeedError(f"suffix seed {path}: token id {bad} outside the target's vocabulary ({vocab})")
    return seed


@lru_cache(maxsize=4)
def _automaton(path: str, mtime_ns: int, size: int) -> SuffixAutomaton:
    sam = SuffixAutomaton()
    for seq in _parsed(path, mtime_ns, size).sequences:
        if seq:
            sam.add_sequence(seq)
    return sam
