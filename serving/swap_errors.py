"""The Swapper's errors; the admin API maps each to its HTTP ``status``."""

from __future__ import annotations


class SwapError(Exception):
    status = 409


class UnknownVersion(SwapError):
    status = 404


class RefusedArtifact(SwapError):
    """The artifact failed validation; it is never served."""

    status = 422


class RegistryUnavailable(SwapError):
    status = 503


class NothingToRollBack(SwapError):
    status = 409
