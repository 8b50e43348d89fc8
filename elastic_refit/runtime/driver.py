"""The driver: the agent thread of one member. Each turn it reads the latest membership
view, lets the pure ``decide`` (``runtime.agent``) pick the action, carries it out and feeds
back what came of it. Every decision is in ``decide``; here are only side effects.

It owns the epoch's transport and the executor kept for it; it hands attempts to the
participant and rank 0's duties to the coordinator, and records the version state it
observes into the outcomes (serving what committed).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from elastic_refit.errors import AgentStuck, RefitError, TransportAborted, brief, drop_frames
from elastic_refit.membership import (
    CommunicatorError,
    EpochTimeout,
    JobStateLost,
    MembershipLost,
    MembershipView,
)
from elastic_refit.membership.layouts import LayoutUnavailable
from elastic_refit.membership.versions import VersionState
from elastic_refit.plan import Plan
from elastic_refit.runtime.agent import (
    Action,
    AgentInputs,
    AgentSettings,
    AgentState,
    AttemptRan,
    AwaitEpoch,
    AwaitMembership,
    Backoff,
    CommunicatorFailed,
    ConnectAhead,
    Connected,
    Entered,
    EnterEpoch,
    Fail,
    Faulted,
    Idle,
    Lost,
    NextAttempt,
    Observe,
    Observed,
    Outcome,
    Rejoin,
    RunAttempt,
    decide,
)
from elastic_refit.runtime.attempt import fault_cause, own_catch_up, steady_refit
from elastic_refit.runtime.checks import Side
from elastic_refit.runtime.coordinator import Coordinator
from elastic_refit.runtime.outcomes import Outcomes
from elastic_refit.runtime.participant import Participant
from elastic_refit.runtime.planning import AttemptPlanner
from elastic_refit.runtime.published import PublishedVersions
from elastic_refit.runtime.services import Services
from elastic_refit.runtime.serving import ServingSlot
from elastic_refit.runtime.watchdog import AgentWatchdog, Overdue
from elastic_refit.transport.connect import connect_ahead, plan_peers
from elastic_refit.transport.executor import Executor
from elastic_refit.transport.protocol import Transport

__all__ = ["Driver"]


class Driver:
    """The agent thread: ``decide`` -> execute, until the member closes or is lost."""

    def __init__(self, services: Services, planner: AttemptPlanner, outcomes: Outcomes, participant: Participant,
                 side: Callable[[], Side], *, published: PublishedVersions | None, serving: ServingSlot | None,
                 rejoin: Callable[[str], Services] | None = None) -> None:
        self.services = services
        self._rejoin = rejoin  # reason -> the services of a new incarnation (see runtime.rejoin)
        self.planner = planner
        self.outcomes = outcomes
        self.participant = participant
        self.coordinator = Coordinator(services, planner)
        self._side = side
        self._published = published
        self._serving = serving
        self._transport: Transport | None = None  # the current epoch's (this thread's alone)
        self._executor: tuple[tuple[str, int], Executor] | None = None  # see executor_for
        self._warmed_key: tuple[str, int] | None = None  # the epoch's steady executor, warmed ahead
        self._thread: threading.Thread | None = None
        self._watchdog = AgentWatchdog(services.config.timeouts.agent_stuck_s, self._stuck,
                                       name=f"refit-watchdog-{services.config.member_id}")
        self._gave_up = False  # set by the watchdog: the member left the job, and never rejoins

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"refit-agent-{self.services.config.member_id}",
                                        daemon=True)
        self._thread.start()
        self._watchdog.start()

    def join(self, timeout_s: float) -> None:
        self._watchdog.stop()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _stuck(self, late: Overdue) -> None:
        """(The watchdog's thread.) The agent is stuck where no deadline reaches: say where,
        fail every waiter with the cause, and leave the job so that the peers go on without
        this member (its thread cannot, and it never rejoins)."""
        s = self.services
        cause = (f"{s.config.member_id}: the refit agent has been in {late.action} for {late.seconds:.0f} s, past "
                 f"every deadline it has (agent_stuck_s {self._watchdog.bound_s:g}), at {late.where}; this member "
                 "leaves the job")
        s.log.error("refit.agent.stuck", action=late.action, seconds=round(late.seconds, 1), where=late.where,
                    stack=late.stack)
        self._gave_up = True
        self.outcomes.latch(AgentStuck(cause))
        with contextlib.suppress(Exception):  # its lease goes: the peers' next epoch is without it
            s.membership.close()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            # Frames of this thread may outlive it in a latched error's traceback: they must
            # not keep the communicator (and its sockets) alive after close().
            self._release_transport()

    def _release_transport(self) -> None:
        self._executor = None  # an executor holds its transport
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()

    def _loop(self) -> None:
        s = self.services
        settings = AgentSettings.of(s.config)
        state, outcome = AgentState(), None
        lost: MembershipLost | None = None
        changed = s.changes.token()
        while not s.stop.is_set() or isinstance(outcome, Lost):  # a lost membership fails waiters even when closing
            if self._gave_up:
                return  # the watchdog latched why and left the job
            if s.membership.lost.is_set() and not isinstance(outcome, Lost):
                # Found by the keeper or the watch: act now, not at the next fenced write.
                outcome = Lost(f"{s.config.member_id} (incarnation {s.config.incarnation}) lost: "
                               f"{s.membership.lost_reason}", rejoin=self._may_rejoin())
            if not isinstance(outcome, Observed):
                # Before any read: a change after it wakes an idle wait. After an Observe the
                # token taken before its reads stays (an older token can only wake sooner).
                changed = s.changes.token()
            action, state = decide(state, AgentInputs(settings, s.membership.view, outcome), time.monotonic())
            if isinstance(action, Fail):
                s.log.error("fault.detected", kind="membership_lost", error=action.reason)
                went_back = s.membership.state_lost  # etcd answered below a revision seen before
                self.outcomes.latch(lost if lost is not None else went_back or MembershipLost(action.reason))
                return
            if isinstance(action, Rejoin):
                try:
                    outcome = self._come_back(action)
                except MembershipLost as exc:  # closing, or the job's state is gone: no way back
                    lost, outcome = exc, Lost(str(exc))
                s, settings = self.services, AgentSettings.of(self.services.config)
                continue
            try:
                with self._watchdog.running(type(action).__name__):
                    outcome = self._execute(action, state, changed)
            except MembershipLost as exc:  # JobStateLost: no rejoin into a state that went back
                lost, outcome = exc, Lost(str(exc), rejoin=self._may_rejoin() and not isinstance(exc, JobStateLost))
            except Exception as exc:  # a fault outside an attempt: back off until something changes
                self._fault_detected(exc, state.epoch, state.seq)
                outcome = Faulted(fault_cause(exc))

    def _may_rejoin(self) -> bool:
        """A lost member comes back as a new incarnation unless it closes, another process
        holds its key (two members with one id, or its restart elsewhere), or the context
        gave no way to (``rejoin``), or the job's state in etcd went back."""
        s = self.services
        return (self._rejoin is not None and not s.membership.replaced and s.membership.state_lost is None
                and not s.stop.is_set() and not self._gave_up)

    def _come_back(self, action: Rejoin) -> None:
        """Register as a new incarnation (``rejoin``, retried while etcd is unreachable) and
        take its services; the old epoch's transport goes first. ``MembershipLost`` when
        there is no way back (closing, ``JobStateLost``)."""
        self._release_transport()
        self.services.log.warning("refit.member.detached", reason=action.reason)
        services = self._rejoin(action.reason)
        self.services = services
        self.coordinator = Coordinator(services, self.planner)
        self.participant.services = services

    def _execute(self, action: Action, state: AgentState, changed: int) -> Outcome | None:
        """Carry out one action in ``state`` (the state ``decide`` left); returns what came
        of it, None after a wait. ``changed``: the change token an idle wait waits after."""
        s = self.services
        if isinstance(action, AwaitMembership):
            s.membership.check()  # a member whose lease expired is out for good
            s.stop.wait(action.timeout_s)
        elif isinstance(action, AwaitEpoch):
            if action.request_reform and not s.superseded(action.after_epoch):
                # Unless a newer epoch is out already (it brings a new communicator anyway).
                s.membership.request_reform()
            with contextlib.suppress(EpochTimeout):
                s.membership.wait_for_view(after_epoch=action.after_epoch, timeout_s=action.timeout_s)
        elif isinstance(action, EnterEpoch):
            return self._enter_epoch(action)
        elif isinstance(action, ConnectAhead):
            view = _entered(state, action.epoch)
            if self._connect_ahead(view):
                return Connected(action.epoch)
            return Connected(action.epoch, broke=True, can_shrink=self._broke(view))
        elif isinstance(action, Observe):
            return self._look_for_attempt(_entered(state, action.epoch), action)
        elif isinstance(action, RunAttempt):
            view = _entered(state, action.epoch)
            if self.participant.run(view, self._transport, action.seq, action.spec, self.executor_for):
                return AttemptRan(action.epoch, action.seq)
            return AttemptRan(action.epoch, action.seq, broke=True, can_shrink=self._broke(view))
        elif isinstance(action, Idle):
            # Nothing to do until a key changes; the timeout only bounds what a lost watch
            # event could cost (the watches resume and relist themselves).
            s.changes.wait_after(changed, action.timeout_s)
        elif isinstance(action, Backoff):
            with contextlib.suppress(Exception):  # a fault while backing off must not stack on the fault
                s.membership.wait_for_view(after_epoch=action.after_epoch, timeout_s=action.timeout_s)
        else:
            raise TypeError(f"the agent has no way to execute {action!r}")
        return None

    def _enter_epoch(self, action: EnterEpoch) -> Outcome:
        """Reconfigure the communicator from ``action.previous`` to ``action.view`` (shrink /
        grow / rebuild, see ``CommunicatorManager``)."""
        s = self.services
        latest = action.view
        self.coordinator.leaving(latest)
        s.fire("comm.reconfiguring", epoch=latest.epoch, first=action.previous is None)
        # The manager's watchdog must hold the last reference to the old process group, so
        # that its destructor never runs (and blocks) on this thread.
        self._release_transport()
        try:
            result = s.manager.reconfigure(action.previous, latest, broken=action.broken)
        except CommunicatorError as exc:
            s.log.warning("refit.communicator.broken", epoch=latest.epoch)
            self._fault_detected(exc, None, 0)  # nothing of the old communicator survives
            return CommunicatorFailed(latest.epoch)
        self._transport = s.hooks.wrap_transport(result.transport)
        s.fire("comm.ready", epoch=latest.epoch, rank=result.rank, path=result.path)
        # The communicator is formed: the epoch is entered whatever follows (a fault of the
        # watch below costs only wakeups, which the idle timeout bounds).
        try:
            s.watch_epoch(latest.epoch)
        except Exception as exc:
            self._fault_detected(exc, latest.epoch, 0)
        s.stats["reconfigurations"] += 1
        s.log.info("refit.epoch.entered", epoch=latest.epoch, rank=result.rank, num_ranks=result.num_ranks,
                   path=result.path, seconds=result.seconds)
        del result  # the manager and self._transport keep the only references
        return Entered(latest)

    def _look_for_attempt(self, view: MembershipView, action: Observe) -> Observed:
        """Take in the version state (serve what committed), coordinate as the epoch's rank
        0, then look for attempt ``action.seq`` or a later one. No etcd read unless the
        coordinator moves: the state is the tracker's, the attempts the epoch watch's."""
        s = self.services
        state = s.tracker.state()
        self.observe(state)
        if self._serving is not None:
            self._check_reachable(view, state)
        if action.coordinate:
            proposed = self.coordinator.move(view, action.seq, state)
            if proposed is not None:  # no need to wait for the watch to bring it back
                return Observed(action.epoch, proposed)
        found = s.ledger.next_attempt(view.epoch, action.seq, known=s.known(view.epoch))
        if found is None:
            return Observed(action.epoch, None)
        return Observed(action.epoch, NextAttempt(*found))

    def _check_reachable(self, view: MembershipView, state: VersionState) -> None:
        """An inference rank that joined or restarted after a commit gets that version from
        its holders; when they cannot cover it (TP peers hold their own shards) and nothing
        newer is on its way, its waiters learn why now instead of at their timeout."""
        spec = own_catch_up(view, state, self.services.config.member_id)
        cause = None
        if spec is not None and not self.planner.feasible(view, spec):
            cause = self.planner.uncovered(view, spec)
        self.outcomes.strand(spec.version if cause else None, cause or "")

    def observe(self, state: VersionState) -> None:
        """Record commits and failed versions; serve a committed version once this rank
        holds it (its ack, by this incarnation, in the layout it holds now). A state whose
        latest commit is older than one this member saw means the job's control state went
        back (etcd restored from an older snapshot): ``JobStateLost``, never served."""
        seen = self.outcomes.latest_committed()
        if seen is not None and (state.latest_committed is None or state.latest_committed < seen):
            raise JobStateLost(f"{self.services.config.member_id}: the job's control state in etcd went back (its "
                               f"latest committed version is {state.latest_committed}, this member saw {seen} "
                               "committed): etcd was restored from an older state, and going on could commit or "
                               "serve versions out of order; this member stops")
        latest_done = self.outcomes.record(state.committed, state.failed)
        if self._published is not None:
            self._published.release_through(latest_done)  # committed, failed, or superseded by a later commit
            self._published.keep_base(state.latest_committed)  # the base of the next version's deltas
        latest = state.latest_committed
        if self._serving is None or latest is None:
            return
        c = self.services.config
        ack = state.acks.get(latest, {}).get(c.member_id)
        if (ack is not None and ack.incarnation == c.incarnation and ack.layout == self._side().described
                and self._serving.serve(latest)):
            self.services.log.info("refit.version.serving", version=latest)

    def _broke(self, view: MembershipView) -> bool:
        """An operation broke this epoch's transport: it cannot be used again. Returns
        whether it can shrink (then the communicator stays with the manager)."""
        self.services.log.warning("refit.communicator.broken", epoch=view.epoch)
        return self._transport is not None and self._transport.capabilities.can_shrink

    def _fault_detected(self, exc: Exception, epoch: int | None, seq: int) -> None:
        """A fault of the agent outside any attempt: counted, noted for timeouts, logged; its
        frames' locals (a broken communicator's, a transport's posted work) are dropped."""
        drop_frames(exc)
        self.services.stats["failed_attempts"] += 1
        self.outcomes.note_fault(fault_cause(exc))
        self.services.log.warning("fault.detected", kind=type(exc).__name__, error=brief(exc), epoch=epoch, seq=seq)

    def executor_for(self, plan: Plan, transport: Transport) -> Executor:
        """The executor of ``plan`` on ``transport``, kept for the epoch's later refits: its
        schedule is built and its staging allocated once, not per version. One is kept (its
        staging is memory) and goes with the transport; see :func:`executor_use` for when
        an attempt gets one of its own beside it."""
        key = (plan.fingerprint, id(transport))
        use = executor_use(self._executor[0] if self._executor is not None else None, self._warmed_key, key)
        if use == "keep":
            return self._executor[1]  # type: ignore[index]
        options = self.services.config.transfer.executor_options()
        if use == "beside":
            self.services.stats["one_off_executors"] += 1
            self.services.log.info("refit.executor.beside", fingerprint=plan.fingerprint,
                                   kept=self._executor[0][0])  # type: ignore[index]  # the warmed one
            return Executor(plan, transport, options)
        self._executor = None  # the old staging goes before the new is allocated
        self._executor = (key, Executor(plan, transport, options))
        return self._executor[1]

    def _connect_ahead(self, view: MembershipView) -> bool:
        """On entering an epoch: connect the pairs the epoch's refit plan uses (one byte
        along each direction, then its vote), so the first refit after a reconfiguration
        does not pay NCCL's lazy connection setup (see ``transport.connect``). Every member
        votes for the plan it would connect, and all connect only when all agree;
        otherwise (a layout not published yet, no refit possible) nobody does. Returns
        False when the transport broke."""
        s = self.services
        spec = steady_refit(view)
        if not s.config.connects_ahead or spec is None:
            return True
        log = s.log.bind(epoch=view.epoch)
        t0 = time.perf_counter()
        plan: Plan | None = None
        try:
            plan = self.planner.plan(view, spec)
            mine = plan.fingerprint
        except (LayoutUnavailable, ValueError) as exc:
            mine = f"skip: {fault_cause(exc)}"
        store = s.manager.store
        try:
            s.ledger.vote_connect(store, s.config.member_id, mine)
            s.wait_written(store, s.ledger.connect_keys(spec.participants), view.epoch, "connecting ahead")
            agreed = all(v == mine for v in s.ledger.connect_votes(store, spec.participants))
        except Exception as exc:  # superseded, closing, etcd: the first refit connects instead
            log.info("refit.connect.skipped", reason=brief(exc))
            return True
        if plan is None or not agreed:
            log.info("refit.connect.skipped", reason=mine if plan is None else "members planned differently")
            return True
        try:
            with self.participant.connecting(view, spec.participants, self._transport):
                num_directions = connect_ahead(self._transport, plan_peers(plan, view.rank_of(s.config.member_id)))
        except TransportAborted as exc:
            log.warning("refit.connect.failed", error=brief(exc))
            drop_frames(exc)  # its frames hold the posted connect work (and so the group's sockets)
            return False
        s.stats["connected_ahead"] += 1
        log.info("refit.connect.done", seconds=time.perf_counter() - t0, num_directions=num_directions,
                 fingerprint=plan.fingerprint)
        self._warm(plan, log)
        return True

    def _warm(self, plan: Plan, log) -> None:
        """Ready the epoch's executor for its first refit beside connecting ahead: staging
        allocated, kernel programs bound to this member's buffers (a trainer's as it last
        published them, an inference rank's incoming weights). On a GPU each binding copies
        descriptors to the device, a read back on a GPU other processes share; the first
        refit of an epoch paid them all (H100: first refit after a reconfiguration 1.55x
        the steady one, the first of a fresh build too)."""
        t0 = time.perf_counter()
        source = self._published.last_buffers() if self._published is not None else {}
        destination = self._serving.incoming if self._serving is not None else {}
        try:
            num_buckets = self.executor_for(plan, self._transport).warm(source, destination)
        except (ValueError, RuntimeError) as exc:  # a staging budget, memory: the first refit says so
            log.info("refit.executor.warm_skipped", reason=brief(exc))
            return
        self._warmed_key = (plan.fingerprint, id(self._transport))
        self.services.stats["warmed_buckets"] += num_buckets
        log.info("refit.executor.warmed", seconds=time.perf_counter() - t0, num_buckets=num_buckets)


def executor_use(kept: tuple[str, int] | None, warmed: tuple[str, int] | None,
                 wanted: tuple[str, int]) -> str:
    """Which executor an attempt whose plan and transport are ``wanted`` runs on (pure):
    ``keep``, the kept one (``kept``: the same plan on the same transport); ``beside``, one
    of its own built beside the kept one and dropped after the attempt, when the kept one
    is the epoch's steady executor warmed on entering it (``warmed``): a catch-up or
    another one-off plan must not evict it, or the epoch's next refit builds, allocates
    and binds everything again (gloo churn: a rejoiner's catch-up evicted it, and the first
    refit after every grow rebuilt its executor). The staging of both is held while the
    one-off runs. ``replace`` otherwise: the old one goes, its staging before the new one's."""
    if kept == wanted:
        return "keep"
    if kept is not None and kept == warmed and kept[1] == wanted[1]:  # this epoch's transport
        return "beside"
    return "replace"


def _entered(state: AgentState, epoch: int) -> MembershipView:
    if state.view is None or state.view.epoch != epoch:
        raise RefitError(f"agent bug: an action for epoch {epoch} while in epoch {state.epoch}")
    return state.view
