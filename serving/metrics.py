"""Prometheus metrics of speculative decoding, fed by the engine's verify steps.

``SpecMetrics`` is a StepObserver; every engine gets one. Collectors are created once per registry
(several engines in one process, e.g. tests, share them instead of failing on duplicate names).

Series (``row`` = one request in one verify step):
    specloop_spec_drafted_tokens_total     drafted tokens along each row's path: on a tree step the
                                           accepted path plus the node that ended it (tree.linear_view),
                                           so acceptance reads as a chain's
    specloop_spec_draft_nodes_total        every drafted token the target verified (a tree's nodes;
                                           = drafted tokens on chain steps): what a request's
                                           usage.spec.drafted_tokens counts
    specloop_spec_accepted_tokens_total    drafted tokens the target accepted
    specloop_spec_emitted_tokens_total     tokens committed by verify steps (accepted + 1 per row)
    specloop_spec_verify_steps_total       rows verified (one per request per step)
    specloop_spec_verify_batches_total     target forwards (one per step, whole batch)
    specloop_spec_accept_length            histogram of accepted drafts per row
    specloop_spec_draft_ms / _verify_ms    histograms, per step (whole batch); TorchEngine only (SGLang's
                                           steps carry no timings: nothing is observed)
    specloop_spec_batch_size               histogram of rows per step
    specloop_requests_finished_total{reason}   finished requests (stop, length, abort, error)
    specloop_drafter_info{kind, version}   1 for the active drafter
    specloop_spec_position_drafted_total{position} / _accepted_total{position}
                                           drafted / accepted tokens by draft position (1 = first)
    specloop_spec_draft_length             histogram of drafted tokens per row (the k chosen)
    specloop_spec_off_rows_total           rows verified with no draft (speculation off)
    specloop_prefix_cache_hit_tokens_total / _prefilled_tokens_total
                                           prompt tokens copied from TorchEngine's prefix cache /
                                           prefilled (read from the caches at scrape time)
    (elsewhere: specloop_traces_shed_total{reason} in feedback/bus/kafka_sink.py, specloop_drafter_swaps_total
    / _rollbacks_total / _refused_total and specloop_drafter_live_accept_len{version} /
    _live_acceptance_rate{version} in serving/live_acceptance.py, specloop_acceptance_drift_total{domain} and
    specloop_estimated_speedup{batch} (with an MLflow ops run) in serving/ops_observer.py,
    specloop_loop_errors_total{loop} in feedback/background/supervise.py,
    specloop_traces_followed_total{result} in serving/trace_follow.py)

engine=sglang: the per-step series (all but specloop_requests_finished_total and specloop_drafter_info)
cover only the requests SPECLOOP_TRACE_SAMPLE_RATE samples, and only their rows of a step: SGLang's
plugin (serving/sglang/plugin.py) reports the verify steps of sampled requests only.

PromQL:
    acceptance rate       rate(specloop_spec_accepted_tokens_total[5m])
                            / rate(specloop_spec_drafted_tokens_total[5m])
    drafts per accepted   rate(specloop_spec_draft_nodes_total[5m])
                            / rate(specloop_spec_accepted_tokens_total[5m])   (what trees spend)
    tokens per verify     rate(specloop_spec_emitted_tokens_total[5m])
                            / rate(specloop_spec_verify_steps_total[5m])
    mean accept length    rate(specloop_spec_accept_length_sum[5m])
                            / rate(specloop_spec_accept_length_count[5m])
    decode tokens/s       rate(specloop_spec_emitted_tokens_total[5m])
    p90 verify latency    histogram_quantile(0.9, rate(specloop_spec_verify_ms_bucket[5m]))
    finishes by reason    sum by (reason) (rate(specloop_requests_finished_total[5m]))
    active drafter        specloop_drafter_info == 1
    acceptance by position  sum by (position) (rate(specloop_spec_position_accepted_total[5m]))
                            / sum by (position) (rate(specloop_spec_position_drafted_total[5m]))
    k chosen (p50)        histogram_quantile(0.5, rate(specloop_spec_draft_length_bucket[5m]))
    speculation off       rate(specloop_spec_off_rows_total[5m]) / rate(specloop_spec_verify_steps_total[5m])
    prefix cache hits     rate(specloop_prefix_cache_hit_tokens_total[5m])
                            / (rate(specloop_prefix_cache_hit_tokens_total[5m])
                               + rate(specloop_prefix_cache_prefilled_tokens_total[5m]))
    traces shed           sum by (reason) (rate(specloop_traces_shed_total[5m]))
    swaps / rollbacks     increase(specloop_drafter_swaps_total[1h]), increase(specloop_drafter_rollbacks_total[1h])
    acceptance drift      increase(specloop_acceptance_drift_total[1h]) > 0   (alert: which domain)
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from serving.engine.base import VerifyBatch
from serving.observers import BaseObserver

T = TypeVar("T")

_MS_BUCKETS = (1, 2, 5, 10, 20, 30, 40, 50, 75, 100, 150, 250, 500, 1000, 2500)


@dataclass
class _Collectors:
    drafted: Counter
    draft_nodes: Counter
    accepted: Counter
    emitted: Counter
    verify_steps: Counter
    verify_batches: Counter
    accept_length: Histogram
    draft_ms: Histogram
    verify_ms: Histogram
    batch_size: Histogram
    finished: Counter
    drafter_info: Gauge
    pos_drafted: Counter
    pos_accepted: Counter
    draft_length: Histogram
    spec_off_rows: Counter


def once_per_registry(make: Callable[[CollectorRegistry], T]) -> Callable[[CollectorRegistry | None], T]:
    """``make(registry)`` (collectors registered on it) runs once per registry (None: the
    process's); later calls return what it made. Several engines in one process (tests, a demo's
    baseline) then share them instead of failing on duplicate names."""
    made: weakref.WeakKeyDictionary[CollectorRegistry, T] = weakref.WeakKeyDictionary()
    lock = threading.Lock()

    @functools.wraps(make)
    def get(registry: CollectorRegistry | None = None) -> T:
        registry = registry if registry is not None else REGISTRY
        with lock:
            if registry not in made:
                made[registry] = make(registry)
            return made[registry]

    return get


@once_per_registry
def _collectors(r: CollectorRegistry) -> _Collectors:
    return _Collectors(
        drafted=Counter("specloop_spec_drafted_tokens",
                        "Drafted tokens along each row's path (a tree's accepted path + 1).",
                        registry=r),
        draft_nodes=Counter("specloop_spec_draft_nodes",
                            "Drafted tokens the target verified (every node of a tree).",
                            registry=r),
        accepted=Counter(
            "specloop_spec_accepted_tokens", "Accepted drafted tokens.", registry=r
        ),
        emitted=Counter(
            "specloop_spec_emitted_tokens", "Tokens committed by verify steps.", registry=r
        ),
        verify_steps=Counter(
            "specloop_spec_verify_steps", "Rows verified (request x step).", registry=r
        ),
        verify_batches=Counter(
            "specloop_spec_verify_batches", "Target verify forwards.", registry=r
        ),
        accept_length=Histogram(
            "specloop_spec_accept_length",
            "Accepted drafted tokens per row and step.",
            buckets=tuple(range(17)),
            registry=r,
        ),
        draft_ms=Histogram(
            "specloop_spec_draft_ms",
            "Draft time per step (ms).",
            buckets=_MS_BUCKETS,
            registry=r,
        ),
        verify_ms=Histogram(
            "specloop_spec_verify_ms",
            "Verify time per step (ms).",
            buckets=_MS_BUCKETS,
            registry=r,
        ),
        batch_size=Histogram(
            "specloop_spec_batch_size",
            "Rows per verify step.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        ),
        finished=Counter(
            "specloop_requests_finished", "Finished requests.", ["reason"], registry=r
        ),
        drafter_info=Gauge(
            "specloop_drafter_info",
            "Active drafter (value 1).",
            ["kind", "version"],
            registry=r,
        ),
        pos_drafted=Counter(
            "specloop_spec_position_drafted",
            "Drafted tokens by draft position (1 = first drafted token).",
            ["position"],
            registry=r,
        ),
        pos_accepted=Counter(
            "specloop_spec_position_accepted",
            "Accepted drafted tokens by draft position.",
            ["position"],
            registry=r,
        ),
        draft_length=Histogram(
            "specloop_spec_draft_length",
            "Drafted tokens per row and step: the k the policy chose (0 = speculation off).",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16),
            registry=r,
        ),
        spec_off_rows=Counter(
            "specloop_spec_off_rows",
            "Rows verified with no draft (speculation off for that request and step).",
            registry=r,
        ),
    )


class SpecMetrics(BaseObserver):
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else REGISTRY
        self._c = _collectors(self.registry)
        self._drafter: tuple[str, str] | None = None
        self._positions: dict[tuple[int, int], Counter] = {}

    def on_step(self, batch: VerifyBatch) -> None:
        # Over Python lists: this runs on the step thread, whose caches the forward has just
        # flushed, where each numpy reduction on a few values costs ~10 us.
        c = self._c
        num_drafted, num_accepted = batch.num_drafted.tolist(), batch.num_accepted.tolist()  # [B]
        drafted, accepted = sum(num_drafted), sum(num_accepted)
        rows = len(num_drafted)
        c.drafted.inc(drafted)
        c.draft_nodes.inc(sum(batch.draft_nodes.tolist()))
        c.accepted.inc(accepted)
        c.emitted.inc(accepted + rows)
        c.verify_steps.inc(rows)
        c.verify_batches.inc()
        if batch.draft_ms is not None:  # None: not measured (SGLang), not 0 ms
            c.draft_ms.observe(batch.draft_ms)
        if batch.verify_ms is not None:
            c.verify_ms.observe(batch.verify_ms)
        c.batch_size.observe(rows)
        off = 0
        for n, a in zip(num_drafted, num_accepted):
            c.accept_length.observe(a)
            c.draft_length.observe(n)
            if n == 0:
                off += 1
            for pos in range(1, n + 1):  # acceptance per position: accepted iff pos <= a
                self._position(c.pos_drafted, pos).inc()
                if pos <= a:
                    self._position(c.pos_accepted, pos).inc()
        if off:
            c.spec_off_rows.inc(off)

    def _position(self, counter: Counter, pos: int) -> Counter:
        """``counter``'s child for draft position ``pos``, looked up once (labels() takes a lock
        and builds its key at every call; these children are never removed)."""
        key = (id(counter), pos)
        child = self._positions.get(key)
        if child is None:
            child = self._positions[key] = counter.labels(position=str(pos))
        return child

    def on_request_finish(self, request, output_ids, finish_reason, stats) -> None:
        self._c.finished.labels(reason=finish_reason or "unknown").inc()

    def on_drafter_change(self, kind: str, version: str) -> None:
        info = self._c.drafter_info
        if self._drafter is not None and self._drafter != (kind, version):
            try:
                info.remove(*self._drafter)
            except KeyError:
                pass
        self._drafter = (kind, version)
        info.labels(kind=kind, version=version).set(1)


class _PrefixCaches:
    """A registry's collector of its engines' prefix caches (serving/engine/prefix_cache.py): their
    token counters, summed, read when the registry is scraped (the caches count on the step thread;
    nothing is pushed per prefill)."""

    def __init__(self):
        self.caches: weakref.WeakSet = weakref.WeakSet()

    def collect(self):
        caches = list(self.caches)
        for name, doc, attr in (
            ("specloop_prefix_cache_hit_tokens", "Prompt tokens copied from the prefix cache.", "hit_tokens"),
            ("specloop_prefix_cache_prefilled_tokens", "Prompt tokens prefilled (not in the prefix cache).",
             "prefilled_tokens"),
        ):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], float(sum(getattr(c, attr) for c in caches)))
            yield family


@once_per_registry
def _prefix_caches(registry: CollectorRegistry) -> _PrefixCaches:
    collector = _PrefixCaches()
    registry.register(collector)
    return collector


def watch_prefix_cache(cache, registry: CollectorRegistry | None = None) -> None:
    """Export ``cache``'s hit and prefilled token counts on ``registry`` (default: the process's)."""
    _prefix_caches(registry).caches.add(cache)
