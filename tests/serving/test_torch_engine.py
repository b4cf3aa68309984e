"""TorchEngine: losslessness (greedy and sampled), batching, stops, seeds, aborts, swaps, features.

Tiny random Llama targets (fp32, ids only unless a tokenizer is needed): exact numerics, so greedy
outputs must be token-identical to plain one-token-at-a-time decoding.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
import torch

from kernels.sampling import probs_from_logits
from serving.engine.base import GenerationRequest, RequestError, SamplingParams
from serving.engine.batch_cache import RaggedKVCache
from serving.engine.config import EngineConfig
from serving.engine.policy import FixedK
from serving.engine.reference import target_greedy_reference, teacher_forced_check
from serving.engine.torch_engine import TorchEngine
from serving.target import tiny_target

PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12], [42, 42, 42], [5, 17]]


def _req(rid, prompt, params):
    return GenerationRequest(request_id=rid, prompt_ids=list(prompt), params=params)


def _tokens(chunks):
    return [t for c in chunks for t in c.token_ids]


@pytest.fixture(scope="module")
def refs(ids_target):
    return {tuple(p): target_greedy_reference(ids_target.model, p, 48) for p in PROMPTS}


# ---- the ragged KV cache ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_ragged_cache_with_masked_columns_matches_unpadded_runs(dtype, tol):
    """Rows of different lengths share one cache; each step appends 3 columns per row and keeps
    only some (the rest are 'rejected' garbage under the mask). Every kept logit must equal an
    unpadded single-sequence forward."""
    torch.manual_seed(0)
    model = tiny_target(vocab_size=97, dtype=dtype, seed=1).model
    seqs = [torch.randint(0, 97, (n,)) for n in (5, 12, 1, 30)]
    with torch.inference_mode():
        ref = [model(s[None]).logits[0].float() for s in seqs]  # [n, V] each
        cache = RaggedKVCache.for_model(model)
        done = [2, 7, 0, 20]  # prefilled individually, then merged (different lengths)
        for s, n in zip(seqs, done):
            row = RaggedKVCache.for_model(model, batch_size=1)
            if n:
                pos, mask = row.prepare(n)
                model(s[None, :n], position_ids=pos, attention_mask=mask, past_key_values=row)
                row.commit([n])
            cache.append(row)
        worst, checked = 0.0, 0
        while any(d < len(s) for d, s in zip(done, seqs)):
            inp = torch.zeros(len(seqs), 3, dtype=torch.long)  # [B, 3]
            for b, s in enumerate(seqs):
                chunk = s[done[b] : done[b] + 3]
                inp[b, : len(chunk)] = chunk
            pos, mask = cache.prepare(3)
            logits = model(inp, position_ids=pos, attention_mask=mask, past_key_values=cache).logits
            kept = []
            for b, s in enumerate(seqs):
                n = min(2, len(s) - done[b])  # keep at most 2 of 3: the third is 'rejected'
                for i in range(n):
                    worst = max(
                        worst, (logits[b, i].float() - ref[b][done[b] + i]).abs().max().item()
                    )
                    checked += 1
                kept.append(n)
                done[b] += n
            cache.commit(kept)
            if len(seqs) == 4 and done[2] >= len(seqs[2]):  # a row leaves mid-way
                order = cache.drop_rows({2})  # row 3 moves into row 2's slot
                seqs, ref, done = ([x[r] for r in order] for x in (seqs, ref, done))
    assert checked == sum(n for n in (5, 12, 1, 30)) - 29  # every non-prefilled position
    assert worst < tol


# ---- greedy losslessness ----------------------------------------------------------------------


def test_target_only_greedy_matches_reference(ids_target, refs, run):
    engine = TorchEngine(ids_target, None, EngineConfig(k=0, max_batch_size=3))
    reqs = [_req(f"r{i}", p, SamplingParams(max_tokens=48)) for i, p in enumerate(PROMPTS)]
    outs = run(engine, reqs, delays=[0.0, 0.0, 0.01, 0.02, 0.03])
    for p, chunks in zip(PROMPTS, outs):
        assert _tokens(chunks) == refs[tuple(p)]
        assert chunks[-1].finish_reason == "length"
        assert chunks[-1].stats.drafted_tokens == 0
        assert chunks[-1].stats.verify_steps == 48


@pytest.mark.parametrize("corrupt_every", [0, 3])
def test_spec_greedy_with_good_drafts_matches_reference(
    ids_target, refs, run, drafters, corrupt_every
):
    drafter = drafters.Replay(refs, vocab=101, corrupt_every=corrupt_every)
    engine = TorchEngine(ids_target, drafter, EngineConfig(k=4, max_batch_size=3))
    reqs = [_req(f"r{i}", p, SamplingParams(max_tokens=48)) for i, p in enumerate(PROMPTS)]
    outs = run(engine, reqs, delays=[0.0, 0.005, 0.01, 0.0, 0.02])
    for p, chunks in zip(PROMPTS, outs):
        assert _tokens(chunks) == refs[tuple(p)]
        stats = chunks[-1].stats
        assert stats.accepted_tokens > 0
        assert stats.accepted_tokens + stats.verify_steps == 48
    mean_accept = np.mean([c[-1].stats.mean_accept_len for c in outs])
    assert mean_accept > (4.0 if corrupt_every == 0 else 2.0)
    # the drafter saw every request and was told the final outputs
    assert {f"r{i}" for i in range(len(PROMPTS))} == set(drafter.removed)
    assert drafter.removed["r0"] == refs[tuple(PROMPTS[0])]


def test_spec_greedy_with_garbage_drafts_matches_reference(ids_target, refs, run, drafters):
    drafter = drafters.Garbage(vocab=101, seed=1)
    engine = TorchEngine(ids_target, drafter, EngineConfig(k=6, max_batch_size=8))
    reqs = [_req(f"r{i}", p, SamplingParams(max_tokens=48)) for i, p in enumerate(PROMPTS)]
    outs = run(engine, reqs, delays=[0.0, 0.01, 0.0, 0.02, 0.005])
    for p, chunks in zip(PROMPTS, outs):
        assert _tokens(chunks) == refs[tuple(p)]
        assert chunks[-1].stats.drafted_tokens > 0


def test_spec_greedy_with_suffix_drafter_matches_reference(ids_target, refs, run):
    suffix = pytest.importorskip("serving.drafters.suffix")
    cls = getattr(suffix, "SuffixDrafter", None)
    if cls is None:
        pytest.skip("serving.drafters.suffix has no SuffixDrafter yet")
    try:
        drafter = cls()
    except TypeError as e:
        pytest.skip(f"SuffixDrafter needs arguments: {e}")
    prompts = PROMPTS + [p * 3 for p in PROMPTS[:2]]  # repetitive prompts give it matches
    expected = {tuple(p): target_greedy_reference(ids_target.model, p, 48) for p in prompts}
    for rnd in range(2):  # the second round can draft from the first round's outputs
        engine = TorchEngine(ids_target, drafter, EngineConfig(k=4, max_batch_size=4))
        reqs = [
            _req(f"s{rnd}-{i}", p, SamplingParams(max_tokens=48)) for i, p in enumerate(prompts)
        ]
        outs = run(engine, reqs)
        for p, chunks in zip(prompts, outs):
            assert _tokens(chunks) == expected[tuple(p)]
    assert sum(c[-1].stats.accepted_tokens for c in outs) > 0


def test_teacher_forced_check_flags_non_argmax_tokens(ids_target, refs):
    prompt = PROMPTS[0]
    good = teacher_forced_check(ids_target.model, prompt, refs[tuple(prompt)])
    assert good.mismatches == [] and good.max_gap == 0.0 and good.lossless()
    bad_out = list(refs[tuple(prompt)])
    bad_out[5] = (bad_out[5] + 1) % 101
    bad = teacher_forced_check(ids_target.model, prompt, bad_out)
    assert bad.mismatches[0] == 5 and bad.max_gap > 0 and not bad.lossless(ulps=0)


# ---- sampling losslessness --------------------------------------------------------------------


def _exact_joint(model, prompt, n_tokens, temperature, top_k, top_p):
    """Exact target distribution of the first ``n_tokens`` sampled tokens, [V]*n_tokens."""
    vocab = model.config.vocab_size
    joint = np.zeros((vocab,) * n_tokens)
    with torch.inference_mode():
        for prefix in itertools.product(range(vocab), repeat=n_tokens - 1):
            mass = 1.0
            for j in range(n_tokens):
                ids = torch.tensor([prompt + list(prefix[:j])], device=model.device)
                logits = model(ids).logits[:, -1]  # [1, V]
                p = probs_from_logits(logits, temperature, top_k, top_p)[0].double().cpu().numpy()
                if j < n_tokens - 1:
                    mass *= p[prefix[j]]
            joint[prefix] = mass * p
    return joint


def _tv_threshold(joint, n, trials=400, seed=0):
    """TV between ``joint`` and an n-sample empirical distribution: mean + 6 sd under the null."""
    rng = np.random.default_rng(seed)
    flat = joint.ravel() / joint.sum()
    tvs = [0.5 * np.abs(rng.multinomial(n, flat) / n - flat).sum() for _ in range(trials)]
    return float(np.mean(tvs) + 6 * np.std(tvs))


@pytest.mark.parametrize(
    "case",
    [
        # point-mass drafts (garbage), sample-and-match, seeded
        {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "drafter": "garbage",
            "k": 3,
            "seeded": True,
        },
        # the same at a temperature alone (the native walk's softmax at the reached nodes)
        {
            "temperature": 0.4,
            "top_p": 1.0,
            "top_k": 0,
            "drafter": "garbage",
            "k": 3,
            "seeded": True,
        },
        # stochastic drafts with reported dists: rejection sampling; top-p cut
        {
            "temperature": 1.0,
            "top_p": 0.7,
            "top_k": 0,
            "drafter": "fixed_dist",
            "k": 3,
            "seeded": True,
        },
        # unseeded rows through rejection sampling, top-k cut and temperature
        {
            "temperature": 0.8,
            "top_p": 1.0,
            "top_k": 3,
            "drafter": "fixed_dist",
            "k": 2,
            "seeded": False,
        },
    ],
    ids=["match-seeded", "match-seeded-temperature", "rejection-top_p", "rejection-unseeded-top_k"],
)
def test_sampled_output_distribution_equals_target(peaked, run, drafters, case):
    target = peaked(vocab_size=8)
    model, vocab, n_tok, n_req = target.model, 8, 2, 1200
    prompt = [1, 2, 3, 0]
    exact = _exact_joint(model, prompt, n_tok, case["temperature"], case["top_k"], case["top_p"])
    q = np.array([0.4, 0.2, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05])
    drafter = (
        drafters.Garbage(vocab=vocab, seed=2)
        if case["drafter"] == "garbage"
        else drafters.FixedDist(q, seed=3)
    )
    torch.manual_seed(1234)  # unseeded rows use the global RNG
    engine = TorchEngine(target, drafter, EngineConfig(k=case["k"], max_batch_size=64))
    params = {name: case[name] for name in ("temperature", "top_p", "top_k")}
    reqs = [
        _req(
            f"s{i}",
            prompt,
            SamplingParams(max_tokens=n_tok, seed=i if case["seeded"] else None, **params),
        )
        for i in range(n_req)
    ]
    outs = run(engine, reqs)
    counts = np.zeros_like(exact)
    for chunks in outs:
        counts[tuple(_tokens(chunks))] += 1
    drafted = sum(c[-1].stats.drafted_tokens for c in outs)
    accepted = sum(c[-1].stats.accepted_tokens for c in outs)
    assert drafted > 0 and 0 < accepted < drafted  # both outcomes exercised
    tv = 0.5 * np.abs(counts / n_req - exact).sum()
    limit = _tv_threshold(exact, n_req)
    assert tv < limit, f"TV {tv:.4f} >= {limit:.4f}"
    # the test can fail: the draft's own distribution, or ignoring temperature/top-k/top-p, is far off
    q_joint = np.outer(q, q)
    assert 0.5 * np.abs(q_joint - exact).sum() > 3 * limit
    if case["top_p"] < 1.0 or case["top_k"] or case["temperature"] != 1.0:
        plain = _exact_joint(model, prompt, n_tok, 1.0, 0, 1.0)
        assert 0.5 * np.abs(plain - exact).sum() > 2 * limit


# ---- stops and limits -------------------------------------------------------------------------


def test_stop_token_ids_and_eos(ids_target, refs, run):
    prompt = PROMPTS[2]
    ref = refs[tuple(prompt)]
    stop_tok = ref[9]
    first = ref.index(stop_tok)
    engine = TorchEngine(ids_target, None, EngineConfig(k=0))
    [chunks] = run(
        engine, [_req("a", prompt, SamplingParams(max_tokens=48, stop_token_ids=[stop_tok]))]
    )
    assert _tokens(chunks) == ref[: first + 1] and chunks[-1].finish_reason == "stop"

    target = tiny_target(vocab_size=101, hidden_size=64, num_layers=2, seed=3)
    target.model.config.eos_token_id = stop_tok
    target.model.generation_config.eos_token_id = stop_tok
    for ignore_eos, expected, reason in ((False, ref[: first + 1], "stop"), (True, ref, "length")):
        engine = TorchEngine(target, None, EngineConfig(k=0))
        [chunks] = run(
            engine, [_req("e", prompt, SamplingParams(max_tokens=48, ignore_eos=ignore_eos))]
        )
        assert _tokens(chunks) == expected and chunks[-1].finish_reason == reason


def test_stop_token_inside_accepted_run_cuts_the_step(ids_target, refs, run, drafters):
    prompt = PROMPTS[0]
    ref = refs[tuple(prompt)]
    stop_tok = ref[6]
    first = ref.index(stop_tok)
    drafter = drafters.Replay(refs, vocab=101)  # accepts whole runs: the stop lands mid-run
    engine = TorchEngine(ids_target, drafter, EngineConfig(k=8))
    [chunks] = run(
        engine, [_req("a", prompt, SamplingParams(max_tokens=48, stop_token_ids=[stop_tok]))]
    )
    assert _tokens(chunks) == ref[: first + 1]
    assert drafter.removed["a"] == ref[: first + 1]


def test_max_tokens_and_context_limit(ids_target, refs, run, drafters):
    prompt = PROMPTS[2]
    ref = refs[tuple(prompt)]
    drafter = drafters.Replay(refs, vocab=101)
    engine = TorchEngine(ids_target, drafter, EngineConfig(k=4))
    [chunks] = run(engine, [_req("m", prompt, SamplingParams(max_tokens=7))])
    assert _tokens(chunks) == ref[:7] and chunks[-1].finish_reason == "length"
    assert chunks[-1].completion_tokens == 7

    ctx = len(prompt) + 10
    engine = TorchEngine(
        ids_target, drafters.Replay(refs, vocab=101), EngineConfig(k=4, max_context=ctx)
    )
    assert engine.max_context == ctx
    [chunks] = run(engine, [_req("c", prompt, SamplingParams(max_tokens=40))])
    assert _tokens(chunks) == ref[:10] and chunks[-1].finish_reason == "length"


def test_stop_strings_with_text(text_target, run):
    tok = text_target.tokenizer
    prompt = tok.encode("Once upon a time")
    ref = target_greedy_reference(text_target.model, prompt, 40)
    full = tok.decode(ref, skip_special_tokens=True)
    # streamed text equals the decoded output when nothing stops it
    engine = TorchEngine(text_target, None, EngineConfig(k=0))
    [chunks] = run(engine, [_req("t", prompt, SamplingParams(max_tokens=40, ignore_eos=True))])
    assert _tokens(chunks) == ref
    assert "".join(c.text for c in chunks) == full
    # a stop string from the middle of the output (spanning several tokens) ends it there
    start = len(full) // 2
    stop = full[start : start + 6]
    assert "\ufffd" not in stop and len(stop.strip()) > 0, "pick another prompt: odd text"
    cut = full.find(stop)
    engine = TorchEngine(text_target, None, EngineConfig(k=0))
    [chunks] = run(
        engine, [_req("s", prompt, SamplingParams(max_tokens=40, stop=[stop], ignore_eos=True))]
    )
    assert "".join(c.text for c in chunks) == full[:cut]
    assert chunks[-1].finish_reason == "stop"
    out = _tokens(chunks)
    assert out == ref[: len(out)] and len(out) < len(ref)
    assert stop in tok.decode(out) and stop not in tok.decode(out[:-1])


# ---- seeds ------------------------------------------------------------------------------------


def test_seeded_request_is_reproducible_across_batches_and_drafters(
    ids_target, refs, run, drafters
):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=32, seed=1234)
    prompt = PROMPTS[0]
    outs = []
    # alone, target only
    [c] = run(TorchEngine(ids_target, None, EngineConfig(k=0)), [_req("x", prompt, params)])
    outs.append(_tokens(c))
    # in a batch of other sampled requests joining at different times, with drafters
    for drafter in (drafters.Garbage(vocab=101, seed=9), drafters.Replay(refs, vocab=101)):
        others = [
            _req(f"o{i}", p, SamplingParams(temperature=1.0, max_tokens=20 + i, seed=None))
            for i, p in enumerate(PROMPTS)
        ]
        engine = TorchEngine(ids_target, drafter, EngineConfig(k=4, max_batch_size=4))
        res = run(
            engine,
            others[:2] + [_req("x", prompt, params)] + others[2:],
            delays=[0, 0.01, 0.005, 0, 0.02, 0],
        )
        outs.append(_tokens(res[2]))
    assert outs[0] == outs[1] == outs[2]
    other_seed = params.model_copy(update={"seed": 1235})
    [c] = run(TorchEngine(ids_target, None, EngineConfig(k=0)), [_req("y", prompt, other_seed)])
    assert _tokens(c) != outs[0]


# ---- abort, errors ----------------------------------------------------------------------------


def test_abort_ends_one_request_and_others_continue(ids_target, refs, drafters):
    drafter = drafters.Replay(refs, vocab=101, corrupt_every=2)
    engine = TorchEngine(ids_target, drafter, EngineConfig(k=2))

    async def main():
        await engine.start()
        long = engine.generate(
            _req("long", PROMPTS[1], SamplingParams(max_tokens=1900, ignore_eos=True))
        )
        other = asyncio.ensure_future(
            _collect(engine.generate(_req("other", PROMPTS[0], SamplingParams(max_tokens=48))))
        )
        await long.__anext__()
        await engine.abort("long")
        rest = [c async for c in long]
        # a client that stops listening frees its row too
        gone = engine.generate(_req("gone", PROMPTS[3], SamplingParams(max_tokens=1900)))
        await gone.__anext__()
        await gone.aclose()
        done = await other
        after = await _collect(
            engine.generate(_req("after", PROMPTS[4], SamplingParams(max_tokens=8)))
        )
        await engine.stop()
        return rest, done, after

    rest, done, after = asyncio.run(main())
    assert rest[-1].finish_reason == "abort" and rest[-1].finished
    assert rest[-1].completion_tokens < 1900
    assert drafter.removed["long"] is None and drafter.removed["gone"] is None
    assert _tokens(done) == refs[tuple(PROMPTS[0])]
    assert _tokens(after) == refs[tuple(PROMPTS[4])][:8]


async def _collect(agen):
    return [c async for c in agen]


def test_bad_requests_are_refused_and_the_engine_keeps_serving(ids_target, refs):
    engine = TorchEngine(ids_target, None, EngineConfig(k=0, max_context=64))

    async def expect_invalid(req):
        with pytest.raises(RequestError) as err:
            await _collect(engine.generate(req))
        assert err.value.invalid
        return str(err.value)

    async def main():
        await engine.start()
        msgs = [
            await expect_invalid(_req("a", [], SamplingParams())),
            await expect_invalid(_req("b", [1, 500], SamplingParams())),
            await expect_invalid(_req("c", [1] * 64, SamplingParams())),
            await expect_invalid(_req("d", [-1], SamplingParams())),
            await expect_invalid(_req("e", [1], SamplingParams(stop_token_ids=[101]))),
        ]
        ok = await _collect(engine.generate(_req("ok", PROMPTS[0], SamplingParams(max_tokens=5))))
        await engine.stop()
        return msgs, ok

    msgs, ok = asyncio.run(main())
    assert "empty" in msgs[0] and "[0, 101)" in msgs[1] and "context" in msgs[2]
    assert msgs[4] == "stop_token_ids: token id 101 is outside the vocabulary [0, 101)"
    assert _tokens(ok) == refs[tuple(PROMPTS[0])][:5]


@pytest.mark.parametrize("where", ["propose", "propose_bad_shape", "add_request", "on_verified"])
def test_failing_drafter_never_breaks_requests(ids_target, refs, run, drafters, where):
    drafter = drafters.Failing(where)
    engine = TorchEngine(ids_target, drafter, EngineConfig(k=3))
    outs = run(
        engine, [_req(f"r{i}", p, SamplingParams(max_tokens=20)) for i, p in enumerate(PROMPTS[:3])]
    )
    for p, chunks in zip(PROMPTS, outs):
        assert _tokens(chunks) == refs[tuple(p)][:20]


def test_failed_forward_ends_its_batch_with_an_error_and_the_engine_recovers(
    ids_target, refs, monkeypatch
):
    engine = TorchEngine(ids_target, None, EngineConfig(k=0))
    real_step = engine._step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device failure")
        real_step()

    monkeypatch.setattr(engine, "_step", flaky_step)

    async def main():
        await engine.start()
        with pytest.raises(RequestError) as err:
            await _collect(engine.generate(_req("x", PROMPTS[0], SamplingParams(max_tokens=10))))
        ok = await _collect(engine.generate(_req("y", PROMPTS[1], SamplingParams(max_tokens=10))))
        await engine.stop()
        return err.value, ok

    error, ok = asyncio.run(main())
    assert not error.invalid and "simulated" in str(error)
    assert _tokens(ok) == refs[tuple(PROMPTS[1])][:10]


def test_failed_prefill_ends_only_that_request(ids_target, refs, run, monkeypatch):
    engine = TorchEngine(ids_target, None, EngineConfig(k=0))
    real_prefill = engine._prefill

    def prefill(prompt_ids):
        if prompt_ids == PROMPTS[3]:
            raise RuntimeError("simulated prefill failure")
        return real_prefill(prompt_ids)

    monkeypatch.setattr(engine, "_prefill", prefill)

    async def main():
        await engine.start()
        results = await asyncio.gather(
            *[
                _collect(engine.generate(_req(f"p{i}", p, SamplingParams(max_tokens=10))))
                for i, p in enumerate(PROMPTS)
            ],
            return_exceptions=True,
        )
        await engine.stop()
        return results

    results = asyncio.run(main())
    for p, res in zip(PROMPTS, results):
        if p == PROMPTS[3]:
            assert isinstance(res, RequestError) and "simulated" in str(res)
        else:
            assert _tokens(res) == refs[tuple(p)][:10]


# ---- speculation policy, swaps, features ------------------------------------------------------


def test_policy_chooses_k_and_observes_steps(ids_target, refs, run, drafters):
    class Off:
        def __init__(self):
            self.seen = []

        def choose_k(self, state):
            assert state.k_max == 4 and len(state.room) == state.batch_size
            return 0

        def observe(self, k, num_drafted, num_accepted, draft_ms, verify_ms):
            self.seen.append((k, int(num_drafted.sum()), verify_ms))

    policy = Off()
    drafter = drafters.Replay(refs, vocab=101)
    engine = TorchEngine(ids_target, drafter, EngineConfig(k=4), policy=policy)
    [chunks] = run(engine, [_req("p", PROMPTS[0], SamplingParams(max_tokens=12))])
    assert _tokens(chunks) == refs[tuple(PROMPTS[0])][:12]
    assert len(policy.seen) == 12 and all(k == 0 and d == 0 and ms > 0 for k, d, ms in policy.seen)
    assert drafter.proposed_steps == 0


def test_swap_drafter_mid_request_stays_lossless(ids_target, refs, drafters, run, helpers):
    old = drafters.Garbage(vocab=101, seed=4, version="v1")
    new = drafters.Replay(refs, vocab=101, version="v2")

    class Always4(FixedK):
        changes = 0

        def on_drafter_change(self, prior_acceptance=None, *, version=None, relative=None):
            self.changes += 1  # the engine tells the policy its evidence went stale
            self.version = version

    policy = Always4(4)
    engine = helpers.SwapAfterSteps(3, new).watch(
        TorchEngine(ids_target, old, EngineConfig(k=4, max_batch_size=4), policy=policy)
    )
    prompt = PROMPTS[2]
    chunks, done = run(
        engine,
        [
            _req("s", prompt, SamplingParams(max_tokens=48)),
            _req("o", PROMPTS[0], SamplingParams(max_tokens=48)),
        ],
    )
    assert _tokens(chunks) == refs[tuple(prompt)]
    assert _tokens(done) == refs[tuple(PROMPTS[0])]
    assert engine.drafter is new and policy.changes == 1 and policy.version == "v2"
    assert old.removed["s"] is None and "s" in new.added  # moved, not finished, on the old one
    history = new.added["s"][0]
    assert (
        len(prompt) < len(history)
        and history == (list(prompt) + refs[tuple(prompt)])[: len(history)]
    )
    assert new.removed["s"] == refs[tuple(prompt)]
    assert chunks[-1].stats.accepted_tokens >= 10  # the replay drafter took over


def _plain_features(model, ids, layers):
    with torch.inference_mode():
        out = model(torch.tensor([ids], device=model.device), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in layers], dim=-1).cpu()  # [len, F]


def test_features_reach_the_drafter_and_are_rebuilt_on_swap(
    ids_target, refs, run, drafters, helpers
):
    layers = (1, -1)
    model = ids_target.model
    drafter = drafters.Replay(refs, vocab=101, corrupt_every=3, feature_layers=layers)
    engine = TorchEngine(ids_target, drafter, EngineConfig(k=3))
    prompt = PROMPTS[2]
    [chunks] = run(engine, [_req("f", prompt, SamplingParams(max_tokens=20))])
    out = _tokens(chunks)
    full = list(prompt) + out
    expected = _plain_features(model, full[:-1], layers)  # [len-1, F]: every input that was kept
    prefill = drafter.added["f"][1]
    assert prefill.shape == (len(prompt) - 1, 2 * model.config.hidden_size)
    steps = drafter.verified["f"]
    assert all(f.shape[0] == len(ids) for ids, f in steps)
    got = torch.cat([prefill] + [f for _, f in steps])
    assert got.shape == expected.shape
    torch.testing.assert_close(got.float().cpu(), expected.float(), atol=1e-4, rtol=1e-4)

    # swapping from a featureless drafter to one that wants features rebuilds them for the history
    plain = drafters.Garbage(vocab=101, seed=3)
    wants = drafters.Replay(refs, vocab=101, feature_layers=(-1,), version="v9")
    engine = helpers.SwapAfterSteps(4, wants).watch(TorchEngine(ids_target, plain, EngineConfig(k=2)))
    [chunks] = run(engine, [_req("g", prompt, SamplingParams(max_tokens=30))])
    history, feats = wants.added["g"]
    assert feats.shape[0] == len(history) - 1
    torch.testing.assert_close(
        feats.cpu(), _plain_features(model, history[:-1], (-1,)), atol=1e-4, rtol=1e-4
    )
    assert _tokens(chunks) == refs[tuple(prompt)][:30]


def test_eager_attention_and_a_dtype_override_give_the_same_output(refs, run, drafters):
    eager = tiny_target(vocab_size=101, hidden_size=64, num_layers=2, seed=3)
    eager.model.set_attn_implementation("eager")  # additive float mask instead of a bool one
    engine = TorchEngine(
        eager, drafters.Replay(refs, vocab=101, corrupt_every=2), EngineConfig(k=3)
    )
    outs = run(
        engine, [_req(f"e{i}", p, SamplingParams(max_tokens=24)) for i, p in enumerate(PROMPTS)]
    )
    for p, chunks in zip(PROMPTS, outs):
        assert _tokens(chunks) == refs[tuple(p)][:24]

    bf16 = tiny_target(vocab_size=101, hidden_size=64, num_layers=2, seed=3, dtype=torch.bfloat16)
    engine = TorchEngine(bf16, None, EngineConfig(k=0, dtype="float32"))
    assert next(bf16.model.parameters()).dtype == torch.float32
    [chunks] = run(engine, [_req("d", PROMPTS[0], SamplingParams(max_tokens=24))])
    assert _tokens(chunks) == refs[tuple(PROMPTS[0])][:24]
