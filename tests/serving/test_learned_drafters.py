"""Eagle / standalone / hybrid drafters on a tiny random target (token ids only)."""

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from feedback.bus.trace import DrafterKind
from feedback.drafters.eagle_head import eagle_from_target, gather_features
from feedback.drafters.standalone_lm import StandaloneConfig, standalone_from_target
from feedback.registry.artifact import DrafterArtifactError, save_drafter
from serving.drafters import build_drafter
from serving.drafters.base import Drafter, DraftProposal, DraftRequestView
from serving.drafters.eagle import EagleDrafter
from serving.drafters.hybrid import HybridDrafter, HybridPolicy
from serving.drafters.learned import LearnedDrafter
from serving.drafters.standalone import StandaloneDrafter
from serving.target import tiny_target

V, H, K = 256, 64, 4
LAYERS = (1, 2, 3)


@pytest.fixture(autouse=True)
def chains(monkeypatch):
    """Learned drafters draft chains in this module's tests (their references are chains); token
    trees (``LearnedDrafter.branches`` > 1, serving's default) are tested in test_learned_trees.py."""
    monkeypatch.setattr(LearnedDrafter, "branches", 1)


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=V, hidden_size=H, num_layers=4, seed=0)


def _sharpen(model_head: torch.nn.Linear, factor: float = 8.0) -> None:
    """Random tiny models are near-uniform; scale the lm_head so drafts have clear favourites."""
    with torch.no_grad():
        model_head.weight.mul_(factor)


@pytest.fixture(scope="module")
def eagle_head(target):
    head = eagle_from_target(
        target.model,
        draft_vocab_size=96,
        special_ids=[V - 1],
        feature_layers=LAYERS,
        init="random",
        seed=1,
    )
    _sharpen(head.lm_head)
    return head


@pytest.fixture(scope="module")
def sharp_head(target):
    """Confident drafts (q of the drafted tokens well above the verify cost of proposing them)."""
    head = eagle_from_target(
        target.model, draft_vocab_size=96, feature_layers=LAYERS, init="random", seed=4
    )
    _sharpen(head.lm_head, 25.0)
    return head


@pytest.fixture(scope="module")
def small_lm(target):
    model = standalone_from_target(target.model, num_layers=2, init="random", seed=2)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 8.0)
    return model


def features(target, seq):
    with torch.no_grad():
        hs = target.model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    return gather_features(hs, LAYERS)[0]  # [len(seq), F]


def history(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n,), generator=g).tolist()


class Engine:
    """Drives a drafter the way the engine does: features for the eagle head from the target."""

    def __init__(self, target, drafter):
        self.target, self.drafter, self.views = target, drafter, {}

    def add(self, rid, seq, temperature=0.0, generator=None):
        view = DraftRequestView(
            rid, list(seq), max(1, len(seq) - 2), temperature=temperature, generator=generator
        )
        feats = features(self.target, seq)[:-1] if self.drafter.feature_layers else None
        self.drafter.add_request(view, feats)
        self.views[rid] = view
        return view

    def verified(self, rid, accepted):
        view = self.views[rid]
        n = len(view.token_ids)
        view.token_ids = view.token_ids + list(accepted)
        feats = None
        if self.drafter.feature_layers:
            feats = features(self.target, view.token_ids)[n - 1 : n - 1 + len(accepted)]
        self.drafter.on_verified(rid, list(accepted), feats)

    def propose(self, rids, k=K):
        return self.drafter.propose([self.views[r] for r in rids], k)


def make(kind, target, eagle_head, small_lm):
    if kind == "eagle":
        return EagleDrafter(eagle_head)
    return StandaloneDrafter(small_lm, bf16=False)  # the reference forward is fp32


# -- references: the models' public forward, no drafter machinery ----------------------------


def eagle_reference(target, head, seq, k):
    f = features(target, seq)[:-1]
    cache = DynamicCache()
    toks, probs = [], []
    with torch.no_grad():
        hid = head(torch.tensor([seq[1:]]), features=f[None], cache=cache)[:, -1:]
        for _ in range(k):
            q = head.compute_logits(hid[:, -1]).float().softmax(-1)[0]  # [Vd]
            i = int(q.argmax())
            tid = int(head.draft_vocab()[i])
            toks.append(tid)
            probs.append(float(q[i]))
            hid = head(torch.tensor([[tid]]), hid, cache=cache)
    return toks, probs


def standalone_reference(model, seq, k, first_position=0):
    seq, toks, probs = list(seq), [], []
    with torch.no_grad():
        for _ in range(k):
            positions = torch.arange(first_position, first_position + len(seq))[None]
            q = model(torch.tensor([seq]), position_ids=positions).logits[0, -1].float().softmax(-1)
            i = int(q.argmax())
            toks.append(i)
            probs.append(float(q[i]))
            seq.append(i)
    return toks, probs


@pytest.mark.parametrize("kind", ["eagle", "standalone"])
def test_greedy_proposals_match_the_models_own_forward(kind, target, eagle_head, small_lm):
    eng = Engine(target, make(kind, target, eagle_head, small_lm))
    seqs = {f"r{i}": history(i, n) for i, n in enumerate((7, 15, 3))}
    for rid, seq in seqs.items():
        eng.add(rid, seq)
    p = eng.propose(list(seqs))
    assert p.tokens.shape == (3, K) and p.probs.shape == (3, K) and p.lengths.tolist() == [K] * 3
    assert p.dists is None and torch.equal(p.confidence, p.probs)
    assert set(p.source.tolist()) == {DrafterKind.parse(kind)}
    for row, seq in enumerate(seqs.values()):
        if kind == "eagle":
            toks, probs = eagle_reference(target, eagle_head, seq, K)
        else:
            toks, probs = standalone_reference(small_lm, seq, K)
        assert p.tokens[row].tolist() == toks
        assert torch.allclose(p.probs[row], torch.tensor(probs), atol=1e-4)
    if kind == "eagle":
        assert bool(eagle_head.t2d[p.tokens].all())  # drafted ids come from the draft vocabulary


@pytest.mark.parametrize("kind", ["eagle", "standalone"])
def test_proposals_are_deterministic_and_proposing_leaves_state_untouched(
    kind, target, eagle_head, small_lm
):
    a = Engine(target, make(kind, target, eagle_head, small_lm))
    b = Engine(target, make(kind, target, eagle_head, small_lm))
    for eng in (a, b):
        eng.add("x", history(5, 11))
        eng.add("y", history(6, 4))
    first = a.propose(["x", "y"])
    again = a.propose(["x", "y"])  # speculative positions of the first call must not leak
    other = b.propose(["x", "y"])
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.tokens, other.tokens)
    assert torch.allclose(first.probs, again.probs, atol=1e-6)


@pytest.mark.parametrize("kind", ["eagle", "standalone"])
def test_state_after_on_verified_matches_a_fresh_drafter_with_the_full_history(
    kind, target, eagle_head, small_lm
):
    eng = Engine(target, make(kind, target, eagle_head, small_lm))
    eng.add("a", history(1, 9))
    eng.add("b", history(2, 5))
    p = eng.propose(["a", "b"])
    # a: first two drafts accepted + a bonus token; b: nothing accepted, only the bonus token
    eng.verified("a", p.tokens[0, :2].tolist() + [17])
    eng.verified("b", [200])
    eng.propose(["b"])  # b alone moves ahead; a keeps its pending tokens
    eng.verified("b", [3, 4, 5])
    after = eng.propose(["a", "b"])

    fresh = Engine(target, make(kind, target, eagle_head, small_lm))
    fresh.add("a", eng.views["a"].token_ids)
    fresh.add("b", eng.views["b"].token_ids)
    expect = fresh.propose(["a", "b"])
    assert torch.equal(after.tokens, expect.tokens)
    assert torch.allclose(after.probs, expect.probs, atol=1e-4)


@pytest.mark.parametrize("kind", ["eagle", "standalone"])
def test_prepared_request_caught_up_matches_a_fresh_drafter_with_the_full_history(
    kind, target, eagle_head, small_lm
):
    """What a hot swap does (TorchEngine.swap_drafter): prepare_request from a snapshot of the
    history (its draft KV computed at once, not at the next propose), then on_verified with what
    was committed since; proposals equal those of a drafter given the whole history."""
    drafter = make(kind, target, eagle_head, small_lm)
    seqs = {"a": history(7, 40), "b": history(8, 6)}
    done = {"a": 33, "b": 6}  # b: nothing committed between snapshot and install
    for rid, seq in seqs.items():
        snap = DraftRequestView(rid, seq[: done[rid]], 2)
        feats = features(target, snap.token_ids)[:-1] if drafter.feature_layers else None
        drafter.prepare_request(snap, feats)
        state = drafter._states[rid]
        assert state.num_pending == 0 and state.length > 0  # the history is in the draft KV now
    eng = Engine(target, drafter)
    for rid, seq in seqs.items():
        eng.views[rid] = DraftRequestView(rid, seq[: done[rid]], 2)
        if done[rid] < len(seq):
            eng.verified(rid, seq[done[rid] :])
    got = eng.propose(["a", "b"])

    fresh = Engine(target, make(kind, target, eagle_head, small_lm))
    for rid, seq in seqs.items():
        fresh.add(rid, seq)
    expect = fresh.propose(["a", "b"])
    assert torch.equal(got.tokens, expect.tokens)
    assert torch.allclose(got.probs, expect.probs, atol=1e-4)


@pytest.mark.parametrize("kind", ["eagle", "standalone"])
def test_a_prepared_long_row_commits_what_a_fresh_drafter_would(kind, target, eagle_head, small_lm):
    """A swap prepares a running row from its latest ``max_catch_up`` inputs, as a drafter that
    started with the request reads them at its first draft: the same proposals, and only that
    many columns of draft KV computed (a whole 2,000-token history cost 219-474 ms on 2 cores)."""
    drafter = make(kind, target, eagle_head, small_lm)
    seq = history(9, drafter.max_catch_up * 2 + 20)
    snap = DraftRequestView("a", seq, 2)
    drafter.prepare_request(snap, features(target, seq)[:-1] if drafter.feature_layers else None)
    state = drafter._states["a"]
    assert state.length == drafter.max_catch_up  # the rest skipped (positions kept), not computed
    assert state.skipped + state.length >= len(seq) - 1  # eagle's inputs are one shorter
    eng = Engine(target, drafter)
    eng.views["a"] = snap
    fresh = Engine(target, make(kind, target, eagle_head, small_lm))
    fresh.add("a", seq)
    got, expect = eng.propose(["a"]), fresh.propose(["a"])
    assert torch.equal(got.tokens, expect.tokens)
    assert torch.allclose(got.probs, expect.probs, atol=1e-4)


@pytest.mark.parametrize("kind", ["eagle", "standalone"])
def test_long_pending_rows_are_flushed_without_changing_proposals(
    kind, target, eagle_head, small_lm
):
    drafter = make(kind, target, eagle_head, small_lm)
    eng = Engine(target, drafter)
    eng.add("long", history(3, drafter.flush_threshold + 20))
    eng.add("short", history(4, 3))
    together = eng.propose(["long", "short"])
    alone = Engine(target, make(kind, target, eagle_head, small_lm))
    alone.add("long", history(3, drafter.flush_threshold + 20))
    alone.add("short", history(4, 3))
    assert torch.equal(together.tokens[0], alone.propose(["long"]).tokens[0])
    assert torch.equal(together.tokens[1], alone.propose(["short"]).tokens[0])


def test_a_row_far_behind_commits_only_its_latest_inputs_at_their_own_positions(target, small_lm):
    """After a gap longer than ``max_catch_up`` (a probe, a new request's prompt) the drafter reads
    the latest inputs as a sliding window would: what the model's own forward predicts from them,
    at the positions they have in the request."""
    drafter = StandaloneDrafter(small_lm, bf16=False)
    drafter.max_catch_up = 8
    eng = Engine(target, drafter)
    seq = history(11, 20)
    eng.add("r", seq)
    eng.add("short", history(12, 5))  # within the window: its whole history, as before
    p = eng.propose(["r", "short"])
    toks, probs = standalone_reference(small_lm, seq[-8:], K, first_position=12)
    assert p.tokens[0].tolist() == toks
    assert torch.allclose(p.probs[0], torch.tensor(probs), atol=1e-4)
    assert p.tokens[1].tolist() == standalone_reference(small_lm, history(12, 5), K)[0]
    state = drafter._states["r"]
    assert (state.length, state.skipped) == (8, 12)
    eng.verified("r", [5, 6, 7])  # drafting goes on from the window, positions unchanged
    toks, probs = standalone_reference(small_lm, (seq + [5, 6, 7])[12:], K, first_position=12)
    assert eng.propose(["r"]).tokens[0].tolist() == toks


def test_eagle_features_are_dropped_with_their_tokens(target, eagle_head):
    drafter = EagleDrafter(eagle_head)
    drafter.max_catch_up = 6
    eng = Engine(target, drafter)
    eng.add("r", history(13, 15))
    assert eng.propose(["r"]).lengths.tolist() == [K]
    state = drafter._states["r"]
    assert (state.length, state.skipped, state.num_pending) == (6, 8, 0)
    eng.verified("r", history(14, 9))  # 9 pending tokens, 9 feature rows: 3 of each dropped
    assert eng.propose(["r"]).lengths.tolist() == [K]
    assert (state.length, state.skipped) == (12, 11)


@pytest.mark.parametrize("kind", ["eagle", "standalone"])
def test_sampled_rows_return_full_vocab_dists_consistent_with_probs(
    kind, target, eagle_head, small_lm
):
    eng = Engine(target, make(kind, target, eagle_head, small_lm))
    eng.add("greedy", history(8, 6))
    eng.add("hot", history(9, 6), temperature=1.0, generator=torch.Generator().manual_seed(3))
    p = eng.propose(["greedy", "hot"])
    assert p.dists is not None and p.dists.shape == (2, K, V)
    assert torch.allclose(p.dists.sum(-1), torch.ones(2, K), atol=1e-5)
    picked = p.dists.gather(2, p.tokens[..., None])[..., 0]  # [2, k]
    assert torch.allclose(picked, p.probs, atol=1e-6)
    if kind == "eagle":
        assert float(p.dists[:, :, ~eagle_head.t2d].abs().sum()) == 0.0
    assert torch.equal(p.tokens[0, 0], p.dists[0, 0].argmax())  # the greedy row is still the argmax
    # the per-request generator makes sampling reproducible
    again = Engine(target, make(kind, target, eagle_head, small_lm))
    again.add("hot", history(9, 6), temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(again.propose(["hot"]).tokens[0], p.tokens[1])


def test_sampled_first_tokens_follow_the_draft_distribution(target, sharp_head):
    head = sharp_head
    eng = Engine(target, EagleDrafter(head))
    eng.add("s", history(10, 8), temperature=1.0)
    n = 800
    q = eng.propose(["s"], k=1).dists[0, 0]  # [V]
    counts = torch.zeros(V)
    for _ in range(n):
        counts[eng.propose(["s"], k=1).tokens[0, 0]] += 1
    freq = counts / n
    top = q.topk(5).indices
    assert float(q[top].sum()) > 0.5  # a sharp distribution, so the check has power
    sigma = (q[top] * (1 - q[top]) / n).sqrt()
    assert bool(((freq[top] - q[top]).abs() < 4 * sigma + 0.01).all()), (freq[top], q[top])
    assert float(freq[q == 0].sum()) == 0.0


def test_eagle_requires_target_features(target, eagle_head):
    drafter = EagleDrafter(eagle_head)
    view = DraftRequestView("r", history(0, 5), 3)
    with pytest.raises(ValueError, match="features"):
        drafter.add_request(view, None)
    with pytest.raises(ValueError, match=r"\[4, 192\]"):
        drafter.add_request(view, torch.zeros(3, 192))
    with pytest.raises(KeyError):
        drafter.propose([view], K)
    assert drafter.feature_layers == LAYERS and isinstance(drafter, Drafter)


def test_k_zero_and_unknown_rows(target, small_lm):
    drafter = StandaloneDrafter(small_lm, bf16=False)
    view = DraftRequestView("r", history(0, 5), 3)
    drafter.add_request(view)
    assert drafter.propose([view], 0).tokens.shape == (1, 0)
    drafter.remove_request("r", [1, 2])
    with pytest.raises(KeyError):
        drafter.propose([view], K)


# -- hybrid ---------------------------------------------------------------------------------


class StandInSuffix:
    """A suffix-like drafter: fixed per-request drafts and confidences; records calls."""

    kind = "suffix"
    version = "day0"
    feature_layers = ()

    def __init__(self, drafts: dict[str, tuple[list[int], float]]):
        self.drafts = drafts
        self.verified: list[tuple[str, list[int]]] = []
        self.added: list[str] = []

    def add_request(self, view, features=None):
        self.added.append(view.request_id)

    def on_verified(self, request_id, accepted_ids, features):
        self.verified.append((request_id, list(accepted_ids)))

    def remove_request(self, request_id, output_ids):
        pass

    def propose(self, views, k):
        p = DraftProposal.empty(len(views), k)
        p.confidence = torch.zeros(len(views), k)
        for i, v in enumerate(views):
            toks, conf = self.drafts.get(v.request_id, ([], 0.0))
            n = min(len(toks), k)
            if n:
                p.tokens[i, :n] = torch.tensor(toks[:n])
                p.lengths[i] = n
                p.confidence[i, :n] = conf
                p.source[i] = DrafterKind.SUFFIX
        return p


class Spy:
    """Wraps a learned drafter, recording which rows it was asked to propose for."""

    def __init__(self, inner):
        self.inner, self.proposed = inner, []
        self.kind, self.version, self.feature_layers = (
            inner.kind,
            inner.version,
            inner.feature_layers,
        )

    def add_request(self, view, features=None):
        self.inner.add_request(view, features)

    def on_verified(self, request_id, accepted_ids, features):
        self.inner.on_verified(request_id, accepted_ids, features)

    def remove_request(self, request_id, output_ids):
        self.inner.remove_request(request_id, output_ids)

    def propose(self, views, k):
        self.proposed.append([v.request_id for v in views])
        return self.inner.propose(views, k)


CHEAP = {
    "prior_acceptance": 0.6,
    "target_step_ms": 40.0,
    "draft_ms_per_step": 1.0,
    "measure_verify": False,
    "explore": 0.0,
}


def test_hybrid_takes_a_confident_suffix_and_the_learned_drafter_elsewhere(target, sharp_head):
    suffix = StandInSuffix({"conf": ([7, 8, 9, 10], 0.95), "weak": ([11, 12], 0.05)})
    learned = Spy(EagleDrafter(sharp_head))
    eng = Engine(target, HybridDrafter(suffix, learned, HybridPolicy(**CHEAP)))
    for seed, rid in enumerate(("conf", "weak", "nomatch")):
        eng.add(rid, history(seed, 6))
    p = eng.propose(["conf", "weak", "nomatch"])
    assert p.source.tolist() == [DrafterKind.SUFFIX, DrafterKind.EAGLE, DrafterKind.EAGLE]
    assert learned.proposed == [["weak", "nomatch"]]  # the learned drafter only ran where needed
    assert p.tokens[0].tolist() == [7, 8, 9, 10] and p.probs[0].tolist() == [1.0] * 4
    assert p.lengths.tolist() == [4, 4, 4]
    alone = Engine(target, EagleDrafter(sharp_head))
    alone.add("weak", eng.views["weak"].token_ids)
    assert torch.equal(p.tokens[1], alone.propose(["weak"]).tokens[0])


def test_hybrid_proposes_nothing_when_the_learned_drafter_does_not_pay(target, sharp_head):
    suffix = StandInSuffix({"conf": ([7, 8], 0.9)})
    learned = Spy(EagleDrafter(sharp_head))
    policy = HybridPolicy(
        prior_acceptance=0.05,
        target_step_ms=40.0,
        draft_ms_per_step=10.0,
        measure_verify=False,
        explore=0.0,
    )
    eng = Engine(target, HybridDrafter(suffix, learned, policy))
    eng.add("conf", history(1, 6))
    eng.add("none", history(2, 6))
    p = eng.propose(["conf", "none"])
    assert p.source.tolist() == [DrafterKind.SUFFIX, DrafterKind.NONE]
    assert p.lengths.tolist() == [2, 0] and learned.proposed == []


@pytest.mark.parametrize("verify_slope, draft_ms, drafted", [(0.175, 0.88, 1), (0.001, 0.01, K)])
def test_hybrid_drafts_the_learned_drafter_only_as_far_as_pays(target, sharp_head, verify_slope, draft_ms,
                                                                drafted):
    """At acceptance 0.35, where a draft token costs 0.09 target steps and each verified token
    adds 0.175 of a step (this CPU), one token pays (1.35 / 1.26) and four lose (1.53 / 2.05);
    where drafting and verifying are nearly free (a GPU), all k pay."""
    learned = Spy(EagleDrafter(sharp_head))
    policy = HybridPolicy(prior_acceptance=0.35, target_step_ms=10.0, draft_ms_per_step=draft_ms,
                          measure_verify=False, explore=0.0)
    hybrid = HybridDrafter(StandInSuffix({}), learned, policy)
    hybrid.costs.verify_slope = verify_slope
    hybrid.costs.observe_draft = lambda n, ms: None  # keep the stated draft cost (tiny model timings)
    eng = Engine(target, hybrid)
    eng.add("r", history(3, 6))
    p = eng.propose(["r"])
    assert p.source.tolist() == [DrafterKind.EAGLE]
    assert p.lengths.tolist() == [drafted]


def test_hybrid_threshold_and_learned_acceptance_tracking(target, sharp_head):
    suffix = StandInSuffix({"a": ([5, 6, 7], 0.5)})  # expected accepted 0.5+0.25+0.125 = 0.875
    hybrid = HybridDrafter(
        suffix, EagleDrafter(sharp_head), HybridPolicy(suffix_threshold=0.8, **CHEAP)
    )
    eng = Engine(target, hybrid)
    eng.add("a", history(1, 6))
    eng.add("b", history(2, 6))
    p = eng.propose(["a", "b"])
    assert p.source.tolist() == [DrafterKind.SUFFIX, DrafterKind.EAGLE]
    before = hybrid.acceptance.value
    eng.verified("a", [5, 6, 7, 1])
    eng.verified("b", [9])  # learned draft rejected at once: acceptance estimate drops
    assert hybrid.acceptance.value < before
    assert suffix.verified == [("a", [5, 6, 7, 1]), ("b", [9])]


def test_hybrid_keeps_the_learned_state_in_sync_for_suffix_rows(target, sharp_head):
    suffix = StandInSuffix({"r": ([1, 2, 3, 4], 0.99)})
    learned = Spy(EagleDrafter(sharp_head))
    eng = Engine(target, HybridDrafter(suffix, learned, HybridPolicy(**CHEAP)))
    eng.add("r", history(4, 7))
    for accepted in ([1, 2, 3, 4, 9], [1, 2, 30], [5]):
        assert eng.propose(["r"]).source[0] == DrafterKind.SUFFIX
        eng.verified("r", accepted)
    assert learned.proposed == []
    suffix.drafts.clear()  # no match any more: the learned drafter takes over with its state current
    p = eng.propose(["r"])
    fresh = Engine(target, EagleDrafter(sharp_head))
    fresh.add("r", eng.views["r"].token_ids)
    assert p.source[0] == DrafterKind.EAGLE
    assert torch.equal(p.tokens[0], fresh.propose(["r"]).tokens[0])


def test_hybrid_mixes_point_masses_with_sampled_learned_dists(target, sharp_head):
    suffix = StandInSuffix({"s": ([7, 8], 0.99)})
    eng = Engine(target, HybridDrafter(suffix, EagleDrafter(sharp_head), HybridPolicy(**CHEAP)))
    eng.add("s", history(1, 6), temperature=1.0)
    eng.add("l", history(2, 6), temperature=1.0)
    p = eng.propose(["s", "l"])
    assert p.source.tolist() == [DrafterKind.SUFFIX, DrafterKind.EAGLE]
    assert p.dists.shape == (2, K, V)
    assert (
        p.dists[0, 0, 7] == 1.0 and p.dists[0, 1, 8] == 1.0 and float(p.dists[0, 2:].sum()) == 0.0
    )
    assert torch.allclose(p.dists[1].sum(-1), torch.ones(K), atol=1e-5)


def test_hybrid_with_the_real_suffix_drafter_uses_a_repeated_pattern(target):
    drafter = build_drafter(
        "hybrid",
        target,
        learned_options={"draft_vocab_size": 96, "feature_layers": LAYERS},
        policy={"measure_verify": False, "explore": 0.0},
    )
    assert drafter.suffix.kind == "suffix" and drafter.learned.kind == "eagle"
    eng = Engine(target, drafter)
    pattern = [11, 12, 13, 14, 15, 16, 17, 18]
    eng.add("p", pattern * 4 + pattern[:3])
    p = eng.propose(["p"])
    assert p.source[0] == DrafterKind.SUFFIX
    assert p.tokens[0, : p.lengths[0]].tolist() == pattern[3 : 3 + int(p.lengths[0])]


# -- factory ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["suffix", "eagle", "standalone", "hybrid"])
def test_build_drafter_day0_every_kind(kind, target):
    options = {
        "eagle": {"draft_vocab_size": 64},
        "standalone": {"num_layers": 1},
        "hybrid": {"learned_options": {"draft_vocab_size": 64}},
        "suffix": {},
    }[kind]
    drafter = build_drafter(kind, target, **options)
    assert drafter.kind == kind and drafter.version == "day0" and isinstance(drafter, Drafter)
    eng = Engine(target, drafter)
    eng.add("r", history(0, 9))
    p = eng.propose(["r"])
    assert p.tokens.shape == (1, K) and 0 <= int(p.lengths[0]) <= K
    assert int(p.tokens.max()) < V


def test_build_drafter_from_artifacts(target, tmp_path):
    head = eagle_from_target(target.model, draft_vocab_size=64, feature_layers=LAYERS)
    save_drafter(head, head.config, target.fingerprint, tmp_path / "e", version="v7")
    model = standalone_from_target(target.model, num_layers=1)
    save_drafter(
        model,
        StandaloneConfig.for_target(target.model.config, 1, V),
        target.fingerprint,
        tmp_path / "s",
        version="v3",
    )
    eagle = build_drafter("eagle", target, tmp_path / "e")
    assert eagle.version == "v7" and eagle.feature_layers == LAYERS
    hybrid = build_drafter("hybrid", target, tmp_path / "s")
    assert hybrid.learned.kind == "standalone" and hybrid.version == "v3"
    with pytest.raises(ValueError, match="standalone drafter, not eagle"):
        build_drafter("eagle", target, tmp_path / "s")
    other = tiny_target(vocab_size=V, hidden_size=H, num_layers=4, seed=1)
    with pytest.raises(DrafterArtifactError, match="refusing"):
        build_drafter("eagle", other, tmp_path / "e")
    with pytest.raises(ValueError, match="unknown drafter kind"):
        build_drafter("medusa", target)
    with pytest.raises(TypeError):
        build_drafter("eagle", target, bogus=1)
    eng = Engine(target, eagle)
    eng.add("r", history(0, 9))
    assert eng.propose(["r"]).lengths.tolist() == [K]


def test_an_eagle_head_cut_from_another_depth_of_target_is_refused_at_load(target, tmp_path):
    """Same fingerprint, vocabulary and width, but read from layers this 4-layer target does not
    have: refused when it is built, not at the first step that asks the target for its features
    (which would fail every request in the batch)."""
    deeper = tiny_target(vocab_size=V, hidden_size=H, num_layers=8, seed=0)
    head = eagle_from_target(deeper.model, draft_vocab_size=64, feature_layers=(1, 5, 7))
    save_drafter(head, head.config, target.fingerprint, tmp_path / "e", version="v9")
    for kind in ("eagle", "hybrid"):
        with pytest.raises(ValueError, match="does not fit this target.*target_num_layers"):
            build_drafter(kind, target, tmp_path / "e")


def test_a_drafter_starts_from_the_acceptance_its_artifact_measured(target, tmp_path):
    from serving.engine.config import EngineConfig
    from serving.engine.goodput_policy import GoodputPolicy
    from serving.engine.torch_engine import TorchEngine

    model = standalone_from_target(target.model, num_layers=1)
    config = StandaloneConfig.for_target(target.model.config, 1, V)
    save_drafter(model, config, target.fingerprint, tmp_path / "m", version="v1",
                 extra={"heldout_acceptance": 0.27})
    save_drafter(model, config, target.fingerprint, tmp_path / "u", version="v2")
    measured = build_drafter("standalone", target, tmp_path / "m")
    assert measured.prior_acceptance == pytest.approx(0.27)
    assert build_drafter("standalone", target, tmp_path / "u").prior_acceptance is None
    assert build_drafter("standalone", target).prior_acceptance is None  # a day-0 copy
    # the hybrid judges its learned part from there; serving's policy, a learned drafter alone
    assert build_drafter("hybrid", target, tmp_path / "m").acceptance.value == pytest.approx(0.27)
    engine = TorchEngine(target, measured, EngineConfig(k=K), policy=GoodputPolicy(K))
    assert engine.policy.acceptance.value == pytest.approx(0.27)
    engine.swap_drafter(build_drafter("standalone", target))  # not running: installed at once
    assert engine.policy.acceptance.value == pytest.approx(0.5)  # unmeasured: the default prior
    engine.swap_drafter(build_drafter("standalone", target, tmp_path / "m"))
    assert engine.policy.acceptance.value == pytest.approx(0.27)


def test_a_promoted_successor_starts_from_its_predecessors_live_acceptance(target, tmp_path):
    """After a shift the trainer's mixed-domain held-out figure (here 0.2) reads far below what the
    live drafter accepts on the new domain; a successor starts at its predecessor's live estimate
    times the gate's ratio of the two (0.2 / 0.16 on the same traces), in serving's policy and in
    the hybrid the artifact loader builds around the running suffix index."""
    from serving.artifact_loader import ArtifactDrafterLoader
    from serving.engine.config import EngineConfig
    from serving.engine.goodput_policy import GoodputPolicy
    from serving.engine.torch_engine import TorchEngine

    model = standalone_from_target(target.model, num_layers=1)
    config = StandaloneConfig.for_target(target.model.config, 1, V)
    save_drafter(model, config, target.fingerprint, tmp_path / "m", version="v1",
                 extra={"heldout_acceptance": 0.27})
    save_drafter(model, config, target.fingerprint, tmp_path / "s", version="v2",
                 extra={"heldout_acceptance": 0.2, "champion_heldout_acceptance": 0.16})
    successor = build_drafter("standalone", target, tmp_path / "s")
    assert successor.prior_acceptance == pytest.approx(0.2) and successor.prior_relative == pytest.approx(1.25)

    def live(estimate, steps=30):  # two of five one-token drafts accepted
        for i in range(steps):
            estimate.observe(np.array([1]), np.array([int(i % 5 < 2)]))
        return estimate.value

    engine = TorchEngine(target, build_drafter("standalone", target, tmp_path / "m"), EngineConfig(k=K),
                         policy=GoodputPolicy(K))
    was = live(engine.policy.acceptance)
    engine.swap_drafter(successor)
    assert engine.policy.acceptance.value == pytest.approx(was * 1.25)

    loader = ArtifactDrafterLoader(target, "hybrid")
    running = loader.load(tmp_path / "m")
    was = live(running.acceptance)
    promoted = loader.load(tmp_path / "s", current=running)
    assert promoted.suffix is running.suffix
    assert promoted.acceptance.value == pytest.approx(was * 1.25)
    assert loader.load(tmp_path / "s").acceptance.value == pytest.approx(0.2)  # no predecessor


def test_a_first_promotion_around_the_running_suffix_index_keeps_servings_estimate(target, tmp_path):
    """A day-0 hybrid is the suffix index alone; its first promotion wraps that index into a hybrid.
    Serving's estimate covers the drafts as a whole, mostly the index's, which the swap keeps: it
    goes on (with its calibration) instead of starting afresh at the default prior, which turned
    speculation off for ~400 steps in a demo."""
    from serving.artifact_loader import ArtifactDrafterLoader
    from serving.engine.config import EngineConfig
    from serving.engine.goodput_policy import GoodputPolicy
    from serving.engine.torch_engine import TorchEngine

    model = standalone_from_target(target.model, num_layers=1)
    config = StandaloneConfig.for_target(target.model.config, 1, V)
    save_drafter(model, config, target.fingerprint, tmp_path / "v1", version="1",
                 extra={"heldout_acceptance": 0.21, "champion_heldout_acceptance": 0.0})
    engine = TorchEngine(target, build_drafter("suffix", target), EngineConfig(k=K), policy=GoodputPolicy(K))
    for i in range(40):  # the suffix index live: three of four drafts accepted
        engine.policy.acceptance.observe(np.array([1]), np.array([int(i % 4 < 3)]))
    was, calibration = engine.policy.acceptance.value, engine.policy.calibration
    assert was > 0.6
    promoted = ArtifactDrafterLoader(target, "hybrid").load(tmp_path / "v1", current=engine.drafter)
    assert promoted.suffix is engine.drafter and promoted.prior_relative == 1.0
    engine.swap_drafter(promoted)
    assert engine.policy.acceptance.value == pytest.approx(was) and engine.policy.calibration is calibration


def test_unused_rows_in_hybrid_proposal_are_zero_padded(target, sharp_head):
    suffix = StandInSuffix({"a": ([7], 0.99)})
    eng = Engine(target, HybridDrafter(suffix, EagleDrafter(sharp_head), HybridPolicy(**CHEAP)))
    eng.add("a", history(1, 6))
    p = eng.propose(["a"])
    assert p.lengths.tolist() == [1] and p.tokens[0].tolist() == [7, 0, 0, 0]
    assert isinstance(p.source, np.ndarray) and p.source.dtype == np.uint8


def test_hybrid_writes_off_a_learned_drafter_that_accepts_nothing_within_a_few_drafts(target, sharp_head):
    """The prior acceptance is worth a couple of steps, not an EMA's ~20: after a few rejected
    learned drafts the hybrid stops asking the learned drafter (it costs a draft and a verified
    token each time)."""
    learned = Spy(EagleDrafter(sharp_head))
    policy = HybridPolicy(prior_acceptance=0.35, target_step_ms=10.0, draft_ms_per_step=0.88,
                          measure_verify=False, explore=0.0)
    hybrid = HybridDrafter(StandInSuffix({}), learned, policy)
    hybrid.costs.verify_slope = 0.175
    hybrid.costs.observe_draft = lambda n, ms: None  # keep the stated draft cost (tiny model timings)
    eng = Engine(target, hybrid)
    eng.add("r", history(3, 6))
    asked = 0
    for _ in range(12):
        p = eng.propose(["r"])
        if p.source[0] == DrafterKind.EAGLE:
            asked += 1
        eng.verified("r", [1])  # every learned draft rejected at its first token
    assert 1 <= asked <= 2  # a plain EMA from the prior (prior_steps=None) asked 6 times of 12


@pytest.mark.parametrize("budget, step_ms, most", [(1.0, 1000.0, None), (1e-4, 1.0, 3)])
def test_hybrid_exploration_costs_at_most_its_budget(target, sharp_head, budget, step_ms, most):
    """Rows without a suffix match where the learned drafter is not worth asking are still explored
    at ``explore`` (here 0.3), unless those calls would cost more than ``explore_budget`` of the
    steps: then they are cut to what the measured cost per row affords. (The first case's step is
    long enough that no machine's call cost binds: at a 1 ms step a slow spell of this VM measured
    the tiny head's calls at ~4 ms and the budget cut exploration, failing on the old code too.)"""
    learned = Spy(EagleDrafter(sharp_head))
    policy = HybridPolicy(prior_acceptance=0.0, target_step_ms=step_ms, draft_ms_per_step=10.0,
                          measure_verify=False, explore=0.3, explore_budget=budget, seed=1)
    hybrid = HybridDrafter(StandInSuffix({}), learned, policy)
    eng = Engine(target, hybrid)
    eng.add("r", history(4, 6))
    for _ in range(60):
        p = eng.propose(["r"])
        eng.verified("r", [int(p.tokens[0, 0]) if p.lengths[0] else 1])
    calls = len(learned.proposed)
    if most is None:
        assert calls >= 8  # ~0.3 x 60
    else:
        assert 1 <= calls <= most  # the first call measured what one costs
    assert hybrid.explore_fraction(1) <= 0.3
