"""Typed runtime faults. Bad user input raises ``ValueError`` instead."""

from __future__ import annotations


class RefitError(RuntimeError):
    """Base class of runtime faults during a refit."""


class TransportAborted(RefitError):
    """A transfer could not complete: a peer died, timed out, or the group was aborted."""

    def __init__(self, message: str, *, rank: int | None = None, peer: int | None = None,
                 phase: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.phase = phase


class PlanMismatch(RefitError):
    """Ranks computed different plans (fingerprints differ) for the same epoch."""


class VerificationFailed(RefitError):
    """A digest of received bytes differs from the sender's: corrupted or missing data."""
