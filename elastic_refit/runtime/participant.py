"""A participant runs one attempt on this rank: plan it (pure, memoised), agree on the
plan's fingerprint with every other participant, move the bytes, verify them, and finish
(a destination acks in the same transaction as its done key).

Where it stands is one explicit :class:`Phase`, which decides what a fault must undo: before
its plan key is written, peers waiting for it are told through that key; once the plan is
agreed and bytes are moving, the peers depend on this rank, so the transport is aborted
and they fail now instead of at the transfer timeout.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections.abc import Callable, Collection, Mapping

import torch

from elastic_refit.errors import (
    RefitError,
    SourceChanged,
    TransferRefused,
    TransportAborted,
    brief,
    drop_frames,
)
from elastic_refit.membership import Membership, MembershipError, MembershipLost, MembershipView
from elastic_refit.membership.attempts import OK, AttemptSpec, Done
from elastic_refit.plan import Plan
from elastic_refit.runtime.attempt import fault_cause
from elastic_refit.runtime.checks import Side
from elastic_refit.runtime.outcomes import Outcomes
from elastic_refit.runtime.planning import AttemptPlanner
from elastic_refit.runtime.published import PublishedVersions
from elastic_refit.runtime.services import AttemptAborted, Services
from elastic_refit.runtime.serving import ServingSlot
from elastic_refit.transport.executor import DeltaInputs, Executor
from elastic_refit.transport.protocol import Transport

__all__ = ["Participant", "Phase"]

ExecutorFor = Callable[[Plan, Transport], Executor]


class Phase(enum.Enum):
    """Where this rank is in an attempt."""

    PLANNING = "planning"  # nothing written yet: peers wait for this rank's plan key
    PLANNED = "planned"  # its plan key is being written (the agreement)
    AGREED = "agreed"  # every participant planned alike: bytes move, the peers depend on this rank
    SENT = "sent"  # this rank's bytes are through; the executor votes either way
    DONE = "done"


class Participant:
    """This rank's part in the attempts it is named in (one at a time: ``lock``)."""

    def __init__(self, services: Services, planner: AttemptPlanner, outcomes: Outcomes, side: Callable[[], Side], *,
                 published: PublishedVersions | None, serving: ServingSlot | None) -> None:
        self.services = services
        self.planner = planner
        self.outcomes = outcomes
        self._side = side
        self._published = published
        self._serving = serving
        # Attempts and layout changes take turns (a change waits for the attempt in flight).
        self.lock = threading.Lock()
        self._acked: set[int] = set()  # versions this rank acked and has not retracted since
        self.phase = Phase.DONE
        # The transfer in flight (its epoch, its participants' identities, its transport,
        # whether any newer epoch ends it), read by the membership thread (peer_left): its
        # own lock, never the attempt's.
        self._moving_lock = threading.Lock()
        self._moving: tuple[int, frozenset[tuple[str, str, str]], Transport, bool] | None = None

    def follow(self, membership: Membership) -> None:
        """End a transfer in flight as soon as an epoch of ``membership`` (this member's,
        a new one after a rejoin) drops one of its participants (connecting ahead: as soon
        as any newer epoch arrives)."""
        membership.on_view(lambda _old, new: self.peer_left(new))

    def peer_left(self, view: MembershipView) -> None:
        """A newer epoch ``view`` without a participant of the transfer in flight interrupts
        that transfer's transport now (called on the membership thread; the attempt's thread
        then aborts it, IPC mappings included, as after any fault). Every rank's wait then
        ends at once: a peer's death reaches an NCCL collective only when NCCL's proxy
        notices (~0.5 s, measured on nccl4py), and the attempt could not succeed anyway."""
        with self._moving_lock:
            if self._moving is None:
                return
            epoch, identities, transport, superseded_ends = self._moving
            gone = identities - view.identities
            if view.epoch <= epoch or not (gone or superseded_ends):
                return
            self._moving = None
        self.services.log.info("refit.transfer.interrupted", epoch=epoch, new_epoch=view.epoch,
                               gone=sorted(member_id for _role, member_id, _incarnation in gone),
                               connecting=superseded_ends)
        with contextlib.suppress(Exception):  # best effort: the attempt's own fault handling follows
            transport.interrupt()

    def connecting(self, view: MembershipView, participants: Collection[str], transport: Transport):
        """While this rank connects ahead in ``view``'s epoch: any newer epoch interrupts it
        (a peer that sees the epoch superseded before it connects skips connecting, and
        this rank would wait for it until the transport's timeout)."""
        return self._in_flight(view, participants, transport, superseded_ends=True)

    @contextlib.contextmanager
    def _in_flight(self, view: MembershipView, participants: Collection[str], transport: Transport, *,
                   superseded_ends: bool = False):
        """While bytes move: what :meth:`peer_left` interrupts."""
        identities = frozenset(m.identity for m in view.members if m.member_id in participants)
        with self._moving_lock:
            self._moving = (view.epoch, identities, transport, superseded_ends)
        try:
            yield
        finally:
            with self._moving_lock:
                self._moving = None

    def run(self, view: MembershipView, transport: Transport, seq: int, spec: AttemptSpec,
            executor_for: ExecutorFor) -> bool:
        """Run attempt ``seq`` of ``view``'s epoch; False when it broke the epoch's
        communicator (a transport fault: gloo closes a pair for good once it times out or its
        peer resets it)."""
        with self.lock:
            s = self.services
            log = s.log.bind(epoch=view.epoch, seq=seq, version=spec.version, kind=spec.kind)
            s.stats["attempts"] += 1
            self.phase = Phase.PLANNING
            try:
                self._attempt(view, transport, seq, spec, executor_for, log)
                self.phase = Phase.DONE
                return True
            except Exception as exc:  # any fault (or bug) fails this attempt, not the agent
                try:
                    return self._failed(exc, view, transport, seq, log)
                finally:
                    # Handled (or on its way to be latched): its frames' locals are the
                    # attempt's posted work, whose gloo context holds the group's sockets,
                    # and staging. Kept, a cycle through a later fault's __context__ held a
                    # stopped trainer's pair to its peer open (the etcd_wipe chaos cell).
                    drop_frames(exc)

    def _attempt(self, view: MembershipView, transport: Transport, seq: int, spec: AttemptSpec,
                 executor_for: ExecutorFor, log) -> None:
        s, me = self.services, self.services.config.member_id
        store = s.manager.store
        s.fire("attempt.start", epoch=view.epoch, seq=seq, version=spec.version)
        t0 = time.perf_counter()
        self._check_planned_layout(spec)
        plan = self.planner.plan(view, spec)
        st = plan.stats
        log.info("refit.plan.built", seconds=time.perf_counter() - t0, fingerprint=plan.fingerprint,
                 cross_domain_bytes=st.cross_domain_bytes, lower_bound_bytes=st.lower_bound_bytes,
                 intra_domain_bytes=st.intra_domain_bytes, gather_broadcast_bytes=st.gather_broadcast_bytes)
        # Everything this rank can get wrong on its own (its buffers, its staging budget)
        # is checked before it agrees: a fault here fails the agreement, peers stop at once
        # and no byte moves (the communicator stays usable for the retry).
        source, destination = self._buffers(spec)
        executor = executor_for(plan, transport)
        delta = self._delta_inputs(view, spec, executor)

        def refused(member_id: str, done: Done) -> None:
            raise AttemptAborted(f"{member_id} failed attempt {seq} of version {spec.version} before "
                                 f"the plan was agreed ({done.encode()})")

        if me in spec.destinations and not self._serving.staged:
            self._wait_for_readers(spec)
        self.phase = Phase.PLANNED
        s.ledger.agree(store, seq, plan.fingerprint, me=me, participants=spec.participants, refused=refused,
                       wait=lambda keys: s.wait_written(store, keys, view.epoch, "the plan was agreed"))
        self.phase = Phase.AGREED
        log.info("refit.plan.agreed", participants=len(spec.participants))
        s.fire("plan.agreed", epoch=view.epoch, seq=seq, version=spec.version)
        if me in spec.destinations:
            self._begin_receiving()
        s.fire("transfer.before", epoch=view.epoch, seq=seq, version=spec.version, executor=executor,
               transport=transport)
        with self._in_flight(view, spec.participants, transport):
            report = executor.run(source, destination, before_vote=self._after_sends(spec, source), delta=delta)
        if me in spec.sources and self._published is not None:
            self._published.mark_sent(spec.version)
        log.info("refit.transfer.done", seconds=report.seconds, network_recv_bytes=report.network_recv_bytes,
                 network_send_bytes=report.network_send_bytes, intra_recv_bytes=report.intra_recv_bytes,
                 local_bytes=report.local_bytes, num_verified_boxes=report.num_verified_boxes,
                 base=spec.base, num_delta_buckets=report.num_delta_buckets,
                 network_saved_bytes=report.network_saved_bytes, intra_saved_bytes=report.intra_saved_bytes)
        self._finish(view, seq, spec, log)

    def _delta_inputs(self, view: MembershipView, spec: AttemptSpec, executor: Executor) -> DeltaInputs | None:
        """What this rank's executor needs for the attempt's deltas (None: none). A source
        gives its base (none when it does not hold ``spec.base`` as it publishes now: it
        sends full bytes); a destination named for deltas first checks that its buffers
        hold the base, bit for bit as it acked it, else it retracts that ack and refuses
        the attempt before any byte moves (the next one sends it full bytes)."""
        s, me = self.services, self.services.config.member_id
        if not spec.deltas:  # a quantized plan's sender still keeps what it quantizes (the next base)
            return DeltaInputs(version=spec.version) if executor.options.delta and me in spec.sources else None
        if not executor.options.delta:
            raise AttemptAborted(f"attempt {spec.version} sends deltas, but {me} has no delta_base_bytes: "
                                 "set it alike on every member")
        if me in spec.deltas:
            ack = s.tracker.state().acks.get(spec.base, {}).get(me)
            if ack is None or ack.digest != self._serving.held_digest():  # no re-read after the ack
                s.versions.retract(s.membership, s.tracker.state(), also=self._acked)
                self._acked.clear()
                raise RefitError(f"{me} was named to receive version {spec.version} as a delta against version "
                                 f"{spec.base}, but its buffers no longer hold that version as it acked it")
        base: Mapping[str, torch.Tensor] = {}
        if me in spec.sources and self._published is not None:
            published = self._published.get(spec.version)
            base = self._published.base(spec.base, published.layout) if published is not None else {}
        return DeltaInputs(base, frozenset(view.rank_of(m) for m in spec.deltas), version=spec.version,
                           base_version=spec.base)

    def _wait_for_readers(self, spec: AttemptSpec) -> None:
        """In place, the parameters are written once the plan is agreed, and a reader inside
        would hold every peer at the transfer (and keep the others from serving: they would
        be writing too). So readers are waited for here, where nothing moves yet, for at most
        a collective timeout; else the attempt is given up naming them (a consequence, not a
        fault: the next attempt waits again) and every peer goes on serving what it holds."""
        me = self.services.config.member_id
        held = self._serving.wait_readers_out(self.services.config.collective_timeout_s)
        if held:
            self.services.log.warning("refit.serving.reader_held", version=spec.version, seconds=round(held, 3))
            raise AttemptAborted(f"inference rank {me!r}: readers have held weights() for {held:.1f} s; in_place "
                                 f"mode writes version {spec.version} only once none is inside (staged mode does "
                                 "not wait for readers)")

    def _begin_receiving(self) -> None:
        """This rank's buffers are about to be overwritten: it holds nothing from now on.
        Its own latest acks may not be in the watched state yet: they are named."""
        s = self.services
        self._serving.begin_apply()
        s.versions.retract(s.membership, s.tracker.state(), also=self._acked)
        self._acked.clear()

    def _after_sends(self, spec: AttemptSpec, source: Mapping[str, torch.Tensor]) -> Callable[[], None]:
        """What runs once this rank's bytes are through, before the executor's closing vote.
        A source checks its buffers against publish's digests there: the vote passing tells
        every destination that no source changed under its sends (no extra round trip), and
        the check runs while the receivers finish."""
        s = self.services
        check = (s.config.transfer.verify and s.config.member_id in spec.sources and self._published is not None
                 and not self._published.is_copy(spec.version))  # publish's own copy: nobody else writes it

        def transferred() -> None:
            self.phase = Phase.SENT
            if check:
                self._check_unchanged(spec.version, source)

        return transferred

    def _finish(self, view: MembershipView, seq: int, spec: AttemptSpec, log) -> None:
        s, me = self.services, self.services.config.member_id
        if me in spec.destinations:
            s.fire("ack.before", epoch=view.epoch, seq=seq, version=spec.version)
            digest = self._serving.digest()
            # One transaction: the coordinator that sees the done key knows the ack's
            # revision, which its watched version state then waits for.
            s.ledger.ack(s.membership, s.manager.store, seq, spec.version, view.epoch, digest)
            self._acked.add(spec.version)
            log.info("refit.version.acked", digest=digest)
        else:
            s.ledger.finish(s.manager.store, seq, me, OK, planned=True)

    def _failed(self, exc: Exception, view: MembershipView, transport: Transport, seq: int, log) -> bool:
        s, me = self.services, self.services.config.member_id
        s.stats["failed_attempts"] += 1
        # A fault of this rank's own is a cause the coordinator counts; a consequence of
        # something outside the attempt (a peer failed first, the epoch moved on, etcd or
        # the lease) is not: retrying with the same members may well succeed.
        aborted = isinstance(exc, AttemptAborted | MembershipError | MembershipLost | TransferRefused)
        cause = fault_cause(exc)
        self.outcomes.note_fault(brief(exc) if isinstance(exc, AttemptAborted) else cause)
        log.warning("refit.attempt.failed", error_type=type(exc).__name__, error=brief(exc), aborted=aborted)
        done = Done.aborted(cause) if aborted else Done.failed(cause)
        with contextlib.suppress(Exception):
            if self.phase is Phase.AGREED and not transport.aborted:
                # The peers are moving bytes with this rank: abort, so they fail now
                # instead of at the transfer timeout (the executor does the same).
                transport.abort()
            s.ledger.finish(s.manager.store, seq, me, done, planned=self.phase is not Phase.PLANNING)
        self.phase = Phase.DONE
        if isinstance(exc, MembershipLost):
            raise exc
        if isinstance(exc, TransportAborted) and exc.peer is not None and 0 <= exc.peer < view.num_ranks:
            # A reset or closed connection is evidence the peer died: suspect it now
            # (it refutes if alive) instead of waiting for its lease to expire.
            peer = view.members[exc.peer]
            with contextlib.suppress(Exception):
                s.membership.report_peer_failure(peer.member_id, peer.incarnation, str(exc))
        if (isinstance(exc, TransportAborted) and not isinstance(exc, TransferRefused)) or transport.aborted:
            return False
        # The communicator is fine (etcd hiccup, plan disagreement, superseded epoch):
        # back off briefly, then the next attempt (or epoch) retries.
        with contextlib.suppress(Exception):
            s.membership.wait_for_view(after_epoch=view.epoch, timeout_s=10 * s.config.timeouts.poll_s)
        return True

    def _check_unchanged(self, version: int, source: Mapping[str, torch.Tensor]) -> None:
        """After this trainer's sends: its buffers still hold what was published as
        ``version``. Else the version is refused for the job (a retry would send the same
        moving target) and :class:`SourceChanged` names the buffers."""
        changed = self._published.changed_buffers(version, source)
        if changed:
            s = self.services
            exc = SourceChanged(f"trainer {s.config.member_id!r}: published buffers {changed} changed while "
                                f"version {version} was in flight; it is refused, publish a new version once "
                                "they hold still")
            s.versions.refuse(s.membership, version, fault_cause(exc))
            raise exc

    def _buffers(self, spec: AttemptSpec) -> tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]:
        me = self.services.config.member_id
        if me in spec.sources:
            published = self._published.get(spec.version) if self._published is not None else None
            if published is None:
                raise RefitError(f"{me} was listed as a source of version {spec.version} but does not hold it")
            return published.tensors, {}  # checked against the layout in publish
        if me in spec.holders:
            return self._serving.incoming, {}
        return {}, self._serving.incoming

    def _check_planned_layout(self, spec: AttemptSpec) -> None:
        """The attempt plans this rank with the layout its buffers hold; else it was proposed
        before a layout change reached the coordinator, and nothing may move under it."""
        me = self.services.config.member_id
        named = spec.layout(me)
        mine = self._side().described
        if me in spec.sources and self._published is not None:
            published = self._published.get(spec.version)
            mine = published.layout if published is not None else named
        if named and named != mine:
            raise AttemptAborted(f"attempt plans {me} with layout {named}, but it holds layout {mine} now")
