"""LiveOpsObserver: what serving did, per domain and over time, into the replica's MLflow ops run.

Fed by the engine on its step thread (counts only: O(rows) per step); every ``every_s`` seconds it
queues one batch of metrics on the OpsRun (feedback/ops/ops_log.py), whose own thread sends them:

    acceptance.<domain>          accepted / drafted tokens since the last flush
    tokens_per_verify.<domain>   tokens emitted per row-step (1.0 = plain decoding)
    k_mean, spec_off_fraction    drafted tokens per row-step; row-steps that drafted nothing
    step_ms                      wall ms of a verify step (draft + verify), over the steps whose
                                 engine measured both (TorchEngine; SGLang's steps carry no timings,
                                 so under SGLang step_ms and est_speedup are absent)
    est_speedup                  tokens per verify x plain step ms / step ms, where plain step ms is
                                 the running average of timed steps that drafted nothing (probes
                                 and k = 0 steps); absent until one was seen
    drift.<domain>               1 at a drift (feedback/ops/drift.py), also an ``event.drift``
plus events for drafter changes (swaps, rollbacks: ``event.drafter_change`` with kind/version).
Requests with ``train: false`` are counted like any other (no content reaches MLflow).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from prometheus_client import Counter

from feedback.ops.drift import DriftDetector
from serving.observers import BaseObserver

DRIFTS = Counter("specloop_acceptance_drift", "Acceptance drifts detected, by domain.", ["domain"])


class LiveOpsObserver(BaseObserver):
    def __init__(self, run, every_s: float = 5.0, drift: DriftDetector | None = None, on_drift=None):
        self.run = run
        self.every_s = every_s
        self.drift = drift or DriftDetector()
        self.on_drift = on_drift
        """Called with each DriftEvent (e.g. a Prometheus counter, the demo's table)."""
        self.drifts: list = []
        self._domain: dict[str, str] = {}
        self._reset()
        self._last = time.monotonic()
        self._plain_ms: float | None = None
        self.step = 0
        self.flushes = 0

    def _reset(self) -> None:
        self._drafted = defaultdict(int)
        self._accepted = defaultdict(int)
        self._emitted = defaultdict(int)
        self._row_steps = defaultdict(int)
        self._off = 0
        self._rows = 0
        self._steps = 0
        self._timed_steps = 0
        self._step_ms = 0.0

    def on_request_start(self, request, prefill_features=None) -> None:
        self._domain[request.request_id] = request.domain or "default"

    def on_request_finish(self, request, output_ids, finish_reason, stats) -> None:
        self._domain.pop(request.request_id, None)

    def on_drafter_change(self, kind: str, version: str) -> None:
        self.run.event("drafter_change", self.step, kind=kind, version=version)
        self.run.tag("live_drafter", f"{kind}:{version}")

    def on_step(self, batch) -> None:
        self.step += 1
        timed = batch.draft_ms is not None and batch.verify_ms is not None
        step_ms = float(batch.draft_ms + batch.verify_ms) if timed else 0.0
        drafted_any = False
        for i, rid in enumerate(batch.request_ids):
            dom = self._domain.get(rid, "default")
            n, a = int(batch.num_drafted[i]), int(batch.num_accepted[i])
            self._drafted[dom] += n
            self._accepted[dom] += a
            self._emitted[dom] += len(batch.emitted[i])
            self._row_steps[dom] += 1
            self._rows += 1
            self._off += n == 0
            drafted_any |= n > 0
            ev = self.drift.observe(dom, n, a)
            if ev is not None:
                self.drifts.append(ev)
                DRIFTS.labels(domain=dom).inc()
                self.run.metrics({f"drift.{dom}": 1.0}, self.step)
                self.run.event("drift", self.step, domain=dom, before=round(ev.before, 4),
                               now=round(ev.now, 4))
                if self.on_drift is not None:
                    self.on_drift(ev)
        if timed and not drafted_any:
            self._plain_ms = step_ms if self._plain_ms is None else 0.9 * self._plain_ms + 0.1 * step_ms
        self._steps += 1
        if timed:
            self._timed_steps += 1
            self._step_ms += step_ms
        if time.monotonic() - self._last >= self.every_s:
            self.flush()

    def flush(self) -> None:
        self._last = time.monotonic()
        if not self._steps:
            return
        m: dict[str, float] = {}
        for dom, rs in self._row_steps.items():
            if self._drafted[dom]:
                m[f"acceptance.{dom}"] = self._accepted[dom] / self._drafted[dom]
            m[f"tokens_per_verify.{dom}"] = self._emitted[dom] / rs
        rows = max(1, self._rows)
        tpv = sum(self._emitted.values()) / rows
        m |= {"tokens_per_verify": tpv, "k_mean": sum(self._drafted.values()) / rows,
              "spec_off_fraction": self._off / rows}
        if self._timed_steps:
            step_ms = self._step_ms / self._timed_steps
            m["step_ms"] = step_ms
            if self._plain_ms and step_ms:
                m["est_speedup"] = tpv * self._plain_ms / step_ms
        self.run.metrics(m, self.step)
        self.flushes += 1
        self._reset()


class DriftPublisher:
    """``on_drift`` callback that announces each drift on the Redis control plane, where trainers
    of the tenant read it (trainer/loop.py ``apply_drifts``). Each publish runs on a short daemon
    thread: drifts are rare, and a Redis call never runs on the decode thread."""

    def __init__(self, control, tenant: str, replica_id: str):
        self.control, self.tenant, self.replica_id = control, tenant, replica_id
        self.published = 0

    def __call__(self, ev) -> None:
        from feedback.control.plane import DriftAnnouncement

        msg = DriftAnnouncement(tenant=self.tenant, domain=ev.domain, before=round(ev.before, 4),
                                now=round(ev.now, 4), replica_id=self.replica_id)
        threading.Thread(target=self._publish, args=(msg,), name="drift-publish", daemon=True).start()

    def _publish(self, msg) -> None:
        if self.control.announce_drift(msg):
            self.published += 1
