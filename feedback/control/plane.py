"""Redis control plane: which drafter each tenant runs, swap/rollback news, load, live acceptance.

Serving must keep serving when Redis is down, so no call here raises on a Redis error: it logs
once per outage and returns a default (None, False, zeros, []). After a failure, calls return the
default at once for ``retry_after_s`` instead of waiting on a dead socket each time.

Keys (``ns`` = namespace)::

    {ns}:drafter:{tenant}      string  current drafter version of the tenant
    {ns}:announce              channel SwapAnnouncement | RollbackAnnouncement | DriftAnnouncement as JSON
    {ns}:load:{replica_id}     string  LoadHeartbeat JSON, expires after its TTL
    {ns}:accept:{tenant}:{version}  hash  drafted / accepted / rows counters (rows: a verify
                                       step's rows, one per request in the batch)
    {ns}:deletions             hash    tenant -> time its data deletion was requested (the
                                       trainer of that tenant removes the field once done)

Acceptance counters take one round trip per call: aggregate locally and report every second or so,
not per decode step.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from feedback.background.supervise import SupervisedThread

log = logging.getLogger(__name__)
T = TypeVar("T")


class ControlSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECLOOP_REDIS_")

    url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL.")
    namespace: str = Field("specloop", description="Key prefix, so deployments can share a Redis.")
    socket_timeout_s: float = Field(0.5, description="Per command; keeps a dead Redis cheap.")
    retry_after_s: float = Field(1.0, description="After a failure, calls return defaults at once "
                                                  "for this long before trying Redis again.")
    heartbeat_ttl_s: float = Field(10.0, description="A replica missing heartbeats this long is gone.")


class SwapAnnouncement(BaseModel):
    """A new drafter version is current for a tenant (the trainer promoted it)."""

    kind: Literal["swap"] = "swap"
    tenant: str = "default"
    version: str
    previous_version: str | None = None
    drafter_kind: str | None = None
    target_key: str | None = None
    """TargetFingerprint.key() the version was trained against."""
    at: float = Field(default_factory=time.time)


class RollbackAnnouncement(BaseModel):
    """A replica saw live acceptance fall below the floor and went back to ``to_version``."""

    kind: Literal["rollback"] = "rollback"
    tenant: str = "default"
    from_version: str
    to_version: str
    reason: str = ""
    live_acceptance: float | None = None
    floor: float | None = None
    replica_id: str | None = None
    at: float = Field(default_factory=time.time)


class DriftAnnouncement(BaseModel):
    """A replica saw live acceptance on ``domain`` drop below its trailing level (feedback/ops/drift.py):
    the trainer's signal to train on that domain. Published only; no version changes."""

    kind: Literal["drift"] = "drift"
    tenant: str = "default"
    domain: str
    before: float
    now: float
    replica_id: str | None = None
    at: float = Field(default_factory=time.time)


Announcement = Annotated[SwapAnnouncement | RollbackAnnouncement | DriftAnnouncement,
                         Field(discriminator="kind")]
_ANNOUNCEMENT = TypeAdapter(Announcement)


class LoadHeartbeat(BaseModel):
    """How busy one serving replica is; the trainer trains on spare capacity."""

    replica_id: str
    queue_depth: int = 0
    running_requests: int = 0
    tokens_per_s: float = 0.0
    timestamp: float = Field(default_factory=time.time)


class AcceptanceCounts(BaseModel):
    """One tenant's drafter version, summed over replicas."""

    drafted: int = 0
    accepted: int = 0
    rows: int = 0
    """Rows verified: each verify step counts one per request in its batch."""

    @property
    def rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_row(self) -> float:
        """Emitted tokens per verify step and row (accepted + one bonus/corrected token per row)."""
        return (self.accepted + self.rows) / self.rows if self.rows else 0.0


class ControlPlane:
    """Typed, failure-tolerant access to the Redis control plane."""

    def __init__(self, settings: ControlSettings | None = None, **overrides):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.settings = s = (settings or ControlSettings()).model_copy(update=overrides)
        self._redis_errors = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(
            s.url, socket_timeout=s.socket_timeout_s, socket_connect_timeout=s.socket_timeout_s,
            retry=Retry(NoBackoff(), 0), decode_responses=True,
        )
        self._ns = s.namespace
        self._down_until = 0.0
        self._down = False
        self._lock = threading.Lock()

    @property
    def channel(self) -> str:
        return f"{self._ns}:announce"

    # ---- drafter version ----------------------------------------------------------------------

    def get_drafter_version(self, tenant: str = "default") -> str | None:
        return self._call(lambda r: r.get(self._key("drafter", tenant)), None)

    def set_drafter_version(self, tenant: str, version: str) -> bool:
        return self._call(lambda r: bool(r.set(self._key("drafter", tenant), version)), False)

    # ---- announcements ------------------------------------------------------------------------

    def announce_swap(self, msg: SwapAnnouncement) -> bool:
        """Make ``msg.version`` the tenant's current version and publish it, atomically."""
        return self._announce(msg, msg.version)

    def announce_rollback(self, msg: RollbackAnnouncement) -> bool:
        """Make ``msg.to_version`` current again and publish why, atomically."""
        return self._announce(msg, msg.to_version)

    def announce_drift(self, msg: DriftAnnouncement) -> bool:
        """Publish an acceptance drift (subscribers: trainers; Swappers ignore it)."""
        return self._call(lambda r: r.publish(self.channel, msg.model_dump_json()) >= 0, False)

    def subscribe(self, callback: Callable[[SwapAnnouncement | RollbackAnnouncement | DriftAnnouncement], None]
                  | None = None) -> AnnouncementSubscription:
        """Receive announcements on a background thread (reconnects after Redis outages)."""
        return AnnouncementSubscription(self, callback)

    def _announce(self, msg: BaseModel, version: str) -> bool:
        def run(r):
            pipe = r.pipeline(transaction=True)
            pipe.set(self._key("drafter", msg.tenant), version)
            pipe.publish(self.channel, msg.model_dump_json())
            pipe.execute()
            return True

        return self._call(run, False)

    # ---- load heartbeats ----------------------------------------------------------------------

    def heartbeat(self, beat: LoadHeartbeat, ttl_s: float | None = None) -> bool:
        ttl_ms = int((ttl_s or self.settings.heartbeat_ttl_s) * 1000)
        key = self._key("load", beat.replica_id)
        return self._call(lambda r: bool(r.set(key, beat.model_dump_json(), px=ttl_ms)), False)

    def loads(self) -> list[LoadHeartbeat]:
        """Heartbeats of every live replica (expired ones are gone)."""
        def run(r):
            keys = sorted(r.scan_iter(match=self._key("load", "*"), count=100))
            values = r.mget(keys) if keys else []
            return [LoadHeartbeat.model_validate_json(v) for v in values if v is not None]

        return self._call(run, [])

    # ---- live acceptance ----------------------------------------------------------------------

    def record_acceptance(self, tenant: str, version: str, drafted: int, accepted: int,
                          rows: int = 0) -> bool:
        """Add to ``tenant``'s counts of ``version`` (every tenant has its own "day0", "1", ...)."""
        def run(r):
            pipe = r.pipeline(transaction=True)
            key = self._key("accept", tenant, version)
            pipe.hincrby(key, "drafted", int(drafted))
            pipe.hincrby(key, "accepted", int(accepted))
            pipe.hincrby(key, "rows", int(rows))
            pipe.execute()
            return True

        return self._call(run, False)

    def acceptance(self, tenant: str, version: str) -> AcceptanceCounts:
        def run(r):
            raw = r.hgetall(self._key("accept", tenant, version))
            return AcceptanceCounts(**{k: int(v) for k, v in raw.items()})

        return self._call(run, AcceptanceCounts())

    # ---- plumbing -----------------------------------------------------------------------------

    # ---- data deletion requests ---------------------------------------------------------------

    def request_deletion(self, tenant: str) -> bool:
        """Ask the tenant's trainer to delete its traces (replay and checkpoints)."""
        return self._call(lambda r: r.hset(self._key("deletions"), tenant, str(time.time())) >= 0,
                          False)

    def pending_deletions(self, tenant: str | None = None) -> list[str]:
        """Tenants whose deletion is requested and not yet done (only ``tenant``, if given)."""
        names = self._call(lambda r: sorted(r.hkeys(self._key("deletions"))), [])
        return [n for n in names if tenant is None or n == tenant]

    def deletion_requested_at(self, tenant: str) -> float | None:
        """When ``tenant``'s pending deletion was requested (epoch seconds); None when none is
        pending (never asked, or its trainer is done) or Redis is away."""
        at = self._call(lambda r: r.hget(self._key("deletions"), tenant), None)
        return float(at) if at is not None else None

    def complete_deletion(self, tenant: str) -> bool:
        return self._call(lambda r: r.hdel(self._key("deletions"), tenant) >= 0, False)

    def ping(self) -> bool:
        return self._call(lambda r: bool(r.ping()), False)

    def close(self) -> None:
        try:
            self._client.close()
        except self._redis_errors:
            pass

    def _key(self, *parts: str) -> str:
        return ":".join((self._ns, *parts))

    def _call(self, fn: Callable[..., T], default: T) -> T:
        if time.monotonic() < self._down_until:
            return default
        try:
            result = fn(self._client)
        except self._redis_errors as e:
            with self._lock:
                self._down_until = time.monotonic() + self.settings.retry_after_s
                if not self._down:
                    self._down = True
                    log.warning("redis control plane unavailable (%s); serving goes on with "
                                "defaults until it is back", e)
            return default
        except ValidationError as e:  # garbage in a key we own: treat as missing, never raise
            log.warning("bad control-plane value: %s", e)
            return default
        if self._down:
            with self._lock:
                self._down = False
            log.warning("redis control plane is back")
        return result


class AnnouncementSubscription:
    """Announcements from a background thread: a callback, or ``get()`` / iteration."""

    def __init__(self, control: ControlPlane, callback=None):
        self._control = control
        self._callback = callback
        self._queue: queue.Queue = queue.Queue(maxsize=1000)
        self._stop = threading.Event()
        self._subscribed = threading.Event()
        # supervised: anything but a Redis error (handled below) restarts the subscriber
        self._thread = SupervisedThread("control-subscriber", self._run, self._stop).start()

    def wait_subscribed(self, timeout: float = 5.0) -> bool:
        """True once the subscription is live (announcements published before are not seen)."""
        return self._subscribed.wait(timeout)

    def get(self, timeout: float | None = None) -> Announcement | None:
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def __iter__(self) -> Iterator[Announcement]:
        while not self._stop.is_set():
            msg = self.get(timeout=0.2)
            if msg is not None:
                yield msg

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        warned = False
        while not self._stop.is_set():
            pubsub = None
            try:
                pubsub = self._control._client.pubsub()
                pubsub.subscribe(self._control.channel)
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.2)
                    if msg is None:
                        continue
                    if msg.get("type") == "subscribe":  # the server confirmed: now live
                        self._subscribed.set()
                        if warned:
                            log.warning("announcement subscription restored")
                            warned = False
                    elif msg.get("type") == "message":
                        self._deliver(msg["data"])
            except self._control._redis_errors as e:
                self._subscribed.clear()
                if not warned:
                    log.warning("announcement subscription lost (%s); retrying", e)
                    warned = True
                self._stop.wait(self._control.settings.retry_after_s)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()

    def _deliver(self, data: str) -> None:
        try:
            msg = _ANNOUNCEMENT.validate_json(data)
        except ValidationError as e:
            log.warning("ignoring malformed announcement: %s", e)
            return
        if self._callback is not None:
            try:
                self._callback(msg)
            except Exception:
                log.exception("announcement callback failed")
        else:
            try:
                self._queue.put_nowait(msg)
            except queue.Full:
                log.warning("announcement queue full; dropping %s", msg.kind)
