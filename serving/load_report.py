"""LoadReporter: serving's half of "train on spare capacity".

Every ``every_s`` a supervised thread sends this replica's load to Redis as a LoadHeartbeat
(``ControlPlane.heartbeat``): requests waiting for a row, requests running, and tokens per second
over the last interval (counted by this object as an engine observer). The trainer's ServingLoad
(trainer/control.py) reads every live replica's heartbeat and pauses training while one is
saturated. A Redis outage only skips beats (ControlPlane calls never raise); heartbeats expire
after the control plane's ``heartbeat_ttl_s``, so a dead replica stops counting.
"""

from __future__ import annotations

import threading
import time

from feedback.background.supervise import SupervisedThread
from feedback.control.plane import ControlPlane, LoadHeartbeat
from serving.observers import BaseObserver


class LoadReporter(BaseObserver):
    def __init__(self, engine, control: ControlPlane, replica_id: str, every_s: float = 1.0):
        self.engine, self.control, self.replica_id, self.every_s = engine, control, replica_id, every_s
        self._tokens = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: SupervisedThread | None = None
        self.beats = 0

    # engine observer: tokens emitted
    def on_step(self, batch) -> None:
        n = sum(len(e) for e in batch.emitted)
        with self._lock:
            self._tokens += n

    def beat(self, interval_s: float) -> LoadHeartbeat:
        with self._lock:
            tokens, self._tokens = self._tokens, 0
        waiting, running = self.engine.load()  # the Engine protocol's (both engines)
        hb = LoadHeartbeat(replica_id=self.replica_id, queue_depth=waiting, running_requests=running,
                           tokens_per_s=tokens / max(interval_s, 1e-9))
        if self.control.heartbeat(hb, ttl_s=max(3 * self.every_s, 2.0)):
            self.beats += 1
        return hb

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.every_s):
            now = time.monotonic()
            self.beat(now - last)
            last = now

    def start(self) -> LoadReporter:
        if getattr(self.engine, "observers", None) is not None and self not in self.engine.observers:
            self.engine.observers.append(self)
        self._thread = SupervisedThread(f"load-heartbeat-{self.replica_id}", self._run, self._stop).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * self.every_s + 1)
