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

This module runs the phases; benchmarks/spec_figures.py computes what they report,
benchmarks/spec_batches.py runs the batch sizes, and infra/artifact_options.py checks
``--artifact`` before the target loads.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from benchmarks.runner import RunResult, StepTimer, run_prompts
from benchmarks.spec_batches import by_batch
from benchmarks.spec_figures import mean, phase_figures, run_figures
from infra.artifact_options import LEARNED_KINDS, artifact_meta, check_target, refuse
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


def check_artifact(artifact_dir: str | None, drafter_kind: str):
    """``--artifact``, before the target loads: a drafter artifact of the kind ``drafter_kind``
    serves (hybrid: any learned kind, for its learned half; suffix: none). Its config.json, or None."""
    if artifact_dir is None:
        return None
    if drafter_kind == "suffix":
        refuse("--artifact", "the suffix drafter starts from no artifact (its index learns from what it "
                             "serves): give --drafter eagle, standalone, selfspec or hybrid with it")
    kinds = LEARNED_KINDS if drafter_kind == "hybrid" else (drafter_kind,)
    serves = ("an eagle, standalone or selfspec one" if drafter_kind == "hybrid"
              else f"{'an' if drafter_kind == 'eagle' else 'a'} {drafter_kind} one")
    return artifact_meta(artifact_dir, "--artifact", kinds, f"--drafter {drafter_kind} serves {serves}")


def select_prompts(items: list[PromptItem], limit: int, warm: int) -> dict[str, tuple[list, list]]:
    """Per domain: (evaluation prompts, disjoint warm-up prompts)."""
    out = {}
    for domain, group in split_by_domain(items).items():
        group = interleave_categories(group)
        out[domain] = (group[:limit], group[limit : limit + warm])
    return out


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
    artifact_config = check_artifact(artifact_dir, drafter_kind)
    policies = ("fixed", "adaptive") if policy == "both" else (policy,)

    if threads:
        torch.set_num_threads(threads)
    if target is None:
        target = load_target(model, dtype=getattr(torch, dtype), device=device)
    if artifact_config is not None:  # before the seed and the baseline's minutes, not at the first drafter
        check_target(artifact_config, artifact_dir, "--artifact", target.fingerprint)
    seed = use_suffix_seed(target, suffix_seed)  # every suffix drafter built below starts from it
    tok = target.tokenizer
    selection = select_prompts(items, limit, warm)

    def ids(group):
        return [p.token_ids(tok) for p in group]

    def new_drafter():
        """A fresh drafter of the kind measured; chains only with ``tree`` off."""
        drafter = build_drafter(drafter_kind, target, artifact_dir)
        if not tree and getattr(drafter, "trees", False):
            drafter.trees = False
        return drafter

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
                drafter = new_drafter()
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
                results[domain] = run_figures(spec, adjacent, timer)
                results[domain]["_run"], results[domain]["_base"] = spec, adjacent
                await engine.stop()
            phases[phase] = results
        runs[pol] = phases
    await baseline.stop()

    by_policy = {pol: {phase: phase_figures(res) for phase, res in phases.items()} for pol, phases in runs.items()}
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
        "draft_ms_per_token": mean([d["draft_ms_per_token"] for d in timers]),
        "verify_ms": mean([d["verify_ms"] for d in timers]),
        "phase": "warmed" if "warmed" in summaries else "day0",
        "day0": summaries["day0"],
        "warmed": summaries.get("warmed"),
        "baseline_by_domain": {d: {"tok_s": round(b.tok_s, 3), "tokens": b.tokens} for d, b in base.items()},
    }
    out["tree"] = tree
    out["suffix_seed"] = seed_summary(seed)
    if batches:
        out["by_batch"] = await by_batch(
            target, selection, ids, new_drafter, k, max_tokens, batches, batch_repeats, warm > 0,
            engine_options, temperature,
        )
    if len(policies) == 2:
        fixed, adaptive = by_policy["fixed"], by_policy["adaptive"]
        out["adaptive"] = adaptive
        out["adaptive_vs_fixed"] = {
            phase: round(adaptive[phase]["spec_tok_s"] / fixed[phase]["spec_tok_s"], 4)
            if fixed[phase]["spec_tok_s"] else None for phase in fixed}
    return out


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
