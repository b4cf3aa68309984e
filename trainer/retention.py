"""Data retention for the trainer's replay: traces past the replay's ``max_age_s``, and those of
tenants whose deletion was requested, leave the replay and then every checkpoint (``purge``: the
caller rewrites its checkpoint and deletes the older ones, which still hold them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from trainer.replay import ReplayBuffer

log = logging.getLogger(__name__)


def apply_retention(replay: ReplayBuffer, deletions, tenant: str, purge: Callable[[], None],
                    purge_elsewhere: Callable[[list[str]], None] = lambda tenants: None) -> int:
    """Drop expired traces and those of ``deletions.pending_deletions(tenant)``; when anything
    went or a deletion was asked, ``purge()`` (older checkpoints may hold a deleted tenant's traces
    that have left the replay since), and ``purge_elsewhere(deleted tenants)`` at every pass (the
    earlier layout's checkpoints: expired ones, and a deleted tenant's); only then
    ``deletions.complete_deletion`` each tenant. Returns the traces dropped. ``deletions``: None for
    none (feedback.control.plane.ControlPlane)."""
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
    if dropped or done:
        purge()
    purge_elsewhere(done)
    for t in done:  # only once the checkpoints no longer hold its traces
        deletions.complete_deletion(t)
    return dropped
