"""The coordinator: rank 0 of an epoch tidies the attempts before it (count, prune),
commits what every live inference rank holds, proposes the next attempt, refuses a version
whose sources disagree, and gives a version up after ``max_attempts`` consecutive failures
for one cause.

Its memory is frozen data (``CoordinatorState``) and its decisions are the pure functions
of ``runtime.coordination``; :class:`Coordinator` only reads etcd for them and carries out
what they decide.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from dataclasses import replace

from elastic_refit.errors import brief
from elastic_refit.membership import EtcdStore, MembershipLost, MembershipView
from elastic_refit.membership.attempts import Done
from elastic_refit.membership.versions import VersionState
from elastic_refit.runtime.agent import NextAttempt
from elastic_refit.runtime.attempt import CommitAction
from elastic_refit.runtime.coordination import (
    CoordinatorState,
    Proposal,
    Propose,
    Refuse,
    coordinate,
    coordinator_tidy,
    counted,
    forget_settled,
    proposed,
)
from elastic_refit.runtime.deltas import with_deltas
from elastic_refit.runtime.planning import AttemptPlanner, coordinator_checks
from elastic_refit.runtime.services import Services

__all__ = ["Coordinator"]


class Coordinator:
    """Rank 0's duties in the current epoch (called by the driver's agent thread)."""

    def __init__(self, services: Services, planner: AttemptPlanner) -> None:
        self.services = services
        self.planner = planner
        self._lock = threading.Lock()  # the state is replaced whole; the lock orders replacements
        self._state = CoordinatorState()

    @property
    def state(self) -> CoordinatorState:
        return self._state

    def _set(self, state: CoordinatorState) -> None:
        with self._lock:
            self._state = state

    def move(self, view: MembershipView, seq: int, versions: VersionState) -> NextAttempt | None:
        """Commit what is complete, else propose the next attempt (or refuse a version whose
        sources disagree). Returns the attempt it proposed, if it did."""
        s = self.services
        store = s.manager.store
        state = self._state
        previous = self.services.ledger.finished(store, view.epoch, seq - 1, s.known(view.epoch)) if seq > 0 else None
        tidy = coordinator_tidy(view.epoch, seq, previous_finished=seq == 0 or previous is not None,
                                uncounted=(state.uncounted.view.epoch, state.uncounted.seq)
                                if state.uncounted is not None else None,
                                pruned=state.pruned, has_store=store is not None,
                                previous_absent=previous is not None and previous.absent)
        if not tidy.proceed:
            return None
        if tidy.count is not None and state.uncounted is not None:
            pending = state.uncounted
            self._set(replace(state, uncounted=None))
            own = previous.done if previous is not None and pending.seq == seq - 1 else None
            self._count(pending, store, view, done=own)
        if tidy.prune is not None and store is not None:
            s.ledger.prune(view.epoch, tidy.prune, store)
            self._set(replace(self._state, pruned=(view.epoch, tidy.prune)))
        if tidy.reread and previous is not None:
            versions = self._state_including(previous.acks_revision)
        self._set(forget_settled(self._state, versions))
        move = coordinate(view, seq, versions, **coordinator_checks(self.planner, view, versions))
        if isinstance(move, Propose):  # who may be sent the change against the latest commit
            move = replace(move, spec=with_deltas(move.spec, view, versions))  # as the members' records say
        return self._carry_out(view, move, versions)

    def _carry_out(self, view: MembershipView, move: object, versions: VersionState) -> NextAttempt | None:
        s = self.services
        if isinstance(move, Refuse):
            if s.versions.fail(s.membership, move.version, view.epoch, move.cause, 0):
                s.log.error("refit.version.refused", version=move.version, cause=move.reason)
        elif isinstance(move, CommitAction):
            s.fire("commit.before", version=move.version, epoch=view.epoch)
            if s.versions.commit(s.membership, move.version, view.epoch, move.digest,
                                 sources=versions.source_digests.get(move.version, {})):
                s.log.info("refit.version.committed", version=move.version, epoch=view.epoch, digest=move.digest)
                # etcd holds O(ranks) version keys however long the job runs (VersionStore.prune)
                num_versions = s.versions.prune(s.membership, view.epoch, versions, move.version)
                if num_versions:
                    s.log.info("refit.versions.pruned", below=move.version, num_versions=num_versions)
        # The proposal is created only if absent (its transaction compares): no read first.
        elif isinstance(move, Propose) and s.ledger.propose(s.membership, view.epoch, move.seq, move.spec):
            spec = move.spec
            self._set(proposed(self._state, Proposal(view, move.seq, spec)))
            s.log.info("refit.attempt.proposed", epoch=view.epoch, seq=move.seq, version=spec.version,
                       kind=spec.kind, sources=len(spec.sources), holders=len(spec.holders),
                       destinations=len(spec.destinations))
            return NextAttempt(move.seq, spec)
        return None

    def _state_including(self, revision: int) -> VersionState:
        """The tracked version state once it holds etcd ``revision`` (the acks of the attempt
        that just finished: a state without them would propose a redundant catch-up); read
        from etcd if the watch does not bring it within a collective timeout."""
        s = self.services
        state = s.tracker.state_at(revision, s.config.timeouts.collective_timeout_s)
        if state is None:
            s.log.warning("refit.versions.lagging", revision=revision, tracked_revision=s.tracker.revision)
            state = s.versions.snapshot()
        return state

    def _count(self, proposal: Proposal, store: EtcdStore | None, current: MembershipView,
               done: Mapping[str, Done] | None = None) -> None:
        """Count ``proposal``'s attempt (``done`` when read already, else read here); give its
        version up once ``max_attempts`` consecutive attempts failed for one cause, under
        ``current``'s epoch (fenced). Best effort: a fault while counting (etcd) loses one
        count, never the agent's place in the epoch's attempts."""
        s = self.services
        try:
            if store is None or store.epoch != proposal.view.epoch:
                return
            if done is None:
                read = s.ledger.done_values(store, proposal.seq, proposal.spec.participants)
                done = {m: d for m, (d, _) in read.items()}
            state, give_up = counted(self._state, proposal, done, s.config.versions.max_attempts)
            self._set(state)
            if give_up is not None and s.versions.fail(s.membership, give_up.version, current.epoch,
                                                       give_up.cause, give_up.num_attempts):
                self._set(replace(self._state, tallies={v: t for v, t in self._state.tallies.items()
                                                        if v != give_up.version}))
                s.log.error("refit.version.failed", version=give_up.version, epoch=current.epoch,
                            seq=proposal.seq, kind=proposal.spec.kind, cause=give_up.cause,
                            num_attempts=give_up.num_attempts)
        except MembershipLost:
            raise
        except Exception as exc:
            s.log.warning("fault.detected", kind=type(exc).__name__, epoch=proposal.view.epoch, seq=proposal.seq,
                          error=brief(exc))

    def leaving(self, latest: MembershipView) -> None:
        """Entering ``latest``: count the last attempt of the epoch this coordinator leaves,
        if it failed (a transport fault breaks the communicator, so the attempt that hit it
        is the epoch's last). Only across an epoch with the same members (a rebuild): when
        a member left, joined or restarted, the membership change explains the failure."""
        s = self.services
        pending = self._state.uncounted
        if pending is None or pending.view.epoch == latest.epoch:
            return
        self._set(replace(self._state, uncounted=None))
        if pending.view.identities != latest.identities or latest.members[0].member_id != s.config.member_id:
            return
        store = s.manager.store  # still the old epoch's: the manager has not reconfigured yet
        if store is None or store.epoch != pending.view.epoch:
            return
        # Every participant is alive (same members): each writes its done key once its part
        # of the attempt failed, within a transfer timeout.
        keys = s.ledger.done_keys(pending.seq, pending.spec.participants)
        with contextlib.suppress(Exception):  # counting is best effort (see _count): count what was written
            s.wait_written(store, keys, pending.view.epoch, "the done keys of the epoch's last attempt",
                           timeout_s=s.config.timeouts.ttl_s + 1.0, follow_epoch=False)
        self._count(pending, store, latest)
