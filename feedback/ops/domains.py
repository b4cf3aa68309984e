"""The request domains serving tracks one by one: at most ``max_domains``, the rest as ``other``.

A request's ``domain`` is whatever the client sends (any string up to 128 characters,
serving/api/protocol.py). Tracked as given, every distinct string became two metric keys of the
replica's MLflow ops run (``acceptance.<domain>``, ``tokens_per_verify.<domain>``), a drift
detector state and a Prometheus label set, none ever dropped: 1,000 one-request domains made 2,003
metric keys and 1,000 detector states. ``DomainCap`` is the one place that decides which names are
tracked: the first ``max_domains`` distinct ones, for the process's life (a name once tracked keeps
its series; none is evicted, so a domain's figures never move between buckets), and every later one
under ``other``. Requests without a domain are ``default``; ``default`` and ``other`` take no place
of the ``max_domains``. Serving's ops observer and its drift observer share one cap
(serving/builder.py), so a domain is tracked, or is ``other``, in both.
"""

from __future__ import annotations

import threading

DEFAULT = "default"
"""The domain of a request that named none."""
OTHER = "other"
"""Where domains beyond the cap are counted."""
MAX_DOMAINS = 32
"""Default cap (ServingSettings.max_tracked_domains)."""


class DomainCap:
    """``cap(domain)``: the name ``domain`` is tracked under (itself, ``default`` or ``other``)."""

    def __init__(self, max_domains: int = MAX_DOMAINS):
        if max_domains < 0:
            raise ValueError(f"max_domains must be >= 0, got {max_domains}")
        self.max_domains = max_domains
        self._tracked: set[str] = set()
        self._lock = threading.Lock()
        self.overflowed = 0
        """Names counted under ``other`` (once per call: per request where observers call it)."""

    def __call__(self, domain: str | None) -> str:
        name = domain or DEFAULT
        if name in (DEFAULT, OTHER) or name in self._tracked:
            return name
        with self._lock:
            if name in self._tracked:
                return name
            if len(self._tracked) < self.max_domains:
                self._tracked.add(name)
                return name
            self.overflowed += 1
        return OTHER

    @property
    def tracked(self) -> frozenset[str]:
        """The names tracked so far (``default`` and ``other`` not included)."""
        with self._lock:
            return frozenset(self._tracked)
