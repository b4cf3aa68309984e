"""The demo's closed loop end to end on the real local stack (tansu, Redis, MLflow) with a tiny
target: traces reach the trainer through Kafka, acceptance after the loop beats acceptance before,
and the run produces its summary and plot."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from infra.loop import LoopConfig, OnlineLoop
from infra.loop_metrics import mean_accept, shift_index, summarise, trainer_figures

pytestmark = pytest.mark.integration
VOCAB = 512


def _walk_target():
    """A tiny target whose greedy next token is a fixed random function of the last token, with
    confident probabilities: its outputs walk a random functional graph, a pattern a student can
    learn from a few traces. (A randomly initialised model with tied embeddings mostly repeats its
    last token, which an untrained student of the same kind already predicts.)"""
    from serving.target import tiny_target

    target = tiny_target(vocab_size=VOCAB, num_layers=2, seed=5)
    m = target.model
    with torch.no_grad():
        for layer in m.model.layers:  # layers add nothing: the last hidden state is the token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.nn.Linear(m.config.hidden_size, VOCAB, bias=False)
        head.weight.copy_(torch.randn(VOCAB, m.config.hidden_size, generator=torch.Generator().manual_seed(1)) * 3)
    m.lm_head = head  # untied
    m.config.tie_word_embeddings = False
    return target


def _stream(n_per_domain: int = 8) -> list[tuple[list[int], str]]:
    g = torch.Generator().manual_seed(3)
    chat = [(torch.randint(0, VOCAB // 2, (6,), generator=g).tolist(), "chat") for _ in range(n_per_domain)]
    code = [(torch.randint(VOCAB // 2, VOCAB, (6,), generator=g).tolist(), "code") for _ in range(n_per_domain)]
    return chat + code


async def _loop_run(target, stack, stream):
    # The learned drafter alone, from a random init: the tiny target's outputs are so repetitive
    # that a suffix drafter (or its own first layers) would accept nearly everything by itself and
    # leave nothing for training to show.
    cfg = LoopConfig(drafter="standalone", k=4, max_tokens=24, min_train_traces=4, steps_per_round=60,
                     rounds_per_gate=1, swap_watch_steps=8, gate_costs={"draft_cost": 0.0, "verify_cost": 1.0},
                     draft_vocab_size=None, day0_init="random")
    loop = OnlineLoop(target, stack, cfg)
    await loop.start()
    try:
        first = await loop.serve(stream)
        deadline = time.monotonic() + 90  # let the trainer see the traces and swap (not an assertion)
        while (loop.trainer.stats.records_polled < len(stream) or loop.swaps == 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        second = await loop.serve(stream, train=False)
    finally:
        await loop.stop()
    return loop, first, second


def test_closed_loop_raises_acceptance_and_reports(kafka_broker, redis_server, mlflow_server, tmp_path):
    from infra.demo import MARKER_COLOURS, markers, plot, summary_table

    torch.set_num_threads(1)
    target = _walk_target()
    stack = SimpleNamespace(bootstrap_servers=kafka_broker.url, redis_url=redis_server.url,
                            mlflow_uri=mlflow_server.url)
    stream = _stream()
    loop, first, second = asyncio.run(_loop_run(target, stack, stream))

    assert not any(p.failed for p in loop.points)
    assert loop.trainer.stats.records_polled >= len(stream)  # every trace went through Kafka
    assert loop.trainer.stats.promotions >= 1 and loop.swaps >= 1  # the loop closed: trained -> live
    assert loop.engine.drafter.version != "day0"
    figures = trainer_figures(loop)  # read back from the trainer's Ray actor
    assert figures["trainer_promotions"] == loop.trainer.stats.promotions
    assert 0.0 < figures["trainer_heldout_expected_acceptance"] <= 1.0
    assert mean_accept(second) > mean_accept(first)
    # Lossless across the loop (greedy): the same prompts give the same outputs.
    assert [p.output for p in second] == [p.output for p in first]

    fresh = loop.freshness_s()  # request done -> a drafter trained on its trace is live
    assert fresh and all(0 < f < 300 for f in fresh)
    shift = shift_index([d for _, d in stream])
    summary = summarise(first, shift, swaps=loop.swaps, rollbacks=loop.rollbacks, freshness=loop.freshness(),
                        drifts=loop.drifts)
    assert summary["shift_at"] == 8 and summary["failed_requests"] == 0
    drawn = markers(loop.events)  # the plot marks every swap, rollback and drift, and nothing else
    assert len(drawn) == loop.swaps + loop.rollbacks + len(loop.drifts)
    assert summary["acceptance_drifts"] == len(loop.drifts)
    assert sum(colour == MARKER_COLOURS["swap"] for _, colour, _ in drawn) == loop.swaps
    png = plot(loop.points, loop.events, shift, tmp_path / "demo.png")
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    assert summary_table(summary).row_count == len(summary)
    _assert_operators_view(mlflow_server.url, target.fingerprint)


def _assert_operators_view(uri, fingerprint, timeout_s: float = 20.0):
    """MLflow shows what serving and the trainer did, not only promoted versions (issue 15)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(f"specloop/{fingerprint.key()}")
    assert exp is not None
    deadline = time.monotonic() + timeout_s
    while True:
        runs = {r.data.tags.get("role"): r for r in client.search_runs([exp.experiment_id])
                if r.data.tags.get("role")}
        trainer = runs.get("trainer")
        if trainer is not None and "event.gate" in trainer.data.metrics or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    serving = runs["serving"].data
    assert {"tokens_per_verify", "k_mean", "spec_off_fraction", "event.drafter_change"} <= set(serving.metrics)
    assert any(k.startswith("tokens_per_verify.") for k in serving.metrics)  # per domain
    assert int(serving.metrics["event.drafter_change"]) >= 2  # day 0, then the promoted version
    assert runs["serving"].info.status == runs["trainer"].info.status == "FINISHED"  # both closed at stop
    trainer = runs["trainer"].data
    assert {"heldout_expected_acceptance", "event.gate", "gate_promote"} <= set(trainer.metrics)
    assert "reason" in trainer.tags["last_gate"]


def test_frozen_drafter_stops_learning():
    from serving.target import tiny_target

    target = tiny_target()
    stream = _stream(4)

    async def run():
        loop = OnlineLoop(target, None, LoopConfig(drafter="suffix", train=False, max_tokens=16))
        await loop.start()
        try:
            await loop.serve(stream[:4])
            loop.snapshot()
            await loop.serve(stream[4:])
        finally:
            await loop.stop()
        frozen = OnlineLoop(target, None, LoopConfig(drafter="suffix", train=False, max_tokens=16),
                            tag=loop.tag, drafter=loop.frozen_drafter())
        await frozen.start()
        try:
            once = await frozen.serve(stream[4:], train=False)
            twice = await frozen.serve(stream[4:], train=False)
        finally:
            await frozen.stop()
        return once, twice

    once, twice = asyncio.run(run())
    # A learning index would accept more the second time round on the same prompts.
    assert mean_accept(twice) == pytest.approx(mean_accept(once))


def test_run_demo_writes_its_summary_plot_and_per_request_points(kafka_broker, redis_server, mlflow_server,
                                                                 tmp_path):
    """What ``specloop demo`` leaves in its run directory, on the real stack with a tiny target."""
    import io
    import json

    from rich.console import Console

    from infra.demo import run_demo

    torch.set_num_threads(1)
    stack = SimpleNamespace(bootstrap_servers=kafka_broker.url, redis_url=redis_server.url,
                            mlflow_uri=mlflow_server.url)
    cfg = LoopConfig(drafter="standalone", k=4, max_tokens=12, min_train_traces=4, steps_per_round=5,
                     rounds_per_gate=1, gate_costs={"draft_cost": 0.0, "verify_cost": 1.0},
                     draft_vocab_size=None, day0_init="random")
    stream = _stream(4)
    summary = asyncio.run(run_demo(_walk_target(), stack, stream, cfg, tmp_path, 2, Console(file=io.StringIO())))
    assert summary["requests"] == len(stream) and summary["failed_requests"] == 0
    assert summary["target_only_tok_s"] > 0 and summary["trainer_records_polled"] <= len(stream)
    assert summary["baseline_paired"] and summary["baseline_requests"] == 2
    assert summary["speedup_before_shift"] > 0 and summary["speedup_after_shift"] > 0  # one each side
    low, high = summary["speedup_overall_ci95"]  # over the two paired requests
    assert low <= summary["speedup_overall"] <= high
    points = json.loads((tmp_path / "points.json").read_text())
    assert [p["index"] for p in points] == list(range(len(stream)))
    assert [p["domain"] for p in points] == [d for _, d in stream]
    assert json.loads((tmp_path / "summary.json").read_text())["requests"] == len(stream)
    assert isinstance(json.loads((tmp_path / "events.json").read_text()), list)
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_and_table_show_swaps_rollbacks_and_drifts(tmp_path):
    from infra.demo import MARKER_COLOURS, _drift_row, markers, plot
    from infra.loop import Point
    from infra.loop_metrics import summarise

    events = [{"event": "swap", "version": "3", "request_index": 4},
              {"event": "kept", "version": "4", "request_index": 5},  # changes nothing live: not drawn
              {"event": "drift", "domain": "code", "before": 0.61, "now": 0.22, "request_index": 9},
              {"event": "rollback", "to_version": "3", "request_index": 11}]
    drawn = markers(events)
    assert [(x, c, label) for x, c, label in drawn] == [
        (4.5, MARKER_COLOURS["swap"], "swap 3"), (9.5, MARKER_COLOURS["drift"], "drift code"),
        (11.5, MARKER_COLOURS["rollback"], "rollback 3")]
    drifts = [e for e in events if e["event"] == "drift"]
    assert _drift_row(drifts) == "1 (last: code 0.61 -> 0.22)" and _drift_row([]) == "0"
    points = [Point(i, "chat" if i < 6 else "code", 10, 1.0, 1.5, "v") for i in range(12)]
    summary = summarise(points, 6, swaps=1, rollbacks=1, drifts=drifts)
    assert summary["acceptance_drifts"] == 1 and summary["drift_domains"] == "code"
    png = plot(points, events, 6, tmp_path / "demo.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_demo_baseline_spreads_over_the_stream_and_speedups_match_requests():
    from types import SimpleNamespace

    from infra.demo import baseline_sample, matched_speedup

    assert baseline_sample(80, 16) == [2, 7, 12, 17, 22, 27, 32, 37, 42, 47, 52, 57, 62, 67, 72, 77]
    assert baseline_sample(5, 16) == [0, 1, 2, 3, 4]
    point = lambda tokens, wall, failed=False: SimpleNamespace(tokens=tokens, wall_s=wall, failed=failed)
    loop = [point(10, 1.0), point(10, 0.5), point(10, 2.0, failed=True)]
    base = {0: point(10, 2.0), 1: point(10, 1.0), 2: point(10, 1.0)}
    assert matched_speedup(loop, base, [0, 1]) == 2.0  # 20 tokens in 1.5 s vs 20 in 3 s
    assert matched_speedup(loop, base, [2]) is None  # a failed request is not compared


def test_the_demo_refuses_an_unknown_learned_drafter_before_starting_anything(tmp_path):
    from typer.testing import CliRunner

    from infra.cli import app

    out = CliRunner().invoke(app, ["demo", "--learned", "eagle", "--run-dir", str(tmp_path / "run")])
    assert out.exit_code == 2
    assert "choose target-layers or selfspec" in out.output
    assert not (tmp_path / "run").exists()  # refused before the run directory or the stack


def test_the_demo_refuses_a_missing_day0_artifact_before_starting_anything(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import infra.root
    from infra.cli import app

    def refuse(*a, **k):
        raise AssertionError("the stack was started: the missing artifact was not caught first")

    monkeypatch.setattr(infra.root, "build_stack", refuse)
    out = CliRunner().invoke(app, ["demo", "--day0-artifact", str(tmp_path / "nope"),
                                   "--run-dir", str(tmp_path / "run")])
    text = " ".join((out.output + (out.stderr or "")).replace("│", " ").split())
    assert out.exit_code == 2 and "does not exist" in text, text
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("config, expected", [
    (None, "no config.json"),
    ("{not json", "invalid artifact config"),
    ("standalone", "is a standalone drafter; the learned drafter starts from a selfspec"),
])
def test_the_demo_refuses_a_day0_artifact_that_is_no_selfspec_artifact_before_starting_anything(
        tmp_path, monkeypatch, config, expected):
    """It was read only after the stack, the model and the suffix seed, and failed with a traceback."""
    from typer.testing import CliRunner

    import infra.root
    from infra.cli import app

    def refuse(*a, **k):
        raise AssertionError("the stack was started: the bad artifact was not caught first")

    monkeypatch.setattr(infra.root, "build_stack", refuse)
    art = tmp_path / "art"
    art.mkdir()
    if config == "standalone":
        from feedback.drafters.standalone_lm import StandaloneConfig, standalone_from_target
        from feedback.registry.artifact import save_drafter
        from serving.target import tiny_target

        target = tiny_target(vocab_size=64)
        cfg = StandaloneConfig.for_target(target.model.config, num_layers=1)
        model = standalone_from_target(target.model, num_layers=1, init="target-layers", seed=0)
        save_drafter(model, cfg, target.fingerprint, art, version="s", overwrite=True)
    elif config is not None:
        (art / "config.json").write_text(config)
    out = CliRunner().invoke(app, ["demo", "--day0-artifact", str(art), "--run-dir", str(tmp_path / "run")])
    text = " ".join((out.output + (out.stderr or "")).replace("│", " ").split())
    assert out.exit_code == 2 and expected in text, text
    assert not (tmp_path / "run").exists()



def test_the_demo_refuses_another_targets_day0_artifact_before_the_seed_and_the_stack(tmp_path, monkeypatch):
    """The fingerprint was checked only when the loop built its drafter, after the stack and the
    suffix seed (minutes on a fresh machine)."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    import infra.demo
    import infra.root
    import serving.target
    from feedback.registry.artifact import DrafterMeta
    from feedback.target.fingerprint import TargetFingerprint
    from infra.cli import app

    def fp(model_id):
        return TargetFingerprint(model_id=model_id, tokenizer_hash="0" * 16, vocab_size=48)

    def refuse(*a, **k):
        raise AssertionError("started before the artifact's target was checked")

    art = tmp_path / "art"
    art.mkdir()
    (art / "config.json").write_text(DrafterMeta(kind="selfspec", version="v1", target=fp("another-model"),
                                                 config={}, dtype="float32", files={}).model_dump_json())
    monkeypatch.setenv("COLUMNS", "1000")
    monkeypatch.setattr(serving.target, "load_target", lambda *a, **k: SimpleNamespace(fingerprint=fp("this-model")))
    monkeypatch.setattr(infra.demo, "use_suffix_seed", refuse)
    monkeypatch.setattr(infra.root, "build_stack", refuse)
    out = CliRunner().invoke(app, ["demo", "--day0-artifact", str(art), "--run-dir", str(tmp_path / "run")])
    text = " ".join((out.output + (out.stderr or "")).replace("│", " ").split())
    assert out.exit_code == 2 and "was built for target" in text and "another-model" in text, text


def test_the_demo_refuses_a_model_that_does_not_exist_before_starting_anything(tmp_path, monkeypatch):
    """`specloop demo` had no --model, as `serve` and `suffix-seed` have: it always ran the default
    target. A typo is one line naming the option, before the run directory or anything else."""
    from typer.testing import CliRunner

    from infra.cli import app

    monkeypatch.setenv("COLUMNS", "1000")
    out = CliRunner().invoke(app, ["demo", "--model", str(tmp_path / "nope"), "--run-dir", str(tmp_path / "run")])
    text = " ".join((out.output + (out.stderr or "")).replace("│", " ").split())
    assert out.exit_code == 2 and "--model" in text and "no such directory" in text, text
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("how", ["--model", "SPECLOOP_MODEL"])
def test_the_demo_runs_the_target_it_is_given(how, tmp_path, monkeypatch):
    """--model, else SPECLOOP_MODEL through the settings tree, as `specloop serve` reads it."""
    from typer.testing import CliRunner

    import infra.demo
    import serving.target
    from infra.cli import app

    class Reached(Exception):
        """The demo got past loading its target, to the suffix seed."""

    def seed(*a, **k):
        raise Reached

    loads = []
    monkeypatch.setattr(serving.target, "load_target", lambda *a, **k: loads.append(a) or SimpleNamespace())
    monkeypatch.setattr(infra.demo, "use_suffix_seed", seed)
    args = ["demo", "--run-dir", str(tmp_path / "run")]
    if how == "--model":
        args += ["--model", str(tmp_path)]
    else:
        monkeypatch.setenv("SPECLOOP_MODEL", str(tmp_path))
    out = CliRunner().invoke(app, args)
    assert isinstance(out.exception, Reached), (out.exception, out.output)
    assert loads == [(str(tmp_path),)]
