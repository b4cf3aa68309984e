"""Retention: traces past their age leave the replay and every checkpoint; a tenant's deletion
request empties its traces from the replay and the checkpoints (and is acknowledged only then)."""

from __future__ import annotations

import json
import struct
import time

import pytest
from trainer_tracegen import FP, make_trace, tiny_lm

from feedback.bus import codec
from trainer import checkpoint
from trainer.distill import DistillConfig
from trainer.gate import GateConfig
from trainer.loop import LoopConfig, TrainerLoop
from trainer.replay import ReplayBuffer
from trainer.sources import ListTraceSource
from trainer.students import StandaloneStudent


def _aged(rec, age_s):
    return rec.model_copy(update={"finished_at": time.time() - age_s})


def _on_disk(root) -> set[str]:
    """Request ids in every checkpoint's replay.bin under ``root``."""
    ids = set()
    for path in checkpoint.all_checkpoints(root):
        data, i = (path / "replay.bin").read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack_from("<I", data, i)
            ids.add(codec.decode(data[i + 4:i + 4 + n]).request_id)
            i += 4 + n
    return ids


def _loop(src, root, replay=None, tenant="default", **kw):
    return TrainerLoop(src, StandaloneStudent(tiny_lm(seed=0)), FP,
                       loop=LoopConfig(tenant=tenant, poll_records=20, min_train_traces=8, steps_per_round=2,
                                       rounds_per_gate=100, checkpoint_dir=str(root), checkpoint_keep=3),
                       distill=DistillConfig(lr=3e-3, eval_every=2), gate=GateConfig(k=3, hybrid=False),
                       replay=replay, **kw)


def test_replay_refuses_and_expires_old_traces():
    replay = ReplayBuffer(max_age_s=60, min_heldout=0)
    assert not replay.add(_aged(make_trace("a", seed=1), 120))
    assert replay.rejected["expired"] == 1
    fresh = [_aged(make_trace("a", seed=i), 30) for i in range(2, 12)]
    replay.extend(fresh)
    n = len(replay) + len(replay.heldout)
    assert n == 10
    assert replay.expire(now=time.time() + 45) == 10  # all are past 60 s now
    assert len(replay) == 0 and replay.heldout == []


def test_expired_traces_leave_the_replay_and_every_checkpoint(tmp_path):
    old = [_aged(make_trace("a", seed=i), 50) for i in range(20)]
    new = [make_trace("a", seed=100 + i) for i in range(20)]
    src = ListTraceSource(old + new)
    replay = ReplayBuffer(max_age_s=3600, fingerprint=FP)
    loop = _loop(src, tmp_path, replay)
    loop.run_round()
    loop.run_round()
    root = loop.checkpoint_root
    assert {r.request_id for r in old} <= _on_disk(root)
    replay.max_age_s = 40  # the configured age passes for the old ones
    assert loop.apply_retention() == 20
    assert not ({r.request_id for r in old} & _on_disk(root))
    assert len(checkpoint.all_checkpoints(root)) == 1  # older ones held the expired traces


class _Deletions:
    def __init__(self, tenants):
        self.tenants, self.completed = list(tenants), []

    def pending_deletions(self, tenant=None):
        return [t for t in self.tenants if tenant is None or t == tenant]

    def complete_deletion(self, tenant):
        self.tenants.remove(tenant)
        self.completed.append(tenant)


def test_a_tenant_deletion_request_empties_its_traces_everywhere(tmp_path):
    recs = [make_trace("a", seed=i, tenant="acme") for i in range(30)]
    src = ListTraceSource(recs)
    deletions = _Deletions([])
    loop = _loop(src, tmp_path, ReplayBuffer(fingerprint=FP, tenant="acme"), tenant="acme",
                 deletions=deletions)
    loop.run_round()
    assert _on_disk(loop.checkpoint_root)
    deletions.tenants.append("acme")  # the admin route asked for it
    loop.run_round()
    assert deletions.completed == ["acme"]
    deleted = {r.request_id for r in recs[:20]}  # what it held when the request came
    kept = {r.request_id for r in loop.replay.train_records} | {r.request_id for r in loop.replay.heldout}
    assert not (deleted & kept)
    assert not (deleted & _on_disk(loop.checkpoint_root))


@pytest.mark.integration
def test_control_plane_carries_deletion_requests(redis_server, redis_namespace):
    from feedback.control.plane import ControlPlane

    control = ControlPlane(url=redis_server.url, namespace=redis_namespace)
    assert control.request_deletion("acme") and control.request_deletion("beta")
    assert control.pending_deletions("acme") == ["acme"]
    assert control.pending_deletions() == ["acme", "beta"]
    control.complete_deletion("acme")
    assert control.pending_deletions() == ["beta"]


def _legacy_checkpoint(root, tenant: str, saved_ago_s: float = 0.0, identity: bool = False):
    """A checkpoint of the earlier layout (directly in ``root``) holding ``tenant``'s traces, saved
    ``saved_ago_s`` ago; with ``identity`` it records one, as the loop's own do."""
    replay = ReplayBuffer(fingerprint=FP, tenant=tenant, min_heldout=0)
    replay.extend([make_trace("a", seed=500 + i, tenant=tenant) for i in range(4)])
    old = _loop(ListTraceSource([]), root / "unused", tenant=tenant)
    ident = checkpoint.identity(tenant, "standalone", FP) if identity else None
    path = checkpoint.save(root, old.distiller, replay, ident=ident)
    meta = json.loads((path / "meta.json").read_text())
    meta["saved_at"] -= saved_ago_s
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_a_deletion_request_reaches_the_earlier_layouts_checkpoints(tmp_path):
    """They are never loaded, and were never purged either: a tenant's traces stayed on disk after
    its deletion was acknowledged, whether or not the replay still held any of them."""
    unkeyed = _legacy_checkpoint(tmp_path, "acme")  # the earlier layout recorded no tenant
    other = _legacy_checkpoint(tmp_path, "beta", identity=True)
    deletions = _Deletions([])
    loop = _loop(ListTraceSource([make_trace("a", seed=i, tenant="acme") for i in range(20)]), tmp_path,
                 ReplayBuffer(fingerprint=FP, tenant="acme"), tenant="acme", deletions=deletions)
    loop.run_round()
    assert unkeyed.exists() and other.exists()  # kept until retention reaches them
    deletions.tenants.append("acme")
    loop.run_round()
    assert deletions.completed == ["acme"]
    assert not unkeyed.exists() and other.exists()  # another tenant's, recorded as such, stays
    loop.delete_tenant("beta")  # the direct path too
    assert not other.exists()


def test_the_retention_window_reaches_the_earlier_layouts_checkpoints(tmp_path):
    expired = _legacy_checkpoint(tmp_path, "acme", saved_ago_s=7200)
    recent = _legacy_checkpoint(tmp_path, "acme", saved_ago_s=60)
    loop = _loop(ListTraceSource([]), tmp_path, ReplayBuffer(max_age_s=3600, fingerprint=FP), tenant="acme")
    assert loop.apply_retention() == 0  # nothing in the replay: the pass still looks at them
    assert not expired.exists() and recent.exists()
