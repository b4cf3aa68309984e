"""Incremental detokenisation with stop strings, shared by every engine.

Tokens arrive a few at a time (a verify step commits 1..k+1 per request). ``OutputText.push`` turns
them into the next piece of text to stream, and holds back:
  - text that is an incomplete UTF-8 sequence (the tokenizer decodes it as U+FFFD), and
  - a tail that could be the start of a stop string (so a stop string is never half-streamed).
When a stop string appears, the text is trimmed just before it and ``push`` reports how many of the
pushed tokens were needed to produce it; the caller drops the rest. Stop strings are matched
incrementally (``_StopScan``): a step scans only its new text, however long the output and the
stop strings (the API bounds them: serving/api/protocol.py).

Decoding uses the usual prefix/read-offset scheme: decode a short window of already-read tokens
and the new ones, and emit the difference, so tokenizers whose pieces depend on their left
neighbour (leading spaces, byte fallback) come out right without re-decoding the whole output.

``apply_stops`` is the per-step stop rule every engine applies to the tokens a step produced:
stop token ids (EOS included unless ``ignore_eos``) end the request *with* the stop token in the
token ids and *without* its text; a stop string ends it just before the string, dropping the tokens
after the one that completed it. Length limits stay with the engine (they depend on its context).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

_PROMPT_CONTEXT = 5  # prompt tokens decoded as left context for the first output tokens


@dataclass
class PushResult:
    text: str
    """Text to stream now (possibly empty)."""
    stop_index: int | None = None
    """None, or the number of pushed tokens that completed a stop string (the rest are dropped)."""

    @property
    def stopped(self) -> bool:
        return self.stop_index is not None


class OutputText:
    """Per-request detokeniser. ``tokenizer=None`` (id-only models) yields empty text."""

    def __init__(
        self,
        tokenizer,
        prompt_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
    ):
        self._tok = tokenizer
        self._decode_ids = _decoder(tokenizer, skip_special_tokens)
        self._stop = [_StopScan(s) for s in (stop or []) if s]
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self._text = ""  # all decoded output text
        self._sent = 0  # characters of _text already released
        self.stopped = False

    @property
    def text(self) -> str:
        """Text released so far."""
        return self._text[: self._sent]

    def push(self, token_ids: list[int]) -> PushResult:
        if self.stopped:
            raise RuntimeError("push after a stop string")
        if not token_ids:
            return PushResult("")
        if self._tok is None:
            return PushResult("")
        state = self._save()
        hit = self._decode_and_scan(token_ids)
        if hit is None:
            return PushResult(self._release(len(self._text) - self._holdback()))
        # Rare: replay token by token to find which token completed the stop string.
        self._restore(state)
        for n, tid in enumerate(token_ids, start=1):
            hit = self._decode_and_scan([tid])
            if hit is not None:
                self.stopped = True
                return PushResult(self._release(hit), stop_index=n)
        raise AssertionError("stop string found in a batch but not token by token")

    def flush(self) -> str:
        """At finish (not by stop string): release everything held back."""
        if self._tok is None or self.stopped:
            return ""
        full = self._decode_ids(self._ids[self._prefix :])
        done = self._decode_ids(self._ids[self._prefix : self._read])
        if len(full) > len(done):  # trailing incomplete bytes: emit what the tokenizer makes of them
            self._text += full[len(done) :]
            self._read = len(self._ids)
        return self._release(len(self._text))

    # ---- internals ---------------------------------------------------------------------------

    def _decode(self, token_ids: list[int]) -> None:
        self._ids.extend(token_ids)
        done = self._decode_ids(self._ids[self._prefix : self._read])
        full = self._decode_ids(self._ids[self._prefix :])
        if len(full) > len(done) and not full.endswith("\ufffd"):
            self._text += full[len(done) :]
            self._prefix, self._read = self._read, len(self._ids)

    def _decode_and_scan(self, token_ids: list[int]) -> int | None:
        """Decode ``token_ids``; the character index where the earliest stop string completed by
        the new text starts, or None."""
        start = len(self._text)
        self._decode(token_ids)
        best = None
        for stop in self._stop:
            i = stop.scan(self._text, start)
            if i is not None and (best is None or i < best):
                best = i
        return best

    def _holdback(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        return max((stop.matched for stop in self._stop), default=0)

    def _release(self, upto: int) -> str:
        upto = max(upto, self._sent)
        out = self._text[self._sent : upto]
        self._sent = upto
        return out

    def _save(self):
        matched = [stop.matched for stop in self._stop]
        return (len(self._ids), self._prefix, self._read, self._text, self._sent, matched)

    def _restore(self, state) -> None:
        n, self._prefix, self._read, self._text, self._sent, matched = state
        del self._ids[n:]
        for stop, m in zip(self._stop, matched):
            stop.matched = m


class _StopScan:
    """One stop string, matched as the text grows (Knuth-Morris-Pratt). ``matched``: the length of
    the longest tail of the text scanned so far that is a prefix of the string, i.e. what must be
    held back for it. Each new character is scanned once, so a step costs its new text whatever
    the lengths of the stop strings and of the output. (Testing every prefix of every stop string
    against the text's tail on every step, as before, made 16 stop strings of 10,000 characters
    take a request from 4 s to 95 s, on the step thread every row shares.)"""

    __slots__ = ("_fail", "matched", "text")

    def __init__(self, text: str):
        self.text = text
        self.matched = 0
        self._fail: list[int] | None = None  # built when a partial match first breaks

    def scan(self, text: str, start: int) -> int | None:
        """Advance over ``text[start:]``; the index where the string's first occurrence completed
        there starts, or None."""
        s, n, k, fail = self.text, len(self.text), self.matched, self._fail
        i, end = start, len(text)
        while i < end:
            if k == 0:  # nothing pending: skip ahead to where the string could start
                i = text.find(s[0], i)
                if i < 0:
                    break
            ch = text[i]
            while k and s[k] != ch:
                fail = fail or self._borders()
                k = fail[k - 1]
            if s[k] == ch:
                k += 1
                if k == n:
                    self.matched = k
                    return i + 1 - n
            i += 1
        self.matched = k
        return None

    def _borders(self) -> list[int]:
        """``[i]``: the length of the longest proper prefix of ``text[: i + 1]`` that ends it."""
        s, fail, k = self.text, [0] * len(self.text), 0
        for i in range(1, len(s)):
            while k and s[i] != s[k]:
                k = fail[k - 1]
            if s[i] == s[k]:
                k += 1
            fail[i] = k
        self._fail = fail
        return fail


def _decoder(tokenizer, skip_special_tokens: bool):
    """ids -> text as ``tokenizer.decode`` gives it: the fast tokenizer's Rust decoder itself where
    the Python wrapper adds nothing (no space clean-up), ~2.4 us a call instead of ~6.6 (hot
    caches; every step decodes twice per row, on the step thread)."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


# ---- stop rules shared by every engine ------------------------------------------------------------


def eos_token_ids(*sources) -> frozenset[int]:
    """Every ``eos_token_id`` (an int or a list of ints) of ``sources``, e.g. a model's generation
    config, its config and its tokenizer; None sources are skipped."""
    ids: set[int] = set()
    for src in sources:
        value = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def stop_token_set(
    stop_token_ids: Iterable[int], eos_ids: frozenset[int], ignore_eos: bool = False
) -> frozenset[int]:
    """Token ids that end a request: its own stop ids, plus EOS unless ``ignore_eos``."""
    return frozenset(int(t) for t in stop_token_ids) | (frozenset() if ignore_eos else eos_ids)


@dataclass
class StepOutput:
    tokens: list[int]
    """The step's tokens the request keeps (through a stop token; none after a stop string)."""
    text: str
    """Text to stream now (possibly empty; never part of a stop string or of a stop token)."""
    stopped: bool = False
    """A stop token or stop string ended the request: finish_reason "stop"."""


def apply_stops(text: OutputText, stop_ids: frozenset[int], emitted: list[int]) -> StepOutput:
    """Apply the stop rules to the tokens one step produced for a request, in order.

    ``text``: the request's OutputText (stop strings, held-back text); ``stop_ids``: from
    ``stop_token_set``. The first stop token keeps its id but not its text; a stop string found in
    the text (of the tokens before any stop token) cuts the step at the token that completed it.
    """
    stop_at = next((i for i, t in enumerate(emitted) if t in stop_ids), None)
    tokens, text_tokens = list(emitted), list(emitted)
    if stop_at is not None:
        tokens, text_tokens = tokens[: stop_at + 1], tokens[:stop_at]
    pushed = text.push(text_tokens)
    if pushed.stopped:
        tokens = tokens[: pushed.stop_index]
    return StepOutput(tokens, pushed.text, stopped=stop_at is not None or pushed.stopped)


# ---- prompt length bound ---------------------------------------------------------------------------


def max_token_chars(tokenizer) -> int | None:
    """The most characters of a text one token of ``tokenizer`` can stand for, so that a text of N
    characters has at least N / that many tokens (the API refuses a prompt the context cannot hold
    before tokenising it: seconds for megabytes). The longest token decoded alone, plus one for a
    leading space a decoder drops there (a partial character decodes alone as U+FFFD, one at
    least). None (no bound) unless a fast tokenizer whose normaliser and pre-tokeniser keep every
    character: NFC can compose several into one, BERT's pre-tokeniser drops whitespace."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        parts = (backend.normalizer, backend.pre_tokenizer)
        if not all(p is None or _keeps_text(json.loads(p.__getstate__())) for p in parts):
            return None
        ids = [[i] for i in range(backend.get_vocab_size(with_added_tokens=True))]
        return max(map(len, backend.decode_batch(ids, skip_special_tokens=False)), default=0) + 1
    except (AttributeError, TypeError, ValueError):  # not a `tokenizers` backend we can read
        return None


def _keeps_text(part: dict | None) -> bool:
    """Whether a tokenizer.json normaliser or pre-tokeniser never shortens the text."""
    if part is None:
        return True
    kind = part.get("type")
    if kind == "Sequence":
        return all(map(_keeps_text, part.get("normalizers") or part.get("pretokenizers") or []))
    if kind == "Replace":  # a literal replaced by text at least as long
        old = (part.get("pattern") or {}).get("String")
        return old is not None and len(part.get("content") or "") >= len(old)
    if kind in ("Split", "Punctuation"):
        return part.get("behavior") != "Removed"
    return kind in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "NFD", "NFKD", "Lowercase",
                    "Prepend")
