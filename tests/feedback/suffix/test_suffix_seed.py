"""A seeded suffix index: the target's own answers as every tenant's oldest, read-only generation."""

import json

import pytest

from feedback.suffix.draft import SuffixConfig, SuffixProposer
from feedback.suffix.index import SuffixAutomaton, SuffixIndex
from feedback.suffix.seed import SuffixSeed, SuffixSeedError, read_seed, seed_automaton, write_seed
from feedback.target.fingerprint import TargetFingerprint

FP = TargetFingerprint(model_id="tiny", tokenizer_hash="0" * 16, vocab_size=100)
OTHER = TargetFingerprint(model_id="other", tokenizer_hash="1" * 16, vocab_size=100)
HABIT = [10, 11, 12, 13, 14, 15, 16, 17]  # how the target "always" opens an answer


def _seed_file(tmp_path, sequences=(HABIT, [40, 41, 42]), fp=FP):
    return write_seed(tmp_path / "seed.json", SuffixSeed(fingerprint=fp, source="test", sequences=list(sequences)))


def test_a_seeded_proposer_drafts_a_new_tenants_first_request_from_the_seed(tmp_path):
    path = _seed_file(tmp_path)
    context = [1, 2, 3, 10, 11, 12]  # the prompt ends where the habit starts
    cold = SuffixProposer(SuffixConfig(use_prompt_lookup=False))
    assert cold.draft(cold.start("t", context, 3), 4).tokens == []
    seeded = SuffixProposer(SuffixConfig(use_prompt_lookup=False, seed_file=path))
    draft = seeded.draft(seeded.start("t", context, 3), 4)
    assert draft.source == "index"
    assert draft.tokens == [13, 14, 15, 16][: len(draft.tokens)] and draft.tokens


def test_the_seed_is_shared_read_only_and_evicted_like_a_generation():
    seed = SuffixAutomaton()
    seed.add_sequence(HABIT)
    a, b = SuffixIndex(40, 4, seed=seed), SuffixIndex(40, 4, seed=seed)
    a.add([1, 2, 3])
    assert seed.num_tokens == len(HABIT)  # traffic never goes into the seed
    assert a.gens[0][1] is seed and b.gens[0][1] is seed and len(a.gens) == 2
    assert b.num_tokens == len(HABIT)  # another tenant's traffic is not in b
    for i in range(4):  # four more generations of traffic push the seed out
        a.add([50 + i] * 10)
    assert all(sam is not seed for _, sam in a.gens)
    assert b.gens[0][1] is seed


def test_forgetting_a_tenant_keeps_the_seed_for_its_next_request(tmp_path):
    p = SuffixProposer(SuffixConfig(use_prompt_lookup=False, seed_file=_seed_file(tmp_path)))
    p.observe("t", [60, 61, 62, 63])
    assert p.indexes.pop("t") is not None  # what SuffixDrafter.forget_tenant does
    req = p.start("t", [60, 61, 10, 11], 2)
    assert p.draft(req, 2).tokens[:1] == [12]  # the seed is back, the tenant's output is gone
    assert p.draft(p.start("t", [5, 60, 61], 2), 2).tokens == []


def test_the_automaton_is_built_once_per_file_version(tmp_path):
    path = _seed_file(tmp_path)
    first = seed_automaton(path)
    assert seed_automaton(path) is first
    _seed_file(tmp_path, sequences=([1, 2, 3, 4, 5, 6, 7, 8, 9],))
    assert seed_automaton(path) is not first


@pytest.mark.parametrize("content, message", [
    ("not json", "JSONDecodeError"),
    (json.dumps({"format": 1, "source": "x", "sequences": [[1]]}), "fingerprint"),
    (json.dumps({"format": 2, "fingerprint": FP.model_dump(), "source": "x", "sequences": []}), "format"),
    (json.dumps({"format": 1, "fingerprint": FP.model_dump(), "source": "x", "sequences": [[1, 100]]}),
     "token id 100 outside"),
    (b"\xff\xfe", "UnicodeDecodeError"),
])
def test_a_broken_seed_file_is_refused_with_a_clear_error(tmp_path, content, message):
    path = tmp_path / "seed.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SuffixSeedError, match=message):
        read_seed(path)
    with pytest.raises(SuffixSeedError):
        SuffixProposer(SuffixConfig(seed_file=path))


def test_another_targets_seed_is_refused(tmp_path):
    path = _seed_file(tmp_path, fp=OTHER)
    assert read_seed(path).fingerprint == OTHER
    with pytest.raises(SuffixSeedError, match="not by the target served"):
        read_seed(path, expected=FP)


def test_a_missing_seed_file_is_refused_with_a_clear_error(tmp_path):
    with pytest.raises(SuffixSeedError, match="FileNotFoundError"):
        SuffixProposer(SuffixConfig(seed_file=tmp_path / "nope.json"))
