"""What a Swapper (serving/swap.py) follows: the announcements on Redis and the MLflow champion
alias it polls as their fallback.

- A swap announcement of the tenant: the version announced, watched after its swap.
- Another replica's rollback of the version live here: back to the version it rolled back to.
  Where that is this replica's previous drafter, as a rollback of its own (which moves the alias
  and announces too; neither changes anything twice). Otherwise without a watch (the version it
  replaced is the one rolled back: nothing to compare with, nor to roll back to); and where the
  version announced is not a registry version (a rollback to day 0), this replica's own day-0
  drafter, which the Swapper keeps from its start: the registry has nothing to download.
- The champion alias moved since the last poll: the version it names; taken off (a rollback to
  day 0, where the announcement was missed): the day-0 drafter, where the version the alias was
  on is live here.

``SwapFollower`` is the Swapper's half that does this: it reads and changes the Swapper's state
(``_current``, ``_previous``, ``_start``, ``_watch``, ``_rejected``, ``_last_champion``) under its
``_op_lock``, as the Swapper's own operations do.
"""

from __future__ import annotations

import logging

from serving.registry_fetch import is_registry_version
from serving.swap_errors import NothingToRollBack, RegistryUnavailable, SwapError

log = logging.getLogger(__name__)


class SwapFollower:
    def poll_once(self) -> None:
        """Fallback: swap to the champion alias when it moved since the last look."""
        if self.registry is None:
            return
        try:
            reg = self.registry.champion(self.config.tenant)
        except Exception as e:  # noqa: BLE001  (MLflow down: keep serving what we have)
            self._warn_once("poll", f"champion alias unavailable: {e}")
            return
        self._warned.discard("poll")
        self._freshness.alias_read(reg.version if reg else None)
        if reg is None:  # no champion (a rollback to day 0 took the alias off): day 0 again
            if self._last_champion not in (None, self._start.version):
                last, self._last_champion = self._last_champion, self._start.version
                self._return_to_start("champion alias taken off", last)
            return
        if reg.version == self._last_champion:
            return
        self._last_champion = reg.version
        self._try_swap(reg.version, "champion alias")

    def _on_announcement(self, msg) -> None:
        if msg.tenant != self.config.tenant:
            return
        if msg.kind == "swap":
            self._last_champion = msg.version
            self._try_swap(msg.version, "announcement")
        elif (msg.kind == "rollback" and msg.replica_id != self.config.replica_id
              and msg.from_version == self._current.version):
            prev = self._previous
            if prev is not None and prev.version == msg.to_version:
                try:
                    self.rollback(reason=f"announced by {msg.replica_id}: {msg.reason}",
                                  from_version=msg.from_version)
                except NothingToRollBack:
                    pass
                return
            self._rejected[msg.from_version] = "rolled back"
            if msg.to_version == self._start.version or not is_registry_version(msg.to_version):
                self._return_to_start(f"rollback announced by {msg.replica_id}", msg.from_version)
            else:
                self._try_swap(msg.to_version, "rollback announcement", watch=False)

    def _return_to_start(self, reason: str, from_version: str) -> None:
        """Reinstall the drafter the Swapper started with, where ``from_version`` is live (no
        download: the registry does not hold it). Not watched; nothing to roll back to."""
        with self._op_lock:
            old = self._current
            if old.version != from_version or old is self._start:
                return
            self._install(self._start, None)
            self._watch.end()
            self.swaps += 1
            self._c.swaps.inc()
            self._event("swap", version=self._start.version, previous_version=old.version,
                        reason=reason)
        self.records.note_event(old.version, f"left on {self.config.replica_id} for "
                                             f"{self._start.version}: {reason}")
        log.warning("drafter %s -> %s (%s)", old.version, self._start.version, reason)

    def _try_swap(self, version: str, reason: str, watch: bool = True) -> None:
        try:
            self.swap_to(version, reason=reason, force=False, watch=watch)
        except SwapError as e:
            if isinstance(e, RegistryUnavailable):  # no verdict on the version: fetch it again
                self._last_champion = None  # at the next poll
            log.warning("swap to %s (%s) not done: %s", version, reason, e)
