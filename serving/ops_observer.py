"""What serving did, per domain and over time: the replica's MLflow ops run, and acceptance drift.

``LiveOpsObserver`` is fed by the engine on its step thread (counts only: O(rows) per step); every
``every_s`` seconds it queues one batch of metrics on the OpsRun (feedback/ops/ops_log.py), whose
own thread sends them:

    acceptance.<domain>          accepted / drafted tokens since the last flush
    tokens_per_verify.<domain>   tokens emitted per row-step (1.0 = plain decoding)
    k_mean, spec_off_fraction    drafted tokens per row-step; row-steps that drafted nothing
    step_ms                      wall ms of a verify step (draft + verify), over the steps whose
                                 engine measured both (TorchEngine; SGLang's steps carry no timings,
                                 so under SGLang step_ms and est_speedup are absent)
    est_speedup.batch<b>         tokens per ms of the window's timed steps of batch bucket <b> ("1",
                                 "2-3", "4-7", "8-15", ...: powers of two) over plain decoding's at
                                 the same batch sizes (``estimated_speedup``); absent for a bucket
                                 none of whose batch sizes has a plain step in the last
                                 ``plain_max_age_s`` (default 10 min); also the Prometheus gauge
                                 ``specloop_estimated_speedup{batch}`` (removed where absent)
    est_speedup                  the same over every batch size with a fresh plain figure
    drift.<domain>               1 at a drift (from the DriftObserver), also an ``event.drift``
plus events for drafter changes (swaps, rollbacks: ``event.drafter_change`` with kind/version).
Requests with ``train: false`` are counted like any other (no content reaches MLflow).

``DriftObserver`` detects acceptance drifts per domain (feedback/ops/drift.py) whether or not there
is an ops run: it counts each on ``specloop_acceptance_drift_total{domain}`` (in the registry of the
engine's other metrics) and tells its listeners: the Redis announcement for the trainer
(``DriftPublisher``), the ops run (``LiveOpsObserver.record_drift``), the demo's table. Before, drift
was part of the ops observer, so a replica without MLflow (Redis only) never detected a drift nor
told the trainer of one. serving/builder.py builds it for every replica.

Domains are the client's strings: both observers track at most ``DomainCap.max_domains`` of them
(one shared cap, feedback/ops/domains.py) and count the rest as ``other``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Gauge

from feedback.ops.domains import DEFAULT, DomainCap
from feedback.ops.drift import DriftDetector, DriftEvent
from serving.engine.verify_costs import VerifyCosts
from serving.metrics import once_per_registry
from serving.observers import BaseObserver

log = logging.getLogger(__name__)

@once_per_registry
def drift_counter(registry: CollectorRegistry) -> Counter:
    """``specloop_acceptance_drift_total{domain}`` of ``registry`` (default: the process's)."""
    return Counter("specloop_acceptance_drift", "Acceptance drifts detected, by domain.", ["domain"],
                   registry=registry)


@once_per_registry
def speedup_gauge(registry: CollectorRegistry) -> Gauge:
    """``specloop_estimated_speedup{batch}`` of ``registry`` (default: the process's)."""
    return Gauge("specloop_estimated_speedup",
                 "Tokens per ms over plain decoding's at the same batch sizes, by batch bucket "
                 "(the last ops flush window's; absent without a recent plain step).", ["batch"],
                 registry=registry)


PLAIN_MAX_AGE_S = 600.0
"""A batch size's plain figure older than this (no plain step of that size since) is stale: a
speedup is no longer estimated from it."""


def batch_bucket(batch: int) -> str:
    """The label of ``batch``'s bucket: powers of two ("1", "2-3", "4-7", "8-15", ...)."""
    lo = 1 << (max(1, batch).bit_length() - 1)
    return "1" if lo == 1 else f"{lo}-{2 * lo - 1}"


class DriftObserver(BaseObserver):
    """Acceptance drift per (capped) domain, from every drafting row-step. ``listeners``: called
    with each DriftEvent on the engine's thread (they must be quick; one that raises is logged and
    the others still run). ``drifts``: the latest events (at most ``KEPT``), oldest first."""

    KEPT = 256

    def __init__(self, detector: DriftDetector | None = None, *, registry: CollectorRegistry | None = None,
                 domains: DomainCap | None = None, listeners=()):
        self.detector = detector if detector is not None else DriftDetector()
        self.domains = domains if domains is not None else DomainCap()
        self.registry = registry
        self.counter = drift_counter(registry)
        self.listeners: list = list(listeners)
        self.drifts: list[DriftEvent] = []
        self._domain: dict[str, str] = {}

    def on_request_start(self, request, prefill_features=None) -> None:
        self._domain[request.request_id] = self.domains(request.domain)

    def on_request_finish(self, request, output_ids, finish_reason, stats) -> None:
        self._domain.pop(request.request_id, None)

    def on_step(self, batch) -> None:
        drafted, accepted = batch.num_drafted.tolist(), batch.num_accepted.tolist()
        for rid, n, a in zip(batch.request_ids, drafted, accepted):
            if n <= 0:
                continue  # no acceptance signal (the detector skips it too)
            ev = self.detector.observe(self._domain.get(rid, DEFAULT), int(n), int(a))
            if ev is not None:
                self._fire(ev)

    def _fire(self, ev: DriftEvent) -> None:
        self.drifts.append(ev)
        del self.drifts[:-self.KEPT]
        self.counter.labels(domain=ev.domain).inc()
        for listener in list(self.listeners):
            try:
                listener(ev)
            except Exception:  # one listener (Redis, MLflow) must not keep the others from hearing
                log.exception("drift listener %r failed", listener)


class LiveOpsObserver(BaseObserver):
    """``drift``: the replica's DriftObserver, registered on the engine beside this observer (what
    serving/builder.py builds): this observer listens to it (its drifts go into the run), tracks
    the same domains and sets its speedup gauge in the same registry. None: no drifts recorded,
    domains capped by a DomainCap of its own, the gauge in the process's registry.

    The speedup estimate compares like with like: a step at batch B is priced against a plain step
    at batch B (which emits B tokens), and the figures are summed per bucket of batch sizes
    (``estimated_speedup``). The plain figure at B is the median verify ms of the recent timed steps
    of B rows that verified no draft (a draft cut to nothing is not plain decoding's cost): the
    goodput policy's measure (serving/engine/verify_costs.py), kept here by a VerifyCosts of this
    observer's own, since the VerifyBatch does not carry the policy's (which times the step after
    the draft, observers included, and exists with ``adaptive_k`` only). A batch size with no plain
    step for ``plain_max_age_s`` (speculation on at every step) has no figure: its steps are left
    out of the estimate, rather than priced against a machine as it ran long ago."""

    def __init__(self, run, every_s: float = 5.0, drift: DriftObserver | None = None,
                 plain_max_age_s: float = PLAIN_MAX_AGE_S):
        self.run = run
        self.every_s = every_s
        self.drift_observer = drift
        if drift is not None:
            drift.listeners.append(self.record_drift)
        self.domains = drift.domains if drift is not None else DomainCap()
        """The cap on domains tracked (the drift observer's: one cap for both)."""
        self.speedup = speedup_gauge(drift.registry if drift is not None else None)
        self.plain_max_age_s = plain_max_age_s
        self._domain: dict[str, str] = {}
        self._reset()
        self._last = time.monotonic()
        self._plain = VerifyCosts()
        """Plain steps' verify ms per batch size (``plain_ms(batch)``: the median of the recent)."""
        self._plain_at: dict[int, float] = {}  # batch size -> monotonic time of its last plain step
        self._gauged: set[str] = set()
        self.step = 0
        self.flushes = 0

    @property
    def drifts(self) -> list[DriftEvent]:
        return self.drift_observer.drifts if self.drift_observer is not None else []

    def _reset(self) -> None:
        self._drafted = defaultdict(int)
        self._accepted = defaultdict(int)
        self._emitted = defaultdict(int)
        self._row_steps = defaultdict(int)
        self._off = 0
        self._rows = 0
        self._steps = 0
        self._timed_steps = 0
        self._batch_ms = defaultdict(float)  # batch size -> ms of its timed steps
        self._batch_tokens = defaultdict(int)  # batch size -> tokens its timed steps emitted

    def on_request_start(self, request, prefill_features=None) -> None:
        self._domain[request.request_id] = self.domains(request.domain)

    def on_request_finish(self, request, output_ids, finish_reason, stats) -> None:
        self._domain.pop(request.request_id, None)

    def record_drift(self, ev: DriftEvent) -> None:
        """A drift into the ops run (a DriftObserver listener)."""
        self.run.metrics({f"drift.{ev.domain}": 1.0}, self.step)
        self.run.event("drift", self.step, domain=ev.domain, before=round(ev.before, 4),
                       now=round(ev.now, 4))

    def on_drafter_change(self, kind: str, version: str) -> None:
        self.run.event("drafter_change", self.step, kind=kind, version=version)
        self.run.tag("live_drafter", f"{kind}:{version}")

    def on_step(self, batch) -> None:
        self.step += 1
        timed = batch.draft_ms is not None and batch.verify_ms is not None
        step_ms = float(batch.draft_ms + batch.verify_ms) if timed else 0.0
        drafted_any = False
        tokens = 0
        for i, rid in enumerate(batch.request_ids):
            dom = self._domain.get(rid, DEFAULT)
            n, a = int(batch.num_drafted[i]), int(batch.num_accepted[i])
            self._drafted[dom] += n
            self._accepted[dom] += a
            emitted = len(batch.emitted[i])
            tokens += emitted
            self._emitted[dom] += emitted
            self._row_steps[dom] += 1
            self._rows += 1
            self._off += n == 0
            drafted_any |= n > 0
        self._steps += 1
        rows = len(batch.request_ids)
        if timed and rows:
            if not drafted_any:
                self._plain.observe(rows, 0, float(batch.verify_ms))
                self._plain_at[rows] = time.monotonic()
            self._timed_steps += 1
            self._batch_ms[rows] += step_ms
            self._batch_tokens[rows] += tokens
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
            m["step_ms"] = sum(self._batch_ms.values()) / self._timed_steps
        speedups = self.estimated_speedup()
        m |= {("est_speedup" if b is None else f"est_speedup.batch{b}"): x for b, x in speedups.items()}
        for b in self._gauged - speedups.keys():  # no estimate this window: no stale value either
            try:
                self.speedup.remove(b)
            except KeyError:  # another observer of the registry removed it
                pass
        for b, x in speedups.items():
            if b is not None:
                self.speedup.labels(batch=b).set(x)
        self._gauged = {b for b in speedups if b is not None}
        self.run.metrics(m, self.step)
        self.flushes += 1
        self._reset()

    def estimated_speedup(self) -> dict[str | None, float]:
        """{batch bucket: speedup} over this window's timed steps, and under None over all of them:
        the ms plain decoding would have taken for their tokens (at each step's batch size B, a
        plain step of the median plain verify ms emits B tokens) over the ms they took. Batch sizes
        without a plain figure seen in the last ``plain_max_age_s`` are left out; a bucket left with
        none has no entry."""
        now = time.monotonic()
        plain_ms: dict[str | None, float] = defaultdict(float)
        took_ms: dict[str | None, float] = defaultdict(float)
        for batch, ms in self._batch_ms.items():
            plain = self._plain.plain_ms(batch)
            if plain is None or now - self._plain_at[batch] > self.plain_max_age_s:
                continue
            for key in (batch_bucket(batch), None):
                plain_ms[key] += plain * self._batch_tokens[batch] / batch
                took_ms[key] += ms
        return {key: plain_ms[key] / ms for key, ms in took_ms.items() if ms > 0}


class DriftPublisher:
    """DriftObserver listener that announces each drift on the Redis control plane, where trainers
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
