"""``specloop bench spec``: speculative decoding vs target-only decoding on the same prompts.

For each domain in the prompt set (MT-Bench chat and HumanEval code by default) it takes ``limit``
evaluation prompts and ``warm`` other prompts of the same domain, then measures in one process:

1. target-only greedy decoding of the evaluation prompts (the baseline and the reference outputs);
2. speculative decoding at day 0 (a fresh drafter);
3. speculative decoding after the drafter served the warm-up prompts (the suffix index learns
   from finished outputs; learned drafters do not change here) — skipped when ``warm`` is 0.

Requests run one at a time (latency-bound decoding). ``lossless`` is true when every speculative
output equals the target-only output token for token. Each speculative run's speedup is against
the same prompts served target-only, each prompt right before or after its speculative run
(alternately, ABBA): one baseline minutes earlier let this VM's drift move chat's warmed ratio by
+-10 % between runs of one commit, and even a baseline of the same 8 prompts right after them read
chat at 1.16x with 1.05 tokens per verify (this VM has slow periods of seconds).
``baseline_tok_s`` and ``target_ms`` are the first baseline's (step 1).

The engines of steps 1-3 run without a prefix cache (``EngineConfig.prefix_cache_tokens`` 0), so
every measured request prefills its whole prompt on both sides, as a new prompt in traffic does.
With the cache on (the serving default) the one baseline engine, which serves every evaluation
prompt in step 1 and again beside each speculative run, copied each prompt's keys and values from
its cache (all but each prompt's last partial block of 8 tokens) while each speculative engine,
built fresh per domain and phase, prefilled them: on HumanEval about a quarter of a speculative
request's time. ``cached_prompt_tokens`` reports, per side, the prompt tokens a prefix cache served
(equal sides: equal prefill work). The ``batches`` runs keep the cache on both engines: each serves
the same prompts every round.

``policy``: ``fixed`` drafts k tokens every step; ``adaptive`` lets GoodputPolicy choose k in 0..k
per step; ``both`` runs the two on the same prompts in one process and adds ``adaptive_vs_fixed``
(tokens/s ratio per phase).

``tree`` (default on): the suffix drafter proposes token trees of up to k nodes (the adaptive policy
cuts them to the width that pays); ``nodes_per_row_step`` and ``tokens_per_verify`` report them.
``batches`` (e.g. 1,4,8): after the phases, the evaluation prompts of all domains run ``b`` at a
time through a target-only engine and through the speculative engine (adaptive policy, drafter
warmed as in the last phase), alternating A/B ``batch_repeats`` times in ABBA order (as opted-out
requests, so the drafter never learns from what it is measured on); ``by_batch`` gives each
speedup and ``never_slower`` (speedup >= 0.97).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time

import torch

from benchmarks.runner import RunResult, StepTimer, run_prompts
from infra.loop_metrics import paired_speedup_interval
from infra.prompts import (
    PromptItem,
    interleave_categories,
    load_prompts,
    split_by_domain,
)
from infra.suffix_seed import seed_summary, use_suffix_seed

log = logging.getLogger(__name__)

DRAFTER_KINDS = ("suffix", "eagle", "standalone", "selfspec", "hybrid")
"""What ``build_drafter`` builds (serving/drafters/factory.py); ``--drafter``'s choices."""


def select_prompts(items: list[PromptItem], limit: int, warm: int) -> dict[str, tuple[list, list]]:
    """Per domain: (evaluation prompts, disjoint warm-up prompts)."""
    out = {}
    for domain, group in split_by_domain(items).items():
        group = interleave_categories(group)
        out[domain] = (group[:limit], group[limit : limit + warm])
    return out


def _figures(spec: RunResult, base: RunResult, timer: StepTimer) -> dict:
    mismatches = sum(a != b for a, b in zip(spec.outputs, base.outputs))
    t = timer.summary()
    return {
        "spec_tok_s": round(spec.tok_s, 3),
        "speedup": round(spec.tok_s / base.tok_s, 4) if base.tok_s else 0.0,
        "mean_accept_len": round(spec.mean_accept_len, 4),
        "acceptance_rate": round(spec.acceptance_rate, 4),
        "lossless": mismatches == 0 and spec.failed == 0,
        "mismatched_outputs": mismatches,
        "draft_ms_per_token": round(t["draft_ms_per_token"], 4),
        "draft_ms_per_step": round(t["draft_ms_per_step"], 4),
        "nodes_per_row_step": round(t["nodes_per_row_step"], 3),
        "tokens_per_verify": round(spec.mean_accept_len, 4),
        "tree_step_fraction": round(t["tree_step_fraction"], 3),
        "verify_ms": round(t["verify_ms"], 3),
        "tokens": spec.tokens,
        "failed": spec.failed,
        "cached_prompt_tokens": {"speculative": spec.cached_prompt_tokens,
                                 "target_only": base.cached_prompt_tokens},
    }


async def _paired(engine, timer: StepTimer, baseline, prompts, domains, max_tokens,
                  spec_first: bool, temperature: float = 0.0) -> tuple[RunResult, RunResult]:
    """Each prompt served by the speculative engine and by the target-only ``baseline`` back to
    back, which first alternating prompt by prompt (ABBA): (speculative totals, baseline totals)."""
    timer.reset()
    spec, base = RunResult(), RunResult()
    for i, (prompt, domain) in enumerate(zip(prompts, domains)):
        sides = [(engine, spec), (baseline, base)]
        for eng, total in sides if (i % 2 == 0) == spec_first else sides[::-1]:
            _add(total, await run_prompts(eng, [prompt], max_tokens, domains=[domain], temperature=temperature))
    return spec, base


def _add(total: RunResult, one: RunResult) -> None:
    total.outputs += one.outputs
    total.wall_s += one.wall_s
    total.tokens += one.tokens
    total.verify_steps += one.verify_steps
    total.drafted += one.drafted
    total.accepted += one.accepted
    total.failed += one.failed
    total.cached_prompt_tokens += one.cached_prompt_tokens


async def _measure(engine, timer: StepTimer, prompts, domains, max_tokens, temperature: float = 0.0) -> RunResult:
    timer.reset()
    return await run_prompts(engine, prompts, max_tokens, domains=domains, temperature=temperature)


async def bench_spec_async(
    items: list[PromptItem],
    *,
    drafter_kind: str = "suffix",
    artifact_dir: str | None = None,
    limit: int = 8,
    warm: int = 16,
    max_tokens: int = 96,
    k: int = 4,
    model: str | None = None,
    threads: int | None = None,
    dtype: str = "bfloat16",
    policy: str = "fixed",
    target=None,
    tree: bool = True,
    batches: tuple[int, ...] = (),
    batch_repeats: int = 4,
    device: str = "cpu",
    cuda_graphs: bool = True,
    suffix_seed: int = 0,
    bf16_activations: bool = False,
    temperature: float = 0.0,
) -> dict:
    """``temperature``: every request's (0: greedy; above: sampled, seeded per prompt, so that
    lossless is still token identity: ``runner.prompt_seed``).
    ``target``: an already loaded Target (tests); else ``model`` is loaded at ``dtype`` on
    ``device``. ``cuda_graphs``, ``bf16_activations``: every engine's EngineConfig's, baseline
    and speculative alike (on CUDA only; on a CPU with a bf16 dot product or AMX only).
    ``suffix_seed``: requests per domain of the suffix seed (infra/suffix_seed.py; 0: none)."""
    from serving.drafters.factory import build_drafter
    from serving.engine.config import EngineConfig
    from serving.engine.goodput_policy import GoodputPolicy
    from serving.engine.torch_engine import TorchEngine
    from serving.target import load_target

    if policy not in ("fixed", "adaptive", "both"):
        raise ValueError(f"policy must be fixed, adaptive or both, got {policy!r}")
    if drafter_kind not in DRAFTER_KINDS:  # before the target loads, not after
        raise ValueError(f"drafter must be one of {', '.join(DRAFTER_KINDS)}, got {drafter_kind!r}")
    if target is None and not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"dtype must be a torch dtype's name (float32, bfloat16), got {dtype!r}")
    policies = ("fixed", "adaptive") if policy == "both" else (policy,)

    if threads:
        torch.set_num_threads(threads)
    if target is None:
        target = load_target(model, dtype=getattr(torch, dtype), device=device)
    seed = use_suffix_seed(target, suffix_seed)  # every suffix drafter built below starts from it
    tok = target.tokenizer
    selection = select_prompts(items, limit, warm)

    def ids(group):
        return [p.token_ids(tok) for p in group]

    base_timer = StepTimer()
    # No prefix cache on either side (module docstring): the baseline serves every evaluation
    # prompt several times, each speculative engine once.
    engine_options = {"cuda_graphs": cuda_graphs, "bf16_activations": bf16_activations}
    baseline = TorchEngine(target, None, EngineConfig(k=0, max_batch_size=1, prefix_cache_tokens=0,
                                                      **engine_options), observers=[base_timer])
    base: dict[str, RunResult] = {}
    base_steps: dict[str, dict] = {}
    # One untimed request per domain first: a process's first forwards pay for allocation, kernel
    # selection and, on a GPU, clocks ramping up; timed, they made the baseline that runs first
    # look slow (an H200 measured chat target-only at 35 tok/s first in a process, 54 later).
    await run_prompts(baseline, [ids(evals[:1])[0] for evals, _ in selection.values() if evals], max_tokens,
                      temperature=temperature)
    for domain, (evals, _) in selection.items():
        log.info("baseline: %s, %d prompts", domain, len(evals))
        base[domain] = await _measure(baseline, base_timer, ids(evals), [domain] * len(evals), max_tokens,
                                      temperature)
        base_steps[domain] = base_timer.summary()

    runs: dict[str, dict] = {}
    paired = 0  # each speculative run's own baseline, served right before or after it (alternately)
    for pol in policies:
        phases = {}
        for phase in ("day0", "warmed") if warm > 0 else ("day0",):
            timer = StepTimer()
            results = {}
            for domain, (evals, warmups) in selection.items():
                # A fresh drafter per domain and phase: day 0 knows nothing, warmed knows only the
                # warm-up prompts of its own domain.
                drafter = _drafter(build_drafter(drafter_kind, target, artifact_dir), tree)
                choose = GoodputPolicy(k) if pol == "adaptive" else None
                engine = TorchEngine(target, drafter, EngineConfig(k=k, max_batch_size=1, prefix_cache_tokens=0,
                                                                   **engine_options),
                                     observers=[timer], policy=choose)
                if phase == "warmed":
                    log.info("%s: warming on %d %s prompts", drafter_kind, len(warmups), domain)
                    await run_prompts(engine, ids(warmups), max_tokens, domains=[domain] * len(warmups),
                                      temperature=temperature)
                log.info("%s %s (%s k): %s, %d prompts", drafter_kind, phase, pol, domain, len(evals))
                paired += 1
                spec, adjacent = await _paired(engine, timer, baseline, ids(evals), [domain] * len(evals),
                                               max_tokens, spec_first=paired % 2 == 1, temperature=temperature)
                results[domain] = _figures(spec, adjacent, timer)
                results[domain]["_run"], results[domain]["_base"] = spec, adjacent
                await engine.stop()
            phases[phase] = results
        runs[pol] = phases
    await baseline.stop()

    def overall(results: dict) -> dict:
        runs = {d: r.pop("_run") for d, r in results.items()}
        bases = [r.pop("_base") for r in results.values()]  # each run's adjacent baseline
        spec_tokens = sum(r.tokens for r in runs.values())
        spec_wall = sum(r.wall_s for r in runs.values())
        base_tokens = sum(b.tokens for b in bases)
        base_wall = sum(b.wall_s for b in bases)
        steps = sum(r.verify_steps for r in runs.values())
        drafted = sum(r.drafted for r in runs.values())
        accepted = sum(r.accepted for r in runs.values())
        spec_tok_s = spec_tokens / spec_wall if spec_wall else 0.0
        base_tok_s = base_tokens / base_wall if base_wall else 0.0
        return {
            "spec_tok_s": round(spec_tok_s, 3),
            "speedup": round(spec_tok_s / base_tok_s, 4) if base_tok_s else 0.0,
            "mean_accept_len": round(spec_tokens / steps, 4) if steps else 0.0,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "lossless": all(r["lossless"] for r in results.values()),
            "by_domain": results,
        }

    by_policy = {pol: {phase: overall(res) for phase, res in phases.items()} for pol, phases in runs.items()}
    summaries = by_policy[policies[0]]
    head = summaries["warmed" if "warmed" in summaries else "day0"]
    base_tokens = sum(b.tokens for b in base.values())
    base_wall = sum(b.wall_s for b in base.values())
    all_base_steps = [s for s in base_steps.values()]
    timers = [v for res in runs[policies[0]].values() for v in res.values()]
    out = {
        "drafter": drafter_kind,
        "k": k,
        "policy": policies[0],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "prompts_per_domain": limit,
        "warm_prompts_per_domain": warm,
        "dtype": dtype,
        "device": str(target.device),
        "cuda_graphs": cuda_graphs and target.device.type == "cuda",
        "bf16_activations": bool(baseline.runner.fast is not None and baseline.runner.fast.rounds),
        "threads": torch.get_num_threads(),
        "baseline_tok_s": round(base_tokens / base_wall, 3) if base_wall else 0.0,
        "target_ms": round(sum(s["verify_ms"] for s in all_base_steps) / max(len(all_base_steps), 1), 3),
        "spec_tok_s": head["spec_tok_s"],
        "speedup": head["speedup"],
        "mean_accept_len": head["mean_accept_len"],
        "acceptance_rate": head["acceptance_rate"],
        "lossless": all(s["lossless"] for by_phase in by_policy.values() for s in by_phase.values()),
        "draft_ms_per_token": _mean([d["draft_ms_per_token"] for d in timers]),
        "verify_ms": _mean([d["verify_ms"] for d in timers]),
        "phase": "warmed" if "warmed" in summaries else "day0",
        "day0": summaries["day0"],
        "warmed": summaries.get("warmed"),
        "baseline_by_domain": {d: {"tok_s": round(b.tok_s, 3), "tokens": b.tokens} for d, b in base.items()},
    }
    out["tree"] = tree
    out["suffix_seed"] = seed_summary(seed)
    if batches:
        out["by_batch"] = await _by_batch(
            target, selection, ids, drafter_kind, artifact_dir, k, max_tokens, tree, batches,
            batch_repeats, warm > 0, engine_options, temperature,
        )
    if len(policies) == 2:
        fixed, adaptive = by_policy["fixed"], by_policy["adaptive"]
        out["adaptive"] = adaptive
        out["adaptive_vs_fixed"] = {
            phase: round(adaptive[phase]["spec_tok_s"] / fixed[phase]["spec_tok_s"], 4)
            if fixed[phase]["spec_tok_s"] else None for phase in fixed}
    return out


def _drafter(drafter, tree: bool):
    if not tree and getattr(drafter, "trees", False):
        drafter.trees = False
    return drafter


def _tail(timer: StepTimer, batch: int) -> float | None:
    """The fraction of ``timer``'s step milliseconds (draft + verify) in steps of fewer than
    ``batch`` rows."""
    ms = [d + v for d, v in zip(timer.draft_ms, timer.verify_ms)]
    total = sum(ms)
    return round(sum(m for m, r in zip(ms, timer.rows) if r < batch) / total, 3) if total else None


async def _by_batch(target, selection, ids, drafter_kind, artifact_dir, k, max_tokens, tree,
                    batches, repeats, warmed, engine_options: dict | None = None,
                    temperature: float = 0.0) -> dict:
    """Never-slower check: target-only vs speculative (adaptive) at each batch size, A/B
    alternating in this process. The drafter is built (and warmed) once per batch size."""
    from serving.drafters.factory import build_drafter
    from serving.engine.config import EngineConfig
    from serving.engine.goodput_policy import GoodputPolicy
    from serving.engine.torch_engine import TorchEngine

    evals = [p for group, _ in selection.values() for p in group]
    warmups = [p for _, group in selection.values() for p in group] if warmed else []
    out = {}
    for b in batches:
        base_timer, timer = StepTimer(), StepTimer()
        base_engine = TorchEngine(target, None, EngineConfig(k=0, max_batch_size=b, **(engine_options or {})),
                                  observers=[base_timer])
        drafter = _drafter(build_drafter(drafter_kind, target, artifact_dir), tree)
        policy = GoodputPolicy(k)
        spec_engine = TorchEngine(target, drafter, EngineConfig(k=k, max_batch_size=b, **(engine_options or {})),
                                  observers=[timer], policy=policy)
        if warmups:
            await run_prompts(spec_engine, ids(warmups), max_tokens, concurrency=b, temperature=temperature)
        base_s = spec_s = 0.0
        base_tokens = spec_tokens = 0
        cached = {"target_only": 0, "speculative": 0}
        paired: tuple[list, list] = ([], [])  # each round's (speculative, target-only) RunResult
        lossless = True
        timer.reset()
        base_timer.reset()
        for rep in range(repeats):
            log.info("batch %d: target-only / speculative, %d prompts", b, len(evals))
            # train=False: the drafter does not index what it measures, so every repeat measures
            # the same warmed state (else repeat 2 drafts from repeat 1's identical outputs).
            # ABBA order: this VM has slow periods of seconds (plain steps 5-9 % slower), and a
            # drift within a round then weighs on both engines alike.
            first, second = (base_engine, spec_engine) if rep % 2 == 0 else (spec_engine, base_engine)
            base_timer.new_segment()  # each engine runs once a round: the gap before its first
            timer.new_segment()  # step this round (the other engine's run) is not that step's
            ra = await run_prompts(first, ids(evals), max_tokens, concurrency=b, train=False, temperature=temperature)
            rb = await run_prompts(second, ids(evals), max_tokens, concurrency=b, train=False, temperature=temperature)
            r0, r1 = (ra, rb) if first is base_engine else (rb, ra)
            base_s, base_tokens = base_s + r0.wall_s, base_tokens + r0.tokens
            spec_s, spec_tokens = spec_s + r1.wall_s, spec_tokens + r1.tokens
            cached["target_only"] += r0.cached_prompt_tokens
            cached["speculative"] += r1.cached_prompt_tokens
            if r0.wall_s and r1.wall_s and r0.tokens:
                paired[0].append(r1)
                paired[1].append(r0)
            lossless &= r0.outputs == r1.outputs and r1.failed == 0
        await base_engine.stop()
        await spec_engine.stop()
        t = timer.summary()
        speedup = (spec_tokens / spec_s) / (base_tokens / base_s) if spec_s and base_s else 0.0
        widths = policy.widths
        plain_base, plain_spec = base_timer.plain_step_ms(b), timer.plain_step_ms(b)
        # the same ratio at equal machine speed: each engine's wall time scaled by its own plain
        # step (identical work in both), which this VM moves by up to ~7 % between the engines'
        # rounds even in ABBA order (ARCHITECTURE.md, "Never slower at batch 8")
        corrected = speedup * plain_spec / plain_base if plain_base and plain_spec else None
        full_base, full_spec = base_timer.full_batch_rate(b), timer.full_batch_rate(b)
        full = full_spec[0] / full_base[0] if full_base and full_spec else None
        rounds = [a.tok_s / b.tok_s for a, b in zip(*paired)]  # adjacent runs' speculative / target-only
        median_round = statistics.median(rounds) if rounds else None
        out[str(b)] = {
            "speedup": round(speedup, 4),
            "never_slower": speedup >= 0.97,
            # [low, high] 95 % bootstrap over the rounds: this VM moves single rounds of the same
            # work by +-5-8 %, and 0.96 vs 0.98 from one run to the next is within it
            "speedup_interval": paired_speedup_interval(*paired),
            # the same comparison round by round: each round's two runs are seconds apart, and the
            # median is not moved by one round that a slow spell of this VM fell on (the pooled
            # ratio above weighs that round by its length: at batch 8, where the policy keeps
            # speculation off, rounds of the same work read 0.96-1.26 in one run)
            "round_speedups": [round(r, 3) for r in rounds],
            "speedup_median_round": _round(median_round, 4),
            "never_slower_median_round": None if median_round is None else median_round >= 0.97,
            "speedup_at_equal_plain_step": _round(corrected, 4),
            "never_slower_at_equal_plain_step": None if corrected is None else corrected >= 0.97,
            # the same ratio over the steps that ran all b rows (``StepTimer.full_batch_rate``):
            # serving at batch b, without the tail of this finite prompt list (below)
            "speedup_at_full_batch": _round(full, 4),
            "never_slower_at_full_batch": None if full is None else full >= 0.97,
            "lossless": lossless,
            "tokens_per_row_step": round(spec_tokens / max(sum(timer.rows), 1), 4),
            "nodes_per_row_step": round(t["nodes_per_row_step"], 3),
            "plain_step_fraction": round(sum(w == 0 for w in widths) / len(widths), 3) if widths else None,
            "calibration": round(policy.calibration.value, 3),
            # diagnostic: the plain step in each engine, the same work, so a gap between them is
            # the machine's drift between the two engines' rounds, not speculation
            "plain_step_ms": {"target_only": _round(plain_base), "speculative": _round(plain_spec)},
            "probes": policy.probes,
            "cuts": dict(policy.cuts),
            # diagnostic: the share of each engine's step time spent with fewer than b rows. This
            # set of prompts is finite: target-only rows advance in lockstep and leave together,
            # speculative rows leave one by one, and the last ones run at a small batch.
            "tail_time_fraction": {"target_only": _tail(base_timer, b), "speculative": _tail(timer, b)},
            # both engines keep a prefix cache here and serve the same prompts every round, so
            # after the first round both copy most prompts in (equal when the drafter is not
            # warmed; a warmed engine's cache also holds the warm-up prompts)
            "cached_prompt_tokens": cached,
            "full_batch_s": {"target_only": _round(full_base and full_base[1]),
                             "speculative": _round(full_spec and full_spec[1])},
            # diagnostic: seconds outside the steps (admissions and their prefills, mostly): the
            # same work in both engines, and at batch 8 more than half of this benchmark's time
            "between_steps_s": {"target_only": _round(base_timer.between_steps_s()),
                                "speculative": _round(timer.between_steps_s())},
        }
    return out


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def _mean(xs: list[float]) -> float:
    return round(sum(xs) / len(xs), 4) if xs else 0.0


def run(prompts: str | None, limit: int, max_tokens: int, k: int, drafter: str, warm: int,
        artifact: str | None, threads: int | None, dtype: str, domains: list[str] | None,
        policy: str = "fixed", tree: bool = True, batches: tuple[int, ...] = (),
        batch_repeats: int = 4, device: str = "cpu", cuda_graphs: bool = True, suffix_seed: int = 0,
        bf16_activations: bool = False, temperature: float = 0.0) -> dict:
    items = load_prompts(prompts)
    if domains:
        items = [p for p in items if (p.domain or "default") in domains]
        if not items:
            raise ValueError(f"no prompts in domains {domains}")
    t0 = time.perf_counter()
    out = asyncio.run(bench_spec_async(
        items, drafter_kind=drafter, artifact_dir=artifact, limit=limit, warm=warm,
        max_tokens=max_tokens, k=k, threads=threads, dtype=dtype, policy=policy, tree=tree,
        batches=batches, batch_repeats=batch_repeats, device=device, cuda_graphs=cuda_graphs,
        suffix_seed=suffix_seed, bf16_activations=bf16_activations, temperature=temperature,
    ))
    out["bench_wall_s"] = round(time.perf_counter() - t0, 1)
    return out
