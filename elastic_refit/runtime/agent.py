"""The agent as a state machine: what a rank does next, decided by a pure function.

Every rank runs one agent thread. Each turn its driver (``ElasticRefit._agent_loop``)
gathers the inputs (the latest membership view, the outcome of the action it executed
last), calls :func:`decide` and executes the action it returns: wait for this member to
be listed, wait for an epoch after a broken one (asking for a reform once one is due),
enter an epoch (reconfigure the communicator), connect ahead, observe the version state
(the coordinator tidies up, then proposes, commits or refuses: the pure
``runtime.coordination`` decides which), run an attempt (plan, agree, move, verify,
ack), idle until a watched key changes, back off after a fault, or fail.

:func:`decide` does no I/O and reads no clock (``now`` is passed in): the same state,
inputs and time give the same action on every call, so each branch is a table row in
``tests/unit/test_agent_decisions.py``. Outcomes are fed back as data (the communicator
formed or broke, an attempt ran or broke its transport, the version state names the
next attempt, a fault, the membership lost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from elastic_refit.membership.view import MembershipView
from elastic_refit.runtime.attempt import (
    AttemptSpec,
    reform_due_in,
)
from elastic_refit.runtime.config import RefitConfig

__all__ = [
    "Action",
    "AgentInputs",
    "AgentSettings",
    "AgentState",
    "AttemptRan",
    "AwaitEpoch",
    "AwaitMembership",
    "Backoff",
    "CommunicatorFailed",
    "ConnectAhead",
    "Connected",
    "EnterEpoch",
    "Entered",
    "Fail",
    "Faulted",
    "Idle",
    "Lost",
    "NextAttempt",
    "Observe",
    "Observed",
    "Outcome",
    "Rejoin",
    "RunAttempt",
    "decide",
    "lists",
]


def _check_epoch(name: str, epoch: int, minimum: int = 0) -> None:
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {epoch!r}")


def _check_seconds(name: str, seconds: float) -> None:
    if not isinstance(seconds, int | float) or isinstance(seconds, bool) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {seconds!r}")


# ---- what decide reads ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AgentSettings:
    """This agent's identity and timeouts (from its ``RefitConfig``), fixed for its life."""

    member_id: str
    incarnation: str
    ttl_s: float
    poll_s: float
    collective_timeout_s: float
    epoch_deadline_s: float
    idle_wake_s: float

    def __post_init__(self) -> None:
        if not self.member_id or not self.incarnation:
            raise ValueError(f"member_id and incarnation must be non-empty, got {self.member_id!r} and "
                             f"{self.incarnation!r}")
        for name in ("ttl_s", "poll_s", "collective_timeout_s", "epoch_deadline_s", "idle_wake_s"):
            _check_seconds(name, getattr(self, name))

    @classmethod
    def of(cls, config: RefitConfig) -> AgentSettings:
        t = config.timeouts
        return cls(config.member_id, config.incarnation, t.ttl_s, t.poll_s, t.collective_timeout_s,
                   t.epoch_deadline_s, t.idle_wake_s)


@dataclass(frozen=True, slots=True)
class NextAttempt:
    """The version state names attempt ``seq`` (the first at or after the one looked for)."""

    seq: int
    spec: AttemptSpec

    def __post_init__(self) -> None:
        _check_epoch("seq", self.seq)


# Outcomes: what the action executed last brought (the driver feeds them back).
@dataclass(frozen=True, slots=True)
class Entered:
    """``EnterEpoch`` ran to its end: the epoch's communicator is formed."""

    view: MembershipView


@dataclass(frozen=True, slots=True)
class CommunicatorFailed:
    """Forming the communicator of ``epoch`` failed: nothing of the old one survives."""

    epoch: int


@dataclass(frozen=True, slots=True)
class Connected:
    """Connecting ahead in ``epoch`` is over; ``broke``: it broke the epoch's transport,
    which ``can_shrink`` (NCCL) or not (gloo: every rank must rebuild)."""

    epoch: int
    broke: bool = False
    can_shrink: bool = False


@dataclass(frozen=True, slots=True)
class Observed:
    """The version state of ``epoch`` was read (and coordinated); ``attempt``: the next
    attempt it names, None while there is none."""

    epoch: int
    attempt: NextAttempt | None


@dataclass(frozen=True, slots=True)
class AttemptRan:
    """Attempt ``seq`` of ``epoch`` is over for this rank (succeeded or failed);
    ``broke``: it broke the epoch's transport (see :class:`Connected`)."""

    epoch: int
    seq: int
    broke: bool = False
    can_shrink: bool = False


@dataclass(frozen=True, slots=True)
class Faulted:
    """The action raised a fault outside any attempt (etcd, a hook, a bug): ``cause``."""

    cause: str


@dataclass(frozen=True, slots=True)
class Lost:
    """This member's lease is gone; ``rejoin``: it may come back as a new incarnation (its
    lease expired or it was fenced as a suspect; not when another process took its key, nor
    while it closes)."""

    reason: str
    rejoin: bool = False


Outcome = Entered | CommunicatorFailed | Connected | Observed | AttemptRan | Faulted | Lost


@dataclass(frozen=True, slots=True)
class AgentInputs:
    """What one turn of the agent reads: its settings, the latest membership view (None
    before the first) and the outcome of the action it executed last (None after a wait)."""

    settings: AgentSettings
    view: MembershipView | None
    outcome: Outcome | None = None


# ---- the agent's state ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AgentState:
    """What the agent remembers between turns.

    ``view`` is the epoch it entered (its communicator formed), None before the first and
    after a formation failed or a transport that cannot shrink broke; ``seq`` the next
    attempt of that epoch to look for; ``connected`` whether connecting ahead is over
    there. ``broken_epoch`` is an epoch whose communicator is unusable (-1: none),
    ``broken_at`` when it broke (the clock ``decide`` is given) and ``reform_asked``
    whether a rebuild with the same members was asked for it.
    """

    view: MembershipView | None = None
    seq: int = 0
    connected: bool = False
    broken_epoch: int = -1
    broken_at: float = 0.0
    reform_asked: bool = True

    def __post_init__(self) -> None:
        _check_epoch("seq", self.seq)
        _check_epoch("broken_epoch", self.broken_epoch, minimum=-1)
        if self.view is None and (self.seq or self.connected):
            raise ValueError(f"an agent in no epoch has no seq nor connection, got seq {self.seq}, "
                             f"connected {self.connected}")
        if not math.isfinite(self.broken_at):
            raise ValueError(f"broken_at must be finite, got {self.broken_at!r}")

    @property
    def epoch(self) -> int | None:
        """The epoch entered, if any."""
        return self.view.epoch if self.view is not None else None


# ---- actions ---------------------------------------------------------------------------------
# Each carries ``why`` (for logs and failing tests; not compared).
@dataclass(frozen=True, slots=True)
class AwaitMembership:
    """The latest view does not list this member under its incarnation: check that its
    lease is alive, then look again after ``timeout_s``."""

    timeout_s: float
    why: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _check_seconds("timeout_s", self.timeout_s)


@dataclass(frozen=True, slots=True)
class AwaitEpoch:
    """Wait (at most ``timeout_s``) for an epoch newer than ``after_epoch``, whose
    communicator is unusable; first ask for a reform if ``request_reform``."""

    after_epoch: int
    timeout_s: float
    request_reform: bool = False
    why: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _check_epoch("after_epoch", self.after_epoch)
        _check_seconds("timeout_s", self.timeout_s)


@dataclass(frozen=True, slots=True)
class EnterEpoch:
    """Reconfigure the communicator from ``previous`` (None: nothing to reuse) to ``view``;
    ``broken``: the previous epoch's transport broke (it can only be shrunk or rebuilt)."""

    view: MembershipView
    previous: MembershipView | None
    broken: bool = False
    why: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.previous is not None and self.previous.epoch == self.view.epoch:
            raise ValueError(f"entering epoch {self.view.epoch} from itself")
        if self.broken and self.previous is None:
            raise ValueError("only a previous epoch can be broken")

    @property
    def epoch(self) -> int:
        return self.view.epoch


@dataclass(frozen=True, slots=True)
class ConnectAhead:
    """Connect the pairs of ``epoch``'s refit plan before the first refit needs them."""

    epoch: int
    why: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _check_epoch("epoch", self.epoch)


@dataclass(frozen=True, slots=True)
class Observe:
    """Read the version state; as the epoch's coordinator (``coordinate``) commit or
    propose first; then look for attempt ``seq`` (or a later one) of ``epoch``."""

    epoch: int
    seq: int
    coordinate: bool
    why: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _check_epoch("epoch", self.epoch)
        _check_epoch("seq", self.seq)


@dataclass(frozen=True, slots=True)
class RunAttempt:
    """Take part in attempt ``seq`` of ``epoch``: plan, agree, move, verify, ack."""

    epoch: int
    seq: int
    spec: AttemptSpec
    why: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _check_epoch("epoch", self.epoch)
        _check_epoch("seq", self.seq)


@dataclass(frozen=True, slots=True)
class Idle:
    """Nothing to do: wait until a watched key changes (at most ``timeout_s``, which only
    bounds what a lost watch event could cost)."""

    timeout_s: float
    why: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _check_seconds("timeout_s", self.timeout_s)


@dataclass(frozen=True, slots=True)
class Backoff:
    """After a fault: wait (at most ``timeout_s``) for an epoch newer than ``after_epoch``;
    whatever this wait raises is ignored (the next turn looks afresh)."""

    after_epoch: int
    timeout_s: float
    why: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _check_epoch("after_epoch", self.after_epoch)
        _check_seconds("timeout_s", self.timeout_s)


@dataclass(frozen=True, slots=True)
class Rejoin:
    """Register again as a new incarnation (nothing of the lost one can write: its lease is
    gone), then start over in no epoch."""

    reason: str
    why: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class Fail:
    """Stop the agent: callers of ``publish`` / ``wait_for_version`` get the error."""

    reason: str
    why: str = field(default="", compare=False)


Action = AwaitMembership | AwaitEpoch | EnterEpoch | ConnectAhead | Observe | RunAttempt | Idle | Backoff | Rejoin | Fail


def lists(view: MembershipView | None, settings: AgentSettings) -> bool:
    """Whether ``view`` lists this member under its own incarnation (a view that lists an
    earlier incarnation, a restart inside the old lease's TTL, is not this agent's)."""
    return (view is not None and settings.member_id in view
            and view.member(settings.member_id).incarnation == settings.incarnation)


# ---- the decision --------------------------------------------------------------------------
def decide(state: AgentState, inputs: AgentInputs, now: float) -> tuple[Action, AgentState]:
    """The agent's next action and its state after deciding it (pure).

    First the outcome of the last action is taken in: the membership lost rejoins as a new
    incarnation from no epoch (or, when it may not, fails the agent); a fault backs off until the epoch changes (skipping the attempt it was at); a
    communicator that could not form, or a transport that broke and cannot shrink, marks
    its epoch broken and asks for a reform at once; a transport that broke but can shrink
    marks the epoch broken and leaves the reform for later (a dead peer's lease expires
    first, and the epoch without it shrinks the communicator); an attempt found is run if
    this rank takes part, skipped otherwise; no attempt: idle. Then, from the state and the
    latest view: wait to be listed; wait out a broken epoch (asking for a reform once
    :func:`~elastic_refit.runtime.attempt.reform_due_in` says so); enter a new epoch;
    connect ahead; observe the version state.
    """
    s = inputs.settings
    outcome = inputs.outcome
    if isinstance(outcome, Lost):
        if outcome.rejoin:
            return Rejoin(outcome.reason, why="lease lost: back as a new incarnation"), AgentState()
        return Fail(outcome.reason, why="membership lost"), state
    if isinstance(outcome, Faulted):
        after = state.view.epoch if state.view is not None else 0
        seq = state.seq + 1 if state.view is not None else 0
        return (Backoff(after, s.collective_timeout_s, why=f"fault: {outcome.cause}"),
                replace(state, seq=seq))
    if isinstance(outcome, CommunicatorFailed):
        return _broke(state, inputs, now, outcome.epoch, False, why="the communicator could not be formed")
    if isinstance(outcome, Entered):
        state = replace(state, view=outcome.view, seq=0, connected=False)
    elif state.view is not None and isinstance(outcome, Connected | Observed | AttemptRan) \
            and outcome.epoch == state.view.epoch:  # an outcome of an epoch left since is void
        if isinstance(outcome, Connected):
            state = replace(state, connected=True)
            if outcome.broke:
                return _broke(state, inputs, now, outcome.epoch, outcome.can_shrink,
                              why="connecting ahead broke the transport")
        elif isinstance(outcome, AttemptRan):
            state = replace(state, seq=max(state.seq, outcome.seq + 1))
            if outcome.broke:
                return _broke(state, inputs, now, outcome.epoch, outcome.can_shrink,
                              why=f"attempt {outcome.seq} broke the transport")
        elif outcome.attempt is None:
            return Idle(s.idle_wake_s, why=f"no attempt {state.seq} in epoch {state.view.epoch} yet"), state
        else:
            found = outcome.attempt
            # Later than seq: this rank took no part in the attempts pruned meanwhile. The
            # attempt runs in the epoch it was found in, even if a newer one is out already:
            # it then aborts at once, and its done key tells the coordinator so.
            if s.member_id in found.spec.participants:
                return (RunAttempt(state.view.epoch, found.seq, found.spec, why="this rank takes part"),
                        replace(state, seq=max(state.seq, found.seq)))
            state = replace(state, seq=max(state.seq, found.seq + 1))
    return _next(state, inputs, now)


def _broke(state: AgentState, inputs: AgentInputs, now: float, epoch: int, can_shrink: bool,
           why: str) -> tuple[Action, AgentState]:
    """``epoch``'s transport is unusable. One that can shrink stays with the communicator
    manager: the next epoch shrinks it (a dead peer) or rebuilds it (a reform once one is
    due). Else (gloo, or a failed formation) every rank of the epoch rebuilds, now."""
    if can_shrink:
        return _next(replace(state, broken_epoch=epoch, broken_at=now, reform_asked=False), inputs, now)
    state = replace(state, view=None, seq=0, connected=False, broken_epoch=epoch, broken_at=now, reform_asked=True)
    return AwaitEpoch(epoch, inputs.settings.epoch_deadline_s, request_reform=True, why=why), state


def _next(state: AgentState, inputs: AgentInputs, now: float) -> tuple[Action, AgentState]:
    """The action the state and the latest view call for (no outcome left to take in)."""
    s = inputs.settings
    latest = inputs.view
    if latest is None or not lists(latest, s):
        return AwaitMembership(s.poll_s, why="the latest view does not list this incarnation"), state
    if latest.epoch == state.broken_epoch:
        # Wait for the next epoch (the leader's, without a dead peer), asking for a reform
        # once no such epoch came in time.
        due_in = reform_due_in(max(0.0, now - state.broken_at), s.ttl_s)
        ask = not state.reform_asked and due_in == 0.0
        asked = state.reform_asked or ask
        wait_s = s.epoch_deadline_s if asked else max(s.poll_s, due_in)
        why = "reform due" if ask else ("reform asked" if asked else f"reform due in {due_in:.3f} s")
        return (AwaitEpoch(state.broken_epoch, wait_s, request_reform=ask, why=f"epoch {latest.epoch} broken: {why}"),
                replace(state, reform_asked=asked))
    if state.view is None or latest.epoch != state.view.epoch:
        broken = state.view is not None and state.view.epoch == state.broken_epoch
        return EnterEpoch(latest, state.view, broken, why=f"epoch {latest.epoch} is new"), state
    if not state.connected:
        return ConnectAhead(latest.epoch, why="epoch entered"), state
    is_coordinator = state.view.members[0].member_id == s.member_id  # rank 0 of the epoch
    return Observe(latest.epoch, state.seq, is_coordinator, why="steady in the epoch"), state
