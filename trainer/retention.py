"""Data retention for the trainer's replay: traces past the replay's ``max_age_s``, and those of
tenants whose deletion was requested, leave the replay and then every checkpoint (``purge``: the
caller rewrites its checkpoint and deletes the older ones, which still hold them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from trainer.replay import ReplayBuffer

log = logging.getLogger(__name__)


def apply_retention(replay: ReplayBuffer, deletions, tenant: str, purge: Callable[[], None]) -> int:
    """Drop expired traces and those of ``deletions.pending_deletions(tenant)``; when anything
    went, ``purge()``, and only then ``deletions.complete_deletion`` each tenant. Returns the
    traces dropped. ``deletions``: None for none (feedback.control.plane.ControlPlane)."""
    dropped = replay.expire()
    done = []
    if deletions is not None:
        try:
            for t in deletions.pending_deletions(tenant):
                dropped += replay.delete_tenant(t)
                done.append(t)
        except Exception:  # control plane away: retried next round
            log.warning("could not read deletion requests", exc_info=True)
    if dropped:
        log.info("retention: dropped %d traces (%s)", dropped, ", ".join(done) or "expired")
        purge()
    for t in done:  # only once the checkpoints no longer hold its traces
        deletions.complete_deletion(t)
    return dropped
