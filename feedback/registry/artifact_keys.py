"""Names the trainer and serving share in the registry: the day-0 version and the keys of
an artifact's ``extra`` (config.json), so that neither side spells them on its own."""

DAY0_VERSION = "day0"
"""The version a server calls the drafter it starts with, before any promotion."""

# Keys of an artifact's ``extra`` that the trainer writes and serving reads.
EXTRA_HELDOUT_ACCEPTANCE = "heldout_acceptance"
"""Held-out expected acceptance of a one-token draft (serving's acceptance prior for the version)."""
EXTRA_CHAMPION_HELDOUT_ACCEPTANCE = "champion_heldout_acceptance"
"""The gate's champion's, on the same held-out traces."""
EXTRA_WINDOW_TRACES = "window_traces"
"""Traces the version was the first trained on."""
EXTRA_TRACE_FINISHED_MEDIAN_AT = "trace_finished_median_at"
"""When their requests finished (epoch s): the median, where serving's freshness figure starts."""
EXTRA_TRACE_FINISHED_NEWEST_AT = "trace_finished_newest_at"
"""... and the newest."""


def trace_times(extra: dict) -> dict[str, float]:
    """When the requests of the traces a version was the first trained on finished, from its
    artifact's ``extra`` (trainer/lineage.py; {} for an artifact that records none): what a served
    drafter carries as ``trace_times`` for the Swapper's freshness figures, under either engine."""
    keys = (EXTRA_TRACE_FINISHED_MEDIAN_AT, EXTRA_TRACE_FINISHED_NEWEST_AT)
    return {k: float(extra[k]) for k in keys if isinstance(extra.get(k), (int, float))}
