import json

import torch
from safetensors.torch import save_file
from trainer_tracegen import FP, make_trace, tiny_lm

from trainer.distill import DistillConfig
from trainer.gate import GateConfig
from trainer.loop import LoopConfig, TrainerLoop
from trainer.sources import ListTraceSource
from trainer.students import StandaloneStudent


def _loop(source, tmp_path, **kw):
    return TrainerLoop(
        source, StandaloneStudent(tiny_lm(seed=0)), FP,
        loop=LoopConfig(poll_records=20, min_train_traces=8, steps_per_round=5, rounds_per_gate=2,
                        checkpoint_dir=str(tmp_path / "ckpt")),
        distill=DistillConfig(lr=3e-3, eval_every=5), gate=GateConfig(k=3, hybrid=False), **kw)


def test_offsets_are_committed_only_after_training_and_pauses_when_saturated(tmp_path):
    src = ListTraceSource([make_trace("a", seed=i) for i in range(60)])
    busy = {"v": True}
    loop = _loop(src, tmp_path, saturated=lambda: busy["v"])
    loop.run_round()
    assert loop.stats.paused_rounds == 1 and loop.stats.train_steps == 0 and src.committed == 0
    busy["v"] = False
    loop.run_round()
    assert loop.stats.train_steps == 5 and src.committed == 40


def test_a_round_that_yields_to_serving_mid_fit_notes_the_pause_and_finishes_later(tmp_path):
    """A burst that begins and ends inside one fit stops it between steps: that is a pause, as an
    operator must see it; the gate due then (held-out scoring on the cores serving needs) waits,
    and the next round with spare capacity trains on the same traces again, new traffic or not."""
    src = ListTraceSource([make_trace("a", seed=i) for i in range(20)])
    polls = {"n": 0, "busy_after": 3}

    def saturated():  # asked at the round's start, then before each training step
        polls["n"] += 1
        return polls["n"] > polls["busy_after"]

    loop = TrainerLoop(
        src, StandaloneStudent(tiny_lm(seed=0)), FP,
        loop=LoopConfig(poll_records=20, min_train_traces=8, steps_per_round=5, rounds_per_gate=1,
                        checkpoint_dir=str(tmp_path / "ckpt")),
        distill=DistillConfig(lr=3e-3, eval_every=5), gate=GateConfig(k=3, hybrid=False),
        saturated=saturated)
    gates = []
    loop.gate = lambda: gates.append(loop.stats.train_steps)
    loop.run_round()
    assert loop.stats.train_steps == 2 and loop.stats.paused_rounds == 1 and loop._paused
    assert gates == []
    polls["busy_after"] = 10**9  # spare capacity again, and no new traffic
    loop.run_round()
    assert loop.stats.train_steps == 7 and gates == [7] and not loop._paused
    loop.run_round()  # finished: no new traffic, no more steps
    assert loop.stats.train_steps == 7


def test_a_poll_of_dead_letters_alone_is_committed_but_pending_records_are_not(tmp_path):
    """A poll that returned no record (its messages, if any, were dead-lettered) commits when no
    earlier record awaits a checkpoint: else every restart would read and dead-letter them again."""

    class Counting(ListTraceSource):
        commits = 0

        def commit(self):
            self.commits += 1
            super().commit()

    empty = Counting([])
    loop = _loop(empty, tmp_path / "a")
    loop.run_round()
    assert empty.commits == 1
    few = Counting([make_trace("a", seed=i) for i in range(3)])  # below min_train_traces
    loop = _loop(few, tmp_path / "b")
    loop.run_round()
    loop.run_round()  # nothing more arrives: the 3 records still await a round and its checkpoint
    assert few.commits == 0 and few.committed == 0


def test_each_rounds_mlflow_metrics_count_dead_letters_and_refused_traces(tmp_path):
    """Operators watch the trainer in MLflow: what it could not use is counted there too."""

    class Ops:  # the loop's ops log, recording the metrics it is given
        def __init__(self):
            self.logged = []

        def metrics(self, values, step=0):
            self.logged.append(values)

        def __getattr__(self, name):
            return lambda *a, **k: None

    class WithDeadLetters(ListTraceSource):
        dead_lettered = 2  # what KafkaTraceSource counts

    foreign = make_trace("a", seed=99)
    foreign = foreign.model_copy(update={"target": FP.model_copy(update={"model_id": "other"})})
    ops = Ops()
    loop = _loop(WithDeadLetters([make_trace("a", seed=i) for i in range(12)] + [foreign]), tmp_path,
                 ops=ops)
    loop.run_round()
    last = [m for m in ops.logged if "records_polled" in m][-1]
    assert last["records_dead_lettered"] == 2 and last["records_refused_fingerprint"] == 1


def test_killed_loop_resumes_from_checkpoint_without_losing_records(tmp_path):
    recs = [make_trace("a", seed=i) for i in range(60)]
    src = ListTraceSource(recs)
    loop = _loop(src, tmp_path)
    loop.run_round()
    loop.run_round()
    trained = {r.request_id for r in loop.replay.train_records} | {r.request_id for r in loop.replay.heldout}
    step, params = loop.distiller.global_step, [p.clone() for p in loop.student.model.parameters()]
    loop.source.poll(20)  # polled, then "killed" before the round finished: not committed
    src.rewind()  # what the broker does for an uncommitted consumer group

    resumed = _loop(src, tmp_path)
    assert resumed.distiller.global_step == step
    for a, b in zip(params, resumed.student.model.parameters()):
        assert torch.equal(a, b)
    assert {r.request_id for r in resumed.replay.train_records} | {r.request_id for r in resumed.replay.heldout} == trained
    while src.poll.__self__._pending:
        resumed.run_round()
    seen = {r.request_id for r in resumed.replay.train_records} | {r.request_id for r in resumed.replay.heldout}
    assert seen == {r.request_id for r in recs}
    assert resumed.replay.rejected["duplicate"] == 0


def _exporter(student, out, fingerprint, extra):
    save_file({k: v.contiguous() for k, v in student.model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "fingerprint.json").write_text(json.dumps(fingerprint.model_dump()))


class _Announcer:
    def __init__(self):
        self.calls = []

    def announce(self, tenant, version):
        self.calls.append((tenant, version))


def test_loop_promotes_registers_and_announces(tmp_path):
    from safetensors.torch import load_file

    from feedback.ops.ops_log import OpsRun
    from feedback.registry.drafter_registry import DrafterRegistry

    reg = DrafterRegistry(f"sqlite:///{tmp_path}/mlflow.db")
    ops = OpsRun(f"sqlite:///{tmp_path}/mlflow.db", "specloop/ops", "trainer-acme", flush_s=3600)
    ann = _Announcer()
    src = ListTraceSource([make_trace("a", seed=i, tenant="acme") for i in range(80)])
    loop = TrainerLoop(src, StandaloneStudent(tiny_lm(seed=0)), FP,
                       loop=LoopConfig(tenant="acme", poll_records=80, min_train_traces=8, steps_per_round=30,
                                       rounds_per_gate=1, lineage={"topic": "inproc"}),
                       distill=DistillConfig(lr=3e-3, eval_every=10), gate=GateConfig(k=3, hybrid=False),
                       registry=reg, announcer=ann, exporter=_exporter, ops=ops)
    loop.run_round()
    assert loop.stats.promotions == 1, loop.stats.last_decision
    assert ann.calls == [("acme", "1")]
    path, champ = reg.download("acme")
    got = load_file(str(path / "model.safetensors"))
    for k, v in loop.student.model.state_dict().items():
        assert torch.equal(got[k], v)
    params = reg.client.get_run(champ.run_id).data.params
    assert params["topic"] == "inproc" and params["parent_version"] == "none" and params["loss"] == "fkl"
    assert params["train_precision"] == ("bf16" if loop.distiller.bf16 else "fp32")
    assert params["weights_from_version"] == "none" and params["replay_traces"] == str(len(loop.replay))
    assert reg.client.get_run(champ.run_id).info.run_name == "candidate-acme-r1"  # named by the trainer
    # same model again: not better than itself -> no second promotion
    loop.gate()
    assert loop.stats.promotions == 1
    # ...nor refreshed once the champion is live long enough: the same weights are nothing to swap
    loop._champion_since -= 10 * GateConfig().refresh_after_s
    d = loop.gate()
    assert not d.promote and "unchanged since the champion" in d.reason
    assert loop.stats.promotions == 1 and ann.calls == [("acme", "1")]
    # the ops run logs what was decided: the refresh passed both measures but promoted nothing
    ops.flush()
    history = ops.client.get_metric_history(ops.run_id, "gate_promote")
    assert [m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))][-1] == 0.0
    assert json.loads(ops.client.get_run(ops.run_id).data.tags["last_gate"])["promote"] is False
    ops.close()
