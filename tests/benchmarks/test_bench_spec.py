"""bench spec on a tiny target: both k policies run on the same prompts, stay lossless, and the
report carries their ratio."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.bench_spec import bench_spec_async
from infra.prompts import PromptItem


def test_fixed_and_adaptive_k_on_the_same_prompts():
    from serving.target import tiny_target

    target = tiny_target()  # the real tokenizer, random weights
    items = [PromptItem(id=f"{d}{i}", prompt=f"{d} prompt number {i}: say something", domain=d)
             for d in ("chat", "code") for i in range(3)]
    out = asyncio.run(bench_spec_async(items, drafter_kind="suffix", limit=2, warm=1, max_tokens=12, k=3,
                                       policy="both", target=target))
    assert out["lossless"] is True  # both policies, both phases: token-identical to target-only
    assert out["policy"] == "fixed"
    assert set(out["adaptive_vs_fixed"]) == {"day0", "warmed"}
    for phase in ("day0", "warmed"):
        fixed, adaptive = out[phase], out["adaptive"][phase]
        assert set(fixed["by_domain"]) == set(adaptive["by_domain"]) == {"chat", "code"}
        assert out["adaptive_vs_fixed"][phase] == pytest.approx(adaptive["spec_tok_s"] / fixed["spec_tok_s"], rel=1e-3)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        asyncio.run(bench_spec_async([], policy="sometimes"))


def test_batches_report_never_slower_ratios_and_tree_stats():
    from serving.target import tiny_target

    target = tiny_target()
    items = [PromptItem(id=f"c{i}", prompt=f"code prompt {i}: repeat repeat repeat", domain="code")
             for i in range(6)]
    # 4 prompts of 16 tokens at batch 2: rows replace each other as they finish, so both engines
    # run many steps with both rows (2 prompts of 10 tokens could, when the second request was
    # admitted late, leave the speculative engine no full-batch step to time)
    out = asyncio.run(bench_spec_async(items, drafter_kind="suffix", limit=4, warm=1, max_tokens=16, k=4,
                                       policy="adaptive", target=target, batches=(1, 2), batch_repeats=2))
    assert out["tree"] is True and out["lossless"] is True
    assert set(out["by_batch"]) == {"1", "2"}
    for entry in out["by_batch"].values():
        assert entry["lossless"] is True
        assert entry["speedup"] > 0 and entry["never_slower"] == (entry["speedup"] >= 0.97)
        plain = entry["plain_step_ms"]
        if plain["target_only"] and plain["speculative"]:  # scaled by the engines' plain steps
            expected = entry["speedup"] * plain["speculative"] / plain["target_only"]
            # the plain steps are reported to 3 decimals (ms): a tiny model's ~0.3 ms step then
            # carries ~0.2 % rounding, which the recomputed ratio inherits
            rounding = 5e-4 / plain["speculative"] + 5e-4 / plain["target_only"]
            assert abs(entry["speedup_at_equal_plain_step"] - expected) <= expected * rounding + 1e-4
        full = entry["speedup_at_full_batch"]  # the ratio over the steps that ran all b rows
        assert full is not None and full > 0 and entry["never_slower_at_full_batch"] == (full >= 0.97)
        rounds = entry["round_speedups"]  # one ratio per ABBA round; equal tokens in both runs of a
        assert len(rounds) == 2  # round (lossless), so the pooled ratio is a mean of the two
        assert min(rounds) - 1e-3 <= entry["speedup"] <= max(rounds) + 1e-3
        assert entry["speedup_median_round"] == pytest.approx(sum(rounds) / 2, abs=1e-3)
        assert entry["never_slower_median_round"] == (entry["speedup_median_round"] >= 0.97)
        low, high = entry["speedup_interval"]  # a bootstrap over the rounds holds the pooled ratio
        assert min(rounds) - 1e-3 <= low <= entry["speedup"] <= high <= max(rounds) + 1e-3
        assert all(s >= 0 for s in entry["between_steps_s"].values())
        for share in entry["tail_time_fraction"].values():
            assert share is None or 0.0 <= share <= 1.0
    assert out["by_batch"]["1"]["tail_time_fraction"] == {"target_only": 0.0, "speculative": 0.0}
    assert "nodes_per_row_step" in out["warmed"]["by_domain"]["code"]


def test_bench_spec_refuses_bad_batch_sizes_before_loading_anything(monkeypatch):
    from typer.testing import CliRunner

    import benchmarks.bench_spec
    from infra.cli import app

    def refuse(*a, **k):
        raise AssertionError("the benchmark started: --batch was not checked first")

    monkeypatch.setattr(benchmarks.bench_spec, "run", refuse)
    for bad in ("x", "1,0", "4,,-2"):
        out = CliRunner().invoke(app, ["bench", "spec", "--batch", bad])
        text = " ".join(out.output.replace("│", " ").split())
        assert out.exit_code == 2 and "batch sizes >= 1" in text, (bad, out.output)


def test_each_pair_prefills_the_same_prompt_tokens_on_both_sides():
    """The baseline engine serves every evaluation prompt again beside each speculative run: with a
    prefix cache it copied them in while each fresh speculative engine prefilled them, and the
    ratio charged speculation for prefill work the baseline skipped."""
    from serving.target import tiny_target

    target = tiny_target()
    items = [PromptItem(id=f"{d}{i}", prompt=f"{d} prompt number {i}: say something about item {i}", domain=d)
             for d in ("chat", "code") for i in range(3)]
    out = asyncio.run(bench_spec_async(items, drafter_kind="suffix", limit=2, warm=1, max_tokens=8, k=3,
                                       policy="adaptive", target=target))
    for phase in ("day0", "warmed"):
        for domain, entry in out[phase]["by_domain"].items():
            cached = entry["cached_prompt_tokens"]
            assert cached["speculative"] == cached["target_only"], (phase, domain, cached)


def test_sampled_requests_are_seeded_per_prompt_and_stay_lossless():
    """What an OpenAI client gets by default is sampled (temperature 1.0): bench spec measures it
    too, each request seeded from its prompt, so a speculative and a target-only run of a prompt
    emit the same tokens (position-keyed sampling) and lossless is still token identity."""
    from benchmarks.runner import prompt_seed, run_prompts
    from serving.engine.config import EngineConfig
    from serving.engine.torch_engine import TorchEngine
    from serving.target import tiny_target

    target = tiny_target()
    items = [PromptItem(id=f"c{i}", prompt=f"code prompt {i}: repeat repeat repeat", domain="code")
             for i in range(3)]
    out = asyncio.run(bench_spec_async(items, drafter_kind="suffix", limit=2, warm=1, max_tokens=12, k=3,
                                       policy="adaptive", target=target, temperature=1.0, batches=(2,),
                                       batch_repeats=2))
    assert out["temperature"] == 1.0 and out["lossless"] is True and out["by_batch"]["2"]["lossless"]
    assert prompt_seed([1, 2, 3]) == prompt_seed([1, 2, 3]) != prompt_seed([1, 2, 4])

    async def outputs(temperature):
        engine = TorchEngine(target, None, EngineConfig(k=0))
        try:
            prompts = [target.tokenizer.encode(p.prompt) for p in items]
            return (await run_prompts(engine, prompts, 12, temperature=temperature)).outputs
        finally:
            await engine.stop()

    sampled, again, greedy = (asyncio.run(outputs(t)) for t in (1.0, 1.0, 0.0))
    assert sampled == again != greedy  # seeded: reproducible, and not the greedy answers
