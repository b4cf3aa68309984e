"""Lineage: every registered version records the exact per-partition offset range of the traces
consumed since the previous registration, checked against the offsets the broker gave the
records when they were produced (real broker)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from trainer_tracegen import FP, make_trace, tiny_lm

from trainer.distill import DistillConfig
from trainer.gate import GateConfig
from trainer.loop import LoopConfig, TrainerLoop
from trainer.sources import TimedSource
from trainer.students import StandaloneStudent


class _Registry:
    def __init__(self):
        self.params: list[dict] = []
        self.metrics: list[dict] = []

    def log_candidate(self, fingerprint, path, params, metrics, curves, tags=None):
        self.params.append(params)
        self.metrics.append(metrics)
        return f"run-{len(self.params)}"

    def register(self, tenant, run_id):
        return SimpleNamespace(version=run_id.removeprefix("run-"))


def _produce(url, topic, records) -> dict[str, tuple[int, int]]:
    """request id -> (partition, offset) the broker acknowledged."""
    from kafka import KafkaProducer

    from feedback.bus.codec import encode

    producer = KafkaProducer(bootstrap_servers=[url], acks="all", enable_idempotence=False)
    futures = {r.request_id: producer.send(topic, value=encode(r), key=r.tenant.encode()) for r in records}
    producer.flush(10)
    out = {rid: (f.get(10).partition, f.get(10).offset) for rid, f in futures.items()}
    producer.close()
    return out


def _expected(where: dict[str, tuple[int, int]], ids) -> str:
    by_part: dict[int, list[int]] = {}
    for rid in ids:
        part, off = where[rid]
        by_part.setdefault(part, []).append(off)
    return {p: (min(o), max(o)) for p, o in by_part.items()}


def _parse(param: str) -> dict[int, tuple[int, int]]:
    out = {}
    for item in param.split(","):
        where, rng = item.rsplit(":", 1)
        a, b = rng.split("-")
        out[int(where.rsplit("/", 1)[1])] = (int(a), int(b))
    return out


@pytest.mark.integration
def test_each_version_records_the_offsets_of_the_traces_since_the_previous_one(kafka_broker, kafka_topic,
                                                                               tmp_path):
    from feedback.bus.kafka_source import KafkaTraceSource

    # the requests finished at known times: each version records those of its own traces
    first_batch = [make_trace("a", seed=i).model_copy(update={"finished_at": 1000.0 + i}) for i in range(30)]
    where = _produce(kafka_broker.url, kafka_topic, first_batch)
    source = TimedSource(KafkaTraceSource(bootstrap_servers=kafka_broker.url, topic=kafka_topic,
                                          group_id="lineage", session_timeout_ms=2000,
                                          heartbeat_interval_ms=500))
    reg, extras = _Registry(), []
    loop = TrainerLoop(source, StandaloneStudent(tiny_lm(seed=0)), FP,
                       loop=LoopConfig(poll_records=40, poll_timeout_s=1.0, min_train_traces=8,
                                       steps_per_round=3, rounds_per_gate=1,
                                       checkpoint_dir=str(tmp_path / "ckpt")),
                       distill=DistillConfig(lr=3e-3, eval_every=3),
                       gate=GateConfig(k=3, hybrid=False, acceptance_margin=-1.0, speedup_margin=-10.0),
                       registry=reg,
                       exporter=lambda s, out, fp, extra: (extras.append(extra), (out / "w").write_bytes(b"x")))
    try:
        deadline = time.monotonic() + 60
        while len(source.polled_at) < 30 and time.monotonic() < deadline:
            loop.run_round()
        assert len(source.polled_at) == 30 and len(reg.params) == 1, (len(source.polled_at), len(reg.params))
        assert _parse(reg.params[0]["trace_offsets"]) == _expected(where, source.polled_at)
        times = {"window_traces": 30.0, "trace_finished_median_at": 1014.5, "trace_finished_newest_at": 1029.0}
        assert {k: extras[0][k] for k in times} == times  # in the artifact, for serving's freshness
        assert {k: reg.metrics[0][k] for k in times} == times  # and on the candidate's run

        second_batch = [make_trace("a", seed=100 + i).model_copy(update={"finished_at": 2000.0 + i})
                        for i in range(20)]
        where.update(_produce(kafka_broker.url, kafka_topic, second_batch))
        before = set(source.polled_at)
        deadline = time.monotonic() + 60
        while len(reg.params) < 2 and time.monotonic() < deadline:
            loop.run_round()
        assert len(reg.params) == 2
        since = set(source.polled_at) - before
        assert since == {r.request_id for r in second_batch}
        assert _parse(reg.params[1]["trace_offsets"]) == _expected(where, since)
        assert extras[1]["window_traces"] == 20.0 and extras[1]["trace_finished_median_at"] == 2009.5
    finally:
        source.close()


def test_trace_times_cover_the_traces_since_the_last_registration_and_survive_a_restart():
    from trainer.lineage import Lineage

    lineage = Lineage(None, {})
    assert lineage.trace_times() == {}
    lineage.note_traces([SimpleNamespace(finished_at=t) for t in (10.0, 40.0, 20.0)])
    assert lineage.trace_times() == {"window_traces": 3.0, "trace_finished_median_at": 20.0,
                                     "trace_finished_newest_at": 40.0}
    restarted = Lineage(None, {})
    restarted.restore(None, list(lineage.finished_at))  # as checkpointed
    assert restarted.trace_times() == lineage.trace_times()
    lineage.mark()
    assert lineage.trace_times() == {}
