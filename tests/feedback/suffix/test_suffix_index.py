"""The suffix automata shared by serving's suffix drafter and the trainer's gate."""

import random
from pathlib import Path

from feedback.suffix.index import SuffixAutomaton, SuffixIndex, walk

# -- the automaton -------------------------------------------------------------------------


def test_automaton_counts_and_matches_agree_with_brute_force():
    rng = random.Random(0)
    for _ in range(100):
        seqs = [[rng.randrange(3) for _ in range(rng.randrange(1, 15))] for _ in range(rng.randrange(1, 4))]
        sam = SuffixAutomaton()
        for s in seqs:
            sam.add_sequence(s)
        occ: dict[tuple, int] = {}
        for s in seqs:
            for i in range(len(s)):
                for j in range(i + 1, len(s) + 1):
                    occ[tuple(s[i:j])] = occ.get(tuple(s[i:j]), 0) + 1
        for sub, n in occ.items():
            assert sam.count[sam.match(sub)[0]] == n
        for _ in range(10):
            q = [rng.randrange(4) for _ in range(rng.randrange(1, 10))]
            longest = max(n for n in range(len(q) + 1) if n == 0 or tuple(q[len(q) - n :]) in occ)
            assert sam.match(q)[1] == longest


def test_walk_follows_the_most_frequent_continuation_with_counts():
    sam = SuffixAutomaton()
    for seq in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7], [9, 2, 3, 4, 5]):
        sam.add_sequence(seq)
    state, matched = sam.match([8, 1, 2, 3])
    assert matched == 3
    steps = walk([(sam, state)], k=2, matched=3)
    assert [s.token for s in steps] == [4, 5] or [s.token for s in steps] == [4, 6]
    assert [(s.count, s.total, s.matched) for s in steps] == [(2, 3, 3), (1, 2, 4)]
    # the shorter suffix "2 3" has more evidence: 4 follows 3 of its 4 occurrences, then 5 twice
    steps = walk([(sam, sam.shorten(state, 2))], k=2, matched=2)
    assert [(s.token, s.count, s.total) for s in steps] == [(4, 3, 4), (5, 2, 3)]


def test_walk_backs_off_to_a_shorter_suffix_where_nothing_follows():
    sam = SuffixAutomaton()
    sam.add_sequence([1, 2, 3])  # "1 2 3" ends a sequence: nothing follows it here...
    sam.add_sequence([9, 2, 3, 4, 5])  # ...but "2 3" goes on
    state, matched = sam.match([1, 2, 3])
    steps = walk([(sam, state)], k=3, matched=matched)
    assert [(s.token, s.matched) for s in steps] == [(4, 2), (5, 3)]
    assert walk([(sam, state)], k=3, matched=matched, min_match=3) == []


def test_suffix_index_generation_sizes():
    idx = SuffixIndex(max_tokens=100, generations=2)
    for _ in range(10):
        idx.add(range(30))
    assert len(idx.gens) == 2 and all(sam.num_tokens <= 50 for _, sam in idx.gens)


def test_the_suffix_core_is_torch_free_and_imports_no_other_side():
    """feedback/suffix_* is run by both serving and the trainer: it may import neither, nor torch."""
    import subprocess
    import sys

    code = ("import sys, feedback.suffix.index, feedback.suffix.draft;"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'serving', 'trainer')];"
            "assert not bad, bad")
    root = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=120)
