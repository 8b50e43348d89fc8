"""Typed runtime faults of the membership layer.

``ValueError`` stays reserved for bad user input; everything here is a fault the runtime
may catch and recover from (re-join, wait for the next epoch, rebuild a communicator).
Every one is a :class:`~elastic_refit.errors.RefitError`, so ``except RefitError`` catches
them with the runtime's own faults. :class:`MembershipLost` is the one of
``elastic_refit.errors`` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence

from elastic_refit.errors import MembershipLost, RefitError

__all__ = ["CommunicatorError", "EpochTimeout", "EtcdUnavailable", "FencedWrite", "IdentityClash", "JobStateLost", "LeadershipLost",
           "MembershipError", "MembershipLost", "RunClash", "StoreTimeout"]


class MembershipError(RefitError):
    """Base class of the membership layer's faults (``MembershipLost`` is a ``RefitError``
    defined with the runtime's faults)."""


class EtcdUnavailable(MembershipError):
    """etcd could not be reached (after retries) at any of the given endpoints."""

    def __init__(self, endpoints: Sequence[str], operation: str, cause: BaseException | None):
        self.endpoints = tuple(endpoints)
        self.operation = operation
        self.cause = cause
        detail = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        super().__init__(
            f"etcd unreachable at {', '.join(self.endpoints)} during {operation}{detail}"
        )


class EtcdAccessDenied(MembershipError):
    """etcd refused the request: the credentials are wrong or missing (authentication), or
    the user's roles do not cover the key (permission). Not retried."""

    def __init__(self, endpoints: Sequence[str], operation: str, detail: str):
        self.endpoints = tuple(endpoints)
        self.operation = operation
        super().__init__(f"etcd at {', '.join(self.endpoints)} refused {operation}: {detail}")


class FencedWrite(MembershipError):
    """A write was rejected because the writer's fencing token is stale.

    Raised to a leader whose token no longer matches the ``leader`` key, or to a member
    whose registration no longer owns its key.
    """


class IdentityClash(MembershipError):
    """A member tried to register under a ``member_id`` that a live member of the other
    role holds: every member of a job needs its own id. Raised at start, before it joins."""


class RunClash(MembershipError):
    """A member started with an explicit run id (``RefitConfig.run_id``) found its job's name
    held by another run id: a second run reuses the job's name. Raised at start, before it
    registers (its lease is revoked); the message names the job, both runs and the fix."""


# What every JobStateLost says after its cause (membership.revisions, runtime.rejoin).
JOB_STATE_LOST_ADVICE = ("going on could commit or serve versions out of order, so this member stops. Start the "
                         "job again under a new name (or after `elastic-refit job reset`)")


class JobStateLost(MembershipLost):
    """The job's control state in etcd is not the one this member joined (its run id is
    gone or another): etcd was wiped or restored from another state. Going on could commit
    or serve versions out of order, so the member stops; start the job again (a new job
    name, or ``elastic-refit job reset`` first)."""


class LeadershipLost(FencedWrite):
    """The leader lost its ``leader`` key (lease expiry or takeover) before a write."""


class EpochTimeout(MembershipError):
    """No epoch satisfying the wait condition was published before the deadline."""


class CommunicatorError(MembershipError):
    """A communicator could not be built, shrunk, grown or aborted."""


class StoreTimeout(MembershipError, TimeoutError):
    """A rendezvous key did not appear in the etcd-backed store before the timeout."""
