"""The gate simulates the suffix drafter serving runs: on the same history, at every step of the
gate's replay, serving's SuffixDrafter proposes the same tokens (same length, same confidences)."""

import numpy as np
import pytest
from trainer_tracegen import make_trace

from feedback.suffix.draft import SuffixConfig
from serving.drafters.base import DraftRequestView
from serving.drafters.suffix import SuffixDrafter
from trainer.gate import GateConfig, build_suffix_index, simulate


def gate_proposals(proposer, rec, k, accept_at, monkeypatch):
    """(context, draft) at every step of the gate's replay of ``rec``."""
    seen = []
    draft = proposer.draft

    def spy(req, k):
        d = draft(req, k)
        seen.append((list(req.tokens), d))
        return d

    with monkeypatch.context() as m:
        m.setattr(proposer, "draft", spy)
        simulate(rec.output_ids, rec.prompt_ids, accept_at, GateConfig(k=k), proposer, rec.tenant)
    return seen


def serving_proposals(drafter, rec, contexts, k, rid):
    """Serving's proposals at the same contexts, the request grown through the Drafter protocol."""
    prompt = rec.prompt_ids.tolist()
    v = DraftRequestView(rid, list(prompt), len(prompt), rec.tenant)
    drafter.add_request(v)
    out = []
    for ctx in contexts:
        assert ctx[: len(v.token_ids)] == v.token_ids
        new = ctx[len(v.token_ids) :]
        if new:
            v.token_ids = v.token_ids + new
            drafter.on_verified(rid, new, None)
        prop = drafter.propose([v], k)
        n = int(prop.lengths[0])
        out.append((prop.tokens[0, :n].tolist(), prop.confidence[0, :n].tolist(), drafter.last_drafts[0].source))
    drafter.remove_request(rid, None)  # held out: not fed to the index, as in the gate
    return out


def _history_bigram():
    train = [make_trace("a", seed=i) for i in range(30)]
    held = [make_trace("a", seed=500 + i) for i in range(5)] + [make_trace("b", seed=600 + i) for i in range(2)]
    return train, held


def _history_tenants():
    """Two tenants; some held-out requests repeat an output their own tenant already served."""
    train = [make_trace("a", seed=i, tenant="t1") for i in range(10)]
    train += [make_trace("b", seed=100 + i, tenant="t2", prompt_len=9, out_len=40) for i in range(10)]
    held = [make_trace("a", seed=3, tenant="t1"), make_trace("a", seed=3, tenant="t2"),
            make_trace("b", seed=104, tenant="t2", prompt_len=9, out_len=40), make_trace("b", seed=700, tenant="t3")]
    return train, held


@pytest.mark.parametrize(
    "history, config, k",
    [
        # the gate simulates chains: serving's token trees (tree_branches > 1) are not simulated
        (_history_bigram, SuffixConfig(tree_branches=1), 3),
        (_history_bigram, SuffixConfig(tree_branches=1), 6),
        (_history_tenants, SuffixConfig(tree_branches=1), 4),
        (_history_tenants, SuffixConfig(index_prompts=True, min_confidence=0.0, max_index_tokens=200,
                                        tree_branches=1), 5),
    ],
)
def test_gate_simulates_the_proposals_serving_makes(history, config, k, monkeypatch):
    _assert_same_proposals(history, config, k, monkeypatch)


def test_gate_simulates_a_seeded_index_as_serving_drafts_from_it(tmp_path, monkeypatch):
    """Both sides read the same seed (SPECLOOP_SUFFIX_SEED_FILE): a tenant the training traces
    never saw drafts from the seed in both."""
    from feedback.suffix.seed import SuffixSeed, write_seed

    fp = make_trace("a", seed=0).target
    seeded = [make_trace("b", seed=700 + i).output_ids.tolist() for i in range(3)]  # t3's answer among them
    path = write_seed(tmp_path / "seed.json", SuffixSeed(fingerprint=fp, source="test", sequences=seeded))
    monkeypatch.setenv("SPECLOOP_SUFFIX_SEED_FILE", str(path))
    config = SuffixConfig(tree_branches=1)
    assert config.seed_file == path
    _assert_same_proposals(_history_tenants, config, 4, monkeypatch)
    assert build_suffix_index([], config).index("t3").num_tokens == sum(map(len, seeded))


def _assert_same_proposals(history, config, k, monkeypatch):
    train, held = history()
    proposer = build_suffix_index(train, config)
    serving = SuffixDrafter(config)
    for rec in train:  # what a trace consumer does with the same traces
        serving.observe_trace(rec)
    rng = np.random.default_rng(k)
    sources, steps = set(), 0
    for i, rec in enumerate(held):
        # a learned drafter accepting a varying number of tokens where the suffix has nothing
        accept_at = rng.integers(0, k + 1, size=len(rec.output_ids))
        for learned in (None, accept_at):
            gate = gate_proposals(proposer, rec, k, learned, monkeypatch)
            served = serving_proposals(serving, rec, [ctx for ctx, _ in gate], k, rid=f"h{i}")
            for (_, d), (tokens, conf, source) in zip(gate, served, strict=True):
                assert d.tokens == tokens and len(d.tokens) == len(tokens)
                assert d.confidence == pytest.approx(conf, rel=1e-6)
                assert d.source == source
                sources.add(source)
            steps += len(gate)
    assert {"context", "index", ""} <= sources, sources  # both sources and misses were exercised
    assert steps > 50
