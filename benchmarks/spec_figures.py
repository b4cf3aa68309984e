"""What ``specloop bench spec`` reports for its phases (benchmarks/bench_spec.py): each domain's
speculative run against its adjacent target-only run, and each phase pooled over the domains."""

from __future__ import annotations

from benchmarks.runner import RunResult, StepTimer


def run_figures(spec: RunResult, base: RunResult, timer: StepTimer) -> dict:
    """One domain's speculative run ``spec`` against the target-only run ``base`` beside it."""
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


def phase_figures(results: dict) -> dict:
    """A phase's figures pooled over its domains. ``results``: domain -> ``run_figures`` with the
    domain's two RunResults under ``_run`` and ``_base``, which are taken out here."""
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


def rounded(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def mean(xs: list[float]) -> float:
    return round(sum(xs) / len(xs), 4) if xs else 0.0
