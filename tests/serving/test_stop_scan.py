"""Stop strings are matched incrementally (serving/output.py): a step's work follows its new text,
not the lengths of the stop strings nor of the output. Testing every prefix of every stop string
against the text's tail each step made 16 stop strings of 10,000 characters take one request from
4 s to 95 s, on the step thread every row shares. The rule itself is unchanged: checked here
against a brute-force statement of it."""

from __future__ import annotations

import random
import sys
from types import SimpleNamespace

import pytest

from serving import output
from serving.output import OutputText
from serving.target import load_default_tokenizer


def _code_points():
    """A tokenizer whose token ids are code points: token n is the text's n-th character."""
    return SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "".join(map(chr, ids)))


def _lines_run(fn) -> int:
    """How many Python lines of serving/output.py ``fn()`` runs: its work, counted without a clock."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        count += event == "line"
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename == output.__file__ else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count


def _pushes_of_qs(stop_len: int, steps: int) -> list[int]:
    """Lines run by each of ``steps`` pushes of "qqq" beside 16 stop strings of ``stop_len``
    characters that never start in it (each begins "Z<i>")."""
    stops = [f"Z{i}".ljust(stop_len, "q") for i in range(16)]
    text = OutputText(_code_points(), [], stops)
    costs = [_lines_run(lambda: text.push([ord("q")] * 3)) for _ in range(steps)]
    assert text.text == "qqq" * steps  # nothing that could start a stop string: all released
    return costs


def test_a_steps_work_grows_neither_with_the_stop_strings_nor_with_the_output():
    short, long = _pushes_of_qs(32, 120), _pushes_of_qs(1024, 120)
    assert sum(long) <= 1.1 * sum(short) + 50, (sum(short), sum(long))
    # the last steps (a longer text) cost what the first ones did
    assert sum(long[-20:]) <= 1.1 * sum(long[:20]) + 20, (long[:20], long[-20:])


def test_long_partial_matches_are_held_back_and_cost_a_bounded_amount():
    """A text that keeps matching the start of long stop strings: the longest such tail is held
    back (never streamed before it is known not to be a stop string), then released, and the work
    stays within a constant per character and stop string plus one pass over each stop string."""
    stops = ["q" * n + "Z" for n in (1023, 700, 301)] + ["qZq"]
    text = OutputText(_code_points(), [], stops)
    released = []

    def run():
        for _ in range(1000):
            released.append(text.push([ord("q")] * 3).text)

    lines = _lines_run(run)
    assert "".join(released) == "q" * (3000 - 1023)  # the tail that could still be "q"*1023 + "Z"
    assert text.flush() == "q" * 1023 and not text.stopped
    assert lines <= 40 * (3000 * len(stops) + sum(map(len, stops))), lines


def _holdback(text: str, stops: list[str]) -> int:
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


@pytest.mark.parametrize("seed", range(4))
def test_released_text_and_the_stopping_token_follow_the_rule(seed):
    """Brute force: after each push the released text is all the text but its longest tail that
    starts a stop string; the request stops at the first token after which a stop string occurs,
    and the text ends before the earliest-starting one of those that occur then."""
    rng = random.Random(seed)
    for _ in range(300):
        full = "".join(rng.choice("aab é🎉") for _ in range(rng.randint(1, 40)))
        stops = ["".join(rng.choice("ab é🎉") for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.5:
            start = rng.randrange(len(full))
            stops.append(full[start : start + rng.randint(1, 7)])
        first = next((n for n in range(1, len(full) + 1) if any(s in full[:n] for s in stops)), None)
        text, pushed = OutputText(_code_points(), [], stops), 0
        while pushed < len(full):
            step = full[pushed : pushed + rng.randint(1, 5)]
            got = text.push([ord(c) for c in step])
            if first is not None and first <= pushed + len(step):
                assert got.stop_index == first - pushed, (full, stops)
                cut = min(full[:first].find(s) for s in stops if s in full[:first])
                assert text.text == full[:cut] and text.stopped
                break
            pushed += len(step)
            assert not got.stopped
            assert text.text == full[: pushed - _holdback(full[:pushed], stops)], (full, stops)
        else:
            assert first is None and text.text + text.flush() == full


def test_stop_strings_across_multi_byte_tokens_with_the_real_tokenizer():
    """Characters several byte-level tokens make (emoji, CJK) end text and stop strings alike."""
    tok = load_default_tokenizer()
    rng = random.Random(7)
    full = "Emoji 🎉🎉 then 👍🏽, 日本語のテキスト; naïve café — “quotes” 🇫🇷 done."
    ids = tok.encode(full)
    assert tok.decode(ids) == full
    for _ in range(200):
        start = rng.randrange(len(full) - 1)
        stops = [full[start : start + rng.randint(1, 6)], "🎉🎉🎉"]
        text, pieces, i = OutputText(tok, tok.encode("x"), stops), [], 0
        while i < len(ids) and not text.stopped:
            n = rng.randint(1, 4)
            pieces.append(text.push(ids[i : i + n]).text)
            i += n
        assert text.stopped and "".join(pieces) == full[: full.index(stops[0])], stops
        assert all("\ufffd" not in p for p in pieces)
