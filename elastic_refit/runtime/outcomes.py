"""The outcomes of versions as one member saw them: where callers wait.

``publish``, ``PublishHandle.wait``, ``wait_for_version`` and ``weights`` block here, on one
condition, never on a poll. The driver records commits and failures as the version state
changes; other parts (the trainer's published versions, the serving slot) call
:meth:`Outcomes.changed` after a change a caller may wait for, and a waiter's ``ready``
reads their state through their own locks (this lock is always taken first).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from elastic_refit._validate import check_timeout
from elastic_refit.errors import (
    RefitError,
    RefitFailed,
    RefitTimeout,
    VersionUnreachable,
    drop_frames,
    raise_latched,
)
from elastic_refit.membership.versions import Commit, Failure

__all__ = ["Outcomes", "PublishHandle"]

T = TypeVar("T")

_VERSIONS_REMEMBERED = 64  # commit and failure records a member keeps (memory flat over a long run)


class Outcomes:
    """Committed and failed versions, this rank's latest fault, the latched error of the
    agent, and whether the context is closing."""

    def __init__(self, member_id: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.member_id = member_id
        self._clock = clock
        self._cond = threading.Condition()
        self._committed: dict[int, Commit] = {}
        self._failed: dict[int, Failure] = {}
        self._last_fault: tuple[float, str] | None = None  # (clock time, cause)
        self._error: BaseException | None = None
        self._stranded: tuple[int, str] | None = None  # (committed version, why it cannot reach this rank)
        self._closed = False

    # ---- what the driver records ----------------------------------------------------------
    def record(self, committed: Mapping[int, Commit], failed: Mapping[int, Failure]) -> int:
        """Take in commit and failure records; returns the latest version that is over
        (committed or failed; -1: none)."""
        with self._cond:
            self._committed.update(committed)
            self._failed.update(failed)
            # Bounded like etcd's version state: a waiter of an older version sees a newer
            # commit (committed "at least"), long after it could have seen its own record.
            for seen in (self._committed, self._failed):
                for v in sorted(seen)[:-_VERSIONS_REMEMBERED]:
                    del seen[v]
            self._cond.notify_all()
            return max([*self._committed, *self._failed], default=-1)

    def note_fault(self, cause: str) -> None:
        """This rank's latest fault, named by a later ``RefitTimeout``."""
        with self._cond:
            self._last_fault = (self._clock(), cause)

    def strand(self, version: int | None, cause: str = "") -> None:
        """Committed ``version`` cannot reach this rank for ``cause`` (None: it can, or a
        newer version is on its way): waiters for it raise ``VersionUnreachable``."""
        with self._cond:
            stranded = None if version is None else (version, cause)
            if stranded != self._stranded:
                self._stranded = stranded
                self._cond.notify_all()

    def latch(self, exc: BaseException) -> None:
        """The agent failed for good: every waiter raises ``exc`` (a copy) from now on."""
        with self._cond:
            self._error = drop_frames(exc)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def changed(self) -> None:
        """Another part changed what a waiter may be waiting for: wake the waiters."""
        with self._cond:
            self._cond.notify_all()

    # ---- reads (waiters' ``ready`` run under the lock) -------------------------------------
    def latest_committed(self) -> int | None:
        """The newest version this member saw committed (None: none)."""
        with self._cond:
            return max(self._committed, default=None)

    def committed_at_least(self, version: int) -> Commit | None:
        """The commit of the oldest version >= ``version`` (a newer one supersedes it)."""
        with self._cond:
            done = [c for v, c in self._committed.items() if v >= version]
        return min(done, key=lambda c: c.version) if done else None

    def raise_if_failed(self, version: int | None) -> None:
        """Raise ``RefitFailed`` if ``version`` failed; for ``None`` (any version), if the
        job committed nothing and its newest version over failed: the cause is why there is
        nothing to serve (a refused version never commits, and none before it did). Raise
        ``VersionUnreachable`` if the latest committed version, at least ``version``, cannot
        reach this rank (see :meth:`strand`)."""
        with self._cond:
            failure = self._job_failure() if version is None else self._failed.get(version)
            stranded = self._stranded
        if failure is not None:
            raise RefitFailed(failure.version, failure.cause, failure.num_attempts, epoch=failure.epoch)
        if stranded is not None and (version is None or version <= stranded[0]):
            raise VersionUnreachable(stranded[0], stranded[1], member_id=self.member_id)

    def outcome(self, version: int) -> Commit | None:
        """The commit ``version`` came to (or a newer one), or raise its failure; None while
        it is pending."""
        self.raise_if_failed(version)
        return self.committed_at_least(version)

    def wait_for(self, ready: Callable[[], T | None], timeout_s: float, what: str) -> T:
        """``ready()`` once it is not None (it may raise, e.g. ``RefitFailed``), else
        ``RefitTimeout`` naming ``what`` and this rank's latest fault."""
        deadline = self._clock() + timeout_s
        with self._cond:
            while True:
                if self._error is not None:
                    raise_latched(self._error)
                value = ready()
                if value is not None:
                    return value
                if self._closed:
                    raise RefitError(f"{self.member_id}: closed while waiting for {what}")
                left = deadline - self._clock()
                if left <= 0:
                    raise RefitTimeout(what, timeout_s, member_id=self.member_id, last_failure=self._last_failure())
                self._cond.wait(left)

    def _job_failure(self) -> Failure | None:
        """(Under the lock.) The newest failed version, when no version committed."""
        if self._committed or not self._failed:
            return None
        return self._failed[max(self._failed)]

    def _last_failure(self) -> str | None:
        """This rank's latest fault and the job's newest failed version newer than every
        commit (a cause found on another member reaches a timeout here too)."""
        parts = []
        if self._last_fault is not None:
            at, cause = self._last_fault
            parts.append(f"{cause} ({self._clock() - at:.1f} s ago)")
        newest = max(self._failed, default=-1)
        if newest > max(self._committed, default=-1):
            failure = self._failed[newest]
            parts.append(f"the job's version {newest} failed: {failure.cause}")
        return "; ".join(parts) or None


class PublishHandle:
    """What ``ElasticRefit.publish(..., wait=False)`` returns: the version's way to its commit.

    ``done()`` says whether it is over; ``wait(timeout_s)`` (and ``result()``) returns its
    :class:`~elastic_refit.membership.versions.Commit`, which is a later version's when a
    newer one superseded it, or raises what ``publish`` would (``RefitFailed``,
    ``RefitTimeout``)."""

    def __init__(self, outcomes: Outcomes, version: int, timeout_s: float, commit: Commit | None = None) -> None:
        self.version = version
        self._outcomes = outcomes
        self._timeout_s = timeout_s
        self._commit = commit

    def _outcome(self) -> Commit | None:
        if self._commit is None:
            self._commit = self._outcomes.outcome(self.version)
        return self._commit

    def done(self) -> bool:
        try:
            return self._outcome() is not None
        except RefitError:
            return True

    def wait(self, timeout_s: float | None = None) -> Commit:
        timeout_s = check_timeout("timeout_s", timeout_s)
        return self._outcomes.wait_for(self._outcome, self._timeout_s if timeout_s is None else timeout_s,
                                       f"version {self.version} to commit")

    def result(self) -> Commit:
        return self.wait()

    def __repr__(self) -> str:
        return f"PublishHandle(version={self.version}, done={self.done()})"
