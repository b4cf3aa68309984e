"""Held-out evaluations of a student, remembered for as long as its weights do not change.

The trainer scores the same weights on the same held-out traces several times: each round's fit
evaluates the student before its first step (the weights the last round ended with and already
evaluated) and after its last, and every gate scores the candidate (the weights the round just
evaluated) and the champion (unchanged since its promotion) on every held-out trace. A forward over
a held-out trace costs as much as a training row batch: on one core of this project's machine 64
held-out traces took 4.8 s against 4.1 s for a round of 10 steps (selfspec student, bf16 steps), so
most of the trainer's time went to re-computing answers it had.

Results are kept per student object, per digest of its trainable weights (so any change of the
weights, by a step, a restore or a rollback, misses the cache; nothing has to remember to clear
it), per held-out trace and per (k, branches) of the evaluation. Frozen weights (the target's
layers a selfspec drafter shares) never change and are not hashed.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

from feedback.bus.trace import TraceRecord
from trainer.digest import trainable_digest

KEEP_DIGESTS = 3
"""Weight versions remembered per student: the current ones, and the best-on-held-out ones a fit
may restore."""

_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""student -> OrderedDict[digest, dict[key, RecordEval]]."""


def _key(record: TraceRecord, k: int, branches: int) -> tuple:
    return record.request_id, len(record.prompt_ids), len(record.output_ids), int(k), int(branches)


def evaluate_all(student, records: list[TraceRecord], k: int, branches: int) -> list:
    """``student.evaluate(record, k, branches)`` for each record (a RecordEval each), computing only
    those not evaluated before with these exact weights."""
    by_digest = _CACHES.setdefault(student, OrderedDict())
    digest = trainable_digest(student)
    cache = by_digest.setdefault(digest, {})
    by_digest.move_to_end(digest)
    while len(by_digest) > KEEP_DIGESTS:
        by_digest.popitem(last=False)
    out = []
    for rec in records:
        key = _key(rec, k, branches)
        ev = cache.get(key)
        if ev is None:
            ev = cache[key] = student.evaluate(rec, k, branches)
        out.append(ev)
    live = {_key(r, k, branches) for r in records}  # held-out traces leave the window: forget them
    for key in [key for key in cache if key[3:] == (int(k), int(branches)) and key not in live]:
        del cache[key]
    return out
