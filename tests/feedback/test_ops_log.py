"""Operators' ops runs: drift is detected per domain; an MLflow outage loses metrics, never raises."""

from __future__ import annotations

import time

from feedback.drift import DriftDetector
from feedback.ops_log import OpsRun, open_run
from serving.target import tiny_target


def test_drift_detector_fires_once_per_drop_and_rearms():
    d = DriftDetector(threshold=0.3, fast_steps=4, slow_steps=64, min_steps=8)
    events = [d.observe("code", 4, 3) for _ in range(40)]  # steady 0.75
    assert not any(events)
    events = [d.observe("code", 4, 0) for _ in range(10)]  # collapse
    fired = [e for e in events if e is not None]
    assert len(fired) == 1 and fired[0].domain == "code" and fired[0].drop > 0.3
    assert not any(d.observe("chat", 4, 0) for _ in range(40))  # another domain: its own level
    for _ in range(20):
        d.observe("code", 4, 3)  # recovers: re-armed
    assert any(d.observe("code", 4, 0) for _ in range(10))


def test_mlflow_outage_drops_and_counts_never_raises(tmp_path):
    run = OpsRun(f"sqlite:///{tmp_path}/m.db", "specloop/x", "serving-t-r", flush_s=0.05)
    run.client.log_batch = lambda *a, **k: (_ for _ in ()).throw(ConnectionError("mlflow down"))
    for i in range(50):
        run.metrics({"acceptance.code": 0.5}, step=i)
        run.event("drift", i, domain="code")
    time.sleep(0.3)
    run.close()
    assert run.errors >= 1 and run.sent == 0
    assert open_run(None, tiny_target(vocab_size=32).fingerprint, "trainer", "t", "r") is None


def test_flush_sends_everything_queued_before_the_next_tick(tmp_path):
    """A trainer flushes when it stops: its worker may be killed right after (issue 15)."""
    run = OpsRun(f"sqlite:///{tmp_path}/m.db", "specloop/x", "trainer-t-r", flush_s=3600)
    for i in range(2500):  # more than one log_batch
        run.metrics({"train_loss": 1.0 / (i + 1)}, step=i)
    run.event("gate", 3, promote=True, reason="better")
    run.flush()
    assert run.sent == 2501 and run.errors == 0
    data = run.client.get_run(run.run_id).data
    assert data.metrics["event.gate"] == 1 and "better" in data.tags["last_gate"]
    assert len(run.client.get_metric_history(run.run_id, "train_loss")) == 2500
    run.close()
