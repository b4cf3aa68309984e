"""OutputText (incremental detokenisation, stop strings) and apply_stops, the per-step stop rule
every engine (TorchEngine, SGLangEngine) applies."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from serving.output import OutputText, apply_stops, eos_token_ids, stop_token_set
from serving.target import load_default_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Größe: 3½ m² — naïve café, 日本語のテキスト, emoji 🤖🚀 and\n  indented code: def f(x): return x**2",
    "    for i in range(10):\n        print(i)  # ✓",
]


@pytest.fixture(scope="module")
def tok():
    return load_default_tokenizer()


def _stream(tok, ids, chunk_sizes, stop=None, prompt=(1, 2, 3)):
    out = OutputText(tok, list(prompt), stop)
    pieces, i = [], 0
    for n in chunk_sizes:
        if i >= len(ids):
            break
        res = out.push(ids[i : i + n])
        pieces.append(res.text)
        if res.stopped:
            return pieces, i + res.stop_index, out
        i += n
    pieces.append(out.flush())
    return pieces, None, out


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunking", ["one", "random"])
def test_incremental_text_equals_full_decode(tok, text, chunking):
    ids = tok.encode(text)
    sizes = (
        [1] * len(ids)
        if chunking == "one"
        else np.random.default_rng(0).integers(1, 6, len(ids)).tolist()
    )
    pieces, stopped, out = _stream(tok, ids, sizes)
    assert stopped is None
    assert "".join(pieces) == tok.decode(ids) == text
    assert out.text == text
    # a piece never ends inside a multi-byte character
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_trims_text_and_reports_the_completing_token(tok):
    text = TEXTS[0]
    ids = tok.encode(text)
    pieces, stop_at, out = _stream(tok, ids, [3] * len(ids), stop=["lazy"])
    assert "".join(pieces) == "The quick brown fox jumps over the "
    assert "lazy" in tok.decode(ids[:stop_at]) and "lazy" not in tok.decode(ids[: stop_at - 1])
    assert out.stopped


def test_text_that_may_start_a_stop_string_is_held_back_then_released(tok):
    ids = tok.encode("over the lazy dog")
    out = OutputText(tok, [], ["lazy cat"])
    released = []
    for t in ids:
        res = out.push([t])
        released.append(res.text)
        # never stream a prefix of the stop string before knowing it is not one
        assert not "".join(released).endswith((" lazy", " la"))
    released.append(out.flush())
    assert "".join(released) == "over the lazy dog"


def test_earliest_stop_string_wins_and_spans_tokens(tok):
    ids = tok.encode("alpha beta gamma delta")
    pieces, stop_at, _ = _stream(tok, ids, [len(ids)], stop=["delta", "ta gam"])
    assert "".join(pieces) == "alpha be"
    assert stop_at is not None and stop_at < len(ids)


def test_id_only_models_produce_no_text():
    out = OutputText(None, [1, 2], ["x"])
    assert out.push([5, 6]).text == "" and out.flush() == ""


# ---- apply_stops: the shared per-step stop rule ---------------------------------------------------


def test_no_stop_keeps_every_token_and_holds_back_a_possible_stop_prefix(tok):
    ids = tok.encode("over the lazy dog")
    out = OutputText(tok, [], ["lazy cat"])
    step = apply_stops(out, frozenset(), ids[:3])  # "over the lazy"
    assert step.tokens == ids[:3] and not step.stopped
    assert step.text == "over the "  # "lazy" could start "lazy cat": held back
    step = apply_stops(out, frozenset(), ids[3:])
    assert step.text + out.flush() == "lazy dog"


def test_a_stop_token_keeps_its_id_but_not_its_text(tok):
    ids = tok.encode("alpha beta gamma delta")
    stop = ids[2]
    step = apply_stops(OutputText(tok, [], []), frozenset({stop}), ids)
    assert step.stopped and step.tokens == ids[:3]  # through the stop token, not after it
    assert step.text == tok.decode(ids[:2])


def test_a_stop_string_cuts_the_step_at_the_completing_token(tok):
    ids = tok.encode("alpha beta gamma delta")
    step = apply_stops(OutputText(tok, [], ["gamma"]), frozenset(), ids)
    assert step.stopped and step.text == "alpha beta "
    kept = step.tokens
    assert "gamma" in tok.decode(kept) and "gamma" not in tok.decode(kept[:-1])


def test_a_stop_string_before_a_stop_token_wins(tok):
    ids = tok.encode("alpha beta gamma delta")
    step = apply_stops(OutputText(tok, [], ["beta"]), frozenset({ids[-1]}), ids)
    assert step.stopped and step.text == "alpha "
    assert ids[-1] not in step.tokens and len(step.tokens) < len(ids)


def test_a_stop_token_first_emits_nothing(tok):
    ids = tok.encode("alpha beta")
    step = apply_stops(OutputText(tok, [], ["x"]), frozenset({ids[0]}), ids)
    assert step.stopped and step.tokens == ids[:1] and step.text == ""


def test_stop_token_set_adds_eos_unless_ignored():
    assert stop_token_set([5, 7], frozenset({2})) == {2, 5, 7}
    assert stop_token_set([5], frozenset({2}), ignore_eos=True) == {5}


def test_eos_ids_come_from_every_source():
    gen = SimpleNamespace(eos_token_id=[2, 3])
    cfg = SimpleNamespace(eos_token_id=4)
    tokenizer = SimpleNamespace(eos_token_id=None)
    assert eos_token_ids(gen, None, cfg, tokenizer, SimpleNamespace()) == {2, 3, 4}


@pytest.mark.parametrize("skip", [True, False])
def test_the_step_threads_decoder_gives_the_tokenizers_text(tok, skip):
    """OutputText decodes through the fast tokenizer's backend where the wrapper adds nothing:
    the same text as ``tokenizer.decode``, special tokens included or skipped."""
    from serving.output import _decoder

    chat = tok.apply_chat_template([{"role": "user", "content": "héllo 😀 wörld"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(chat, add_special_tokens=False)["input_ids"] + tok.encode(" def f(x):\n\treturn x")
    assert any(i in tok.all_special_ids for i in ids)
    assert _decoder(tok, skip)(ids) == tok.decode(ids, skip_special_tokens=skip)
