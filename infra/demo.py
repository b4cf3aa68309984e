"""``specloop demo`` (``make demo``): the whole closed loop on CPU, live, in one command.

Starts the local stack (tansu, Redis, MLflow; stopped at the end, also on Ctrl-C), then serves a
domain-shift stream (MT-Bench chat, then HumanEval code) through TorchEngine + a day-0 hybrid drafter
(suffix + learned), traces to Kafka, the trainer (a Ray actor process, see infra/loop.py)
registering in MLflow, and the Swapper. A sample of the requests spread over the stream is also
served target-only, each right beside the loop's (infra/paired_serving.py): the speedups compare
the two on those requests. Prints a summary table, writes a plot and the summary JSON under the
run directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path

import typer

from infra.artifact_options import DAY0_OPTION, check_target, day0_artifact_meta
from infra.suffix_seed import (
    current_seed,
    load_model_option,
    model_option,
    seed_option,
    seed_summary,
    use_suffix_seed,
)

log = logging.getLogger(__name__)


MARKER_COLOURS = {"swap": "tab:blue", "rollback": "tab:red", "drift": "tab:orange"}


def markers(events: list[dict]) -> list[tuple[float, str, str]]:
    """(x, colour, label) of each swap, rollback and acceptance drift among the loop's events
    (``event`` names the kind; kept/refused decisions change nothing live and are not drawn)."""
    out = []
    for e in events:
        kind = e.get("event")
        if kind in MARKER_COLOURS:
            what = e.get("domain") if kind == "drift" else (e.get("version") or e.get("to_version") or "")
            out.append((e["request_index"] + 0.5, MARKER_COLOURS[kind], f"{kind} {what}".strip()))
    return out


def plot(points, events, shift: int, path: Path, baseline_tok_s: float | None = None) -> Path:
    """Acceptance (tokens per verify step) and tokens/s per request; swaps, rollbacks, drifts and
    the shift as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p.index for p in points]
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    ax1.plot(xs, [p.accept_len for p in points], marker=".", label="tokens / verify step")
    ax2.plot(xs, [p.tok_s for p in points], marker=".", color="tab:green", label="tokens/s")
    if baseline_tok_s:
        ax2.axhline(baseline_tok_s, color="grey", ls=":", label="target only")
    for ax in (ax1, ax2):
        ax.axvline(shift - 0.5, color="black", ls="--", label="domain shift")
        for x, color, label in markers(events):
            ax.axvline(x, color=color, alpha=0.6, label=label)
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper left")
    ax1.set_ylabel("tokens / verify")
    ax2.set_ylabel("tokens/s")
    ax2.set_xlabel("request")
    fig.suptitle("specloop demo: online drafter adaptation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class Progress:
    """The live display: one rich table, refreshed after each request."""

    def __init__(self, total: int, baseline_tok_s, loop):
        """``baseline_tok_s()``: target-only tok/s so far (0: none yet)."""
        from rich.live import Live

        self.total, self.baseline, self.loop = total, baseline_tok_s, loop
        self.live = Live(self.render(), refresh_per_second=2)

    def render(self):
        from rich.table import Table

        pts = self.loop.points
        recent = pts[-5:]
        tok_s = sum(p.tokens for p in recent) / max(1e-9, sum(p.wall_s for p in recent)) if recent else 0.0
        accept = sum(p.accept_len for p in recent) / len(recent) if recent else 0.0
        t = Table(title="specloop demo (last 5 requests)", show_header=False)
        trainer = self.loop.trainer
        rows = [
            ("requests", f"{len(pts)}/{self.total}" + (f"  ({pts[-1].domain})" if pts else "")),
            ("tokens / verify step", f"{accept:.2f}"),
            ("tokens/s", f"{tok_s:.1f}"),
            ("speedup vs target-only", f"{tok_s / base:.2f}x" if (base := self.baseline()) else "-"),
            ("drafter version", str(getattr(self.loop.engine.drafter, "version", "-"))),
            ("swaps / rollbacks", f"{self.loop.swaps} / {self.loop.rollbacks}"),
            ("acceptance drifts", _drift_row(self.loop.drifts)),
            ("trainer", _trainer_row(trainer.stats) if trainer else "-"),
            ("last gate", (trainer.stats.last_decision or "-") if trainer else "-"),
        ]
        for k, v in rows:
            t.add_row(k, v)
        return t

    def update(self, _point=None) -> None:
        self.live.update(self.render())


def _drift_row(drifts: list[dict]) -> str:
    if not drifts:
        return "0"
    last = drifts[-1]
    return f"{len(drifts)} (last: {last['domain']} {last['before']:.2f} -> {last['now']:.2f})"


def _trainer_row(st) -> str:
    row = f"rounds {st.rounds}, steps {st.train_steps}, promotions {st.promotions}"
    if st.heldout_acceptance is not None:
        row += f", held-out acceptance {st.heldout_acceptance:.3f}"
    return row


def summary_table(summary: dict):
    from rich.table import Table

    t = Table(title="specloop demo summary")
    t.add_column("figure")
    t.add_column("value", justify="right")
    for k, v in summary.items():
        t.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    return t


def baseline_sample(total: int, n: int) -> list[int]:
    """``n`` request indices spread evenly over a stream of ``total`` (both sides of the shift):
    per-token speed depends on the prompt (its prefill, its context), so a baseline of the first
    few requests would compare the whole stream against a few short chat prompts."""
    n = max(1, min(n, total))
    return sorted({(2 * i + 1) * total // (2 * n) for i in range(n)})


def matched_pairs(points, base: dict, indices: list[int]) -> tuple[list, list]:
    """The loop's points and the target-only ones of ``indices`` that the loop served without
    failing, in the same order."""
    kept = [i for i in indices if i < len(points) and not points[i].failed]
    return [points[i] for i in kept], [base[i] for i in kept]


def matched_speedup(points, base: dict, indices: list[int]) -> float | None:
    """tok/s of the loop on ``indices`` over target-only tok/s on the same requests."""
    from infra.loop_metrics import tok_s

    ours, theirs = matched_pairs(points, base, indices)
    if not ours or not tok_s(theirs):
        return None
    return tok_s(ours) / tok_s(theirs)


async def run_demo(target, stack_info, stream, cfg, run_dir: Path, baseline_n: int, console) -> dict:
    from infra.loop import OnlineLoop
    from infra.loop_metrics import (
        paired_speedup_interval,
        served_bf16_activations,
        shift_index,
        summarise,
        tok_s,
        trainer_figures,
    )
    from infra.paired_serving import serve_paired, target_only_loop

    sampled = baseline_sample(len(stream), baseline_n)
    console.print(f"target-only baseline: {len(sampled)} requests spread over the stream, each served "
                  "right beside the loop's")
    shift = shift_index([d for _, d in stream])
    base_loop = await target_only_loop(target, stream, cfg.max_tokens)
    loop = OnlineLoop(target, stack_info, cfg, run_dir)
    try:
        await loop.start()
        progress = Progress(len(stream), lambda: tok_s(base_loop.points), loop)
        with progress.live:
            await serve_paired(loop, stream, 0, progress.update, [base_loop], twin=set(sampled).__contains__)
    finally:
        await loop.stop()
        await base_loop.stop()
    base = {i: p for i, p in zip(sampled, base_loop.points)}
    base_tok_s = tok_s(base_loop.points)
    summary = summarise(loop.points, shift, swaps=loop.swaps, rollbacks=loop.rollbacks,
                        freshness=loop.freshness(), drifts=loop.drifts)

    def matched(keep) -> float | None:
        return matched_speedup(loop.points, base, [i for i in sampled if keep(i)])

    def interval(keep) -> list[float] | None:
        return paired_speedup_interval(*matched_pairs(loop.points, base, [i for i in sampled if keep(i)]))

    summary.update({
        "target_only_tok_s": base_tok_s,
        "baseline_requests": len(sampled),
        "baseline_paired": True,
        "speedup_overall": matched(lambda i: True),
        "speedup_before_shift": matched(lambda i: i < shift),
        "speedup_after_shift": matched(lambda i: i >= shift),
        "speedup_overall_ci95": interval(lambda i: True),
        "final_drafter_version": str(getattr(loop.engine.drafter, "version", "-")),
        "suffix_seed": seed_summary(current_seed()),
        "bf16_activations": served_bf16_activations(loop.settings),
        **trainer_figures(loop),
    })
    summary["plot"] = str(plot(loop.points, loop.events, shift, run_dir / "demo.png", base_tok_s))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (run_dir / "events.json").write_text(json.dumps(loop.events, indent=2, default=str))
    points = [{k: v for k, v in dataclasses.asdict(p).items() if k != "output"} for p in loop.points]
    (run_dir / "points.json").write_text(json.dumps(points, indent=1))  # per request, as plotted
    return summary


RUN_FILES = ("summary.json", "events.json", "points.json", "demo.png")
"""What a run writes at its end (``run_demo``); summary.json marks a finished run."""


def check_run_dir(run_dir: Path, overwrite: bool) -> None:
    """Refuse (a usage error) a ``--run-dir`` that holds an earlier run's results, which this run
    would overwrite; with ``overwrite``, remove them first, so that the directory never mixes
    two runs' files. Other files there are left alone."""
    if not (run_dir / RUN_FILES[0]).is_file():
        return
    if not overwrite:
        raise typer.BadParameter(f"{run_dir} holds an earlier run ({RUN_FILES[0]}): give a new directory, "
                                 "or --overwrite to replace its results", param_hint="'--run-dir'")
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)


def demo(
    chat: int = typer.Option(40, min=1, help="MT-Bench chat requests before the domain shift."),
    code: int = typer.Option(40, min=1, help="HumanEval code requests after it."),
    max_tokens: int = typer.Option(64, min=1, help="New tokens per request."),
    k: int = typer.Option(4, min=1, help="Most drafted tokens per step."),
    adaptive_k: bool = typer.Option(True, help="Choose k per step (0 = off) by expected goodput from "
                                    "live acceptance and measured costs; --no-adaptive-k: fixed k."),
    baseline: int = typer.Option(16, min=1, help="Requests in the target-only baseline, spread over "
                                 "the stream, each served right beside the loop's; the speedups compare the loop with it on "
                                 "the same requests."),
    run_dir: Path = typer.Option(None, help="Where the plot, summary and stack data go "
                                 "(default: ./specloop-demo/<timestamp>); one holding an earlier run's "
                                 "summary is refused unless --overwrite."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the results of an earlier run "
                                   "in --run-dir (they are removed before this one starts)."),
    threads: int = typer.Option(1, min=1, help="torch threads per thread of work: serving and the trainer each run on this many cores (1 on a 2-core box: the CPU stand-in for the serving GPU and the trainer GPU); the target-only baseline runs with the same."),
    learned: str = typer.Option("target-layers", help="Learned drafter the trainer adapts: target-layers "
                                "(standalone LM copying the target's first layers) | selfspec (the target's own "
                                "first layers + a trained adapter)."),
    day0_artifact: Path = typer.Option(None, exists=True, file_okay=False,
                                       help="Start the learned drafter from this selfspec artifact (e.g. "
                                       "pre-trained with `specloop train --corpus`): the hybrid drafts with it "
                                       "from the first request and the trainer refines it."),
    suffix_seed: int = seed_option(),
    model: str | None = model_option(),
) -> None:
    """Run the closed loop live: serve -> trace -> train -> register -> swap, on a domain shift."""
    if learned not in ("target-layers", "selfspec"):
        raise typer.BadParameter(f"{learned!r}: choose target-layers or selfspec", param_hint="--learned")
    day0 = day0_artifact_meta(day0_artifact)  # before the model loads and the stack starts
    if run_dir is not None:
        check_run_dir(run_dir, overwrite)
    import torch
    from rich.console import Console

    from infra.loop import LoopConfig
    from infra.prompts import encode, stream_items
    from infra.root import build_stack, load_settings

    logging.basicConfig(level=logging.WARNING)
    console = Console()
    target = load_model_option(model)  # before the run directory: a bad setting or --model is one line
    run_dir = (run_dir or Path("specloop-demo") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"run directory: {run_dir}")
    torch.set_num_threads(threads)
    stack = None
    try:
        if day0 is not None:  # built for this target? (checked again when the drafter is built)
            check_target(day0, day0_artifact, DAY0_OPTION, target.fingerprint)
        seed = use_suffix_seed(target, suffix_seed)  # serving's suffix index and the trainer's gate
        if seed is not None:
            console.print(f"suffix seed: {seed}")
        stack = build_stack(load_settings(), run_dir / "stack")
        info = stack.up()
        console.print(f"stack up: kafka {info.bootstrap_servers}, {info.redis_url}, mlflow {info.mlflow_uri}")
        stream = encode(stream_items(None, chat, code), target.tokenizer)
        cfg = LoopConfig(k=k, max_tokens=max_tokens, adaptive_k=adaptive_k, day0_init=learned,
                         day0_artifact=str(day0_artifact) if day0_artifact else None)
        summary = asyncio.run(run_demo(target, info, stream, cfg, run_dir, baseline, console))
    except KeyboardInterrupt:
        console.print("interrupted" + (": stopping the stack" if stack is not None else ""))
        raise typer.Exit(130)
    finally:
        if stack is not None:
            stack.down()
    console.print(summary_table(summary))
    db = run_dir / "stack" / "mlflow" / "mlflow.db"
    console.print(f"plot: {summary['plot']}\nsummary: {run_dir / 'summary.json'}")
    console.print(operators_view(db, target.fingerprint))


def operators_view(db: Path, fingerprint, port: int = 5000) -> str:
    """How to reopen the run's MLflow store, and the URL of its experiment (the operators' view:
    serving and trainer ops runs, candidate runs, the registered model)."""
    name = f"specloop/{fingerprint.key()}"
    url = f"http://127.0.0.1:{port}/"
    try:
        from mlflow.tracking import MlflowClient

        exp = MlflowClient(tracking_uri=f"sqlite:///{db}").get_experiment_by_name(name)
        if exp is not None:
            url += f"#/experiments/{exp.experiment_id}"
    except Exception:  # the store is still readable with the command below
        logging.getLogger(__name__).debug("could not read %s", db, exc_info=True)
    return (f"MLflow (operators' view): experiment '{name}': serving-* run (live acceptance and tokens "
            "per verify per domain, k, speculation-off fraction, estimated speedup, drafter changes, "
            "drift), trainer-* run (held-out acceptance per round, every gate decision and its "
            "reason), candidate runs and the registered model. Open it with\n"
            f"  .venv/bin/mlflow ui --backend-store-uri sqlite:///{db} --port {port}\n"
            f"then {url}")
