"""The coordinator's decisions, pure: what rank 0 of an epoch does at attempt ``seq``.

Before its move it tidies the attempts before it (:func:`coordinator_tidy`: wait, count,
prune, re-read); its move commits what every live inference rank holds, proposes the next
attempt or refuses a version whose sources disagree (:func:`coordinate`); counting an
attempt's done values may give a version up (:func:`counted`). What it remembers between
moves is frozen data (:class:`CoordinatorState`). Nothing here does I/O or reads a clock:
``runtime.coordinator.Coordinator`` reads etcd for these functions and carries out what
they decide; ``tests/unit/test_agent_decisions.py`` tests them as tables.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from elastic_refit.membership.attempts import REFIT, AttemptSpec, Done
from elastic_refit.membership.versions import VersionState
from elastic_refit.membership.view import MembershipView
from elastic_refit.runtime.attempt import (
    CommitAction,
    FailureTally,
    attempt_cause,
    count_failure,
    next_action,
)

__all__ = ["CoordinatorMove", "CoordinatorState", "GiveUp", "Proposal", "Propose", "Refuse", "Tidy", "coordinate",
           "coordinator_tidy", "counted", "forget_settled", "proposed"]


def _check_seq(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class Tidy:
    """What the epoch's coordinator does before its move at attempt ``seq``: ``proceed``
    False while attempt ``seq - 1`` is still running somewhere (nothing else then);
    ``count``: the attempt it proposed and has not counted yet (see ``count_failure``);
    ``prune``: the attempt whose keys go; ``reread``: read the version state again."""

    proceed: bool
    count: int | None = None
    prune: int | None = None
    reread: bool = False
    why: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.proceed and (self.count is not None or self.prune is not None or self.reread):
            raise ValueError(f"a coordinator that waits does nothing else, got count {self.count}, "
                             f"prune {self.prune}, reread {self.reread}")
        for name in ("count", "prune"):
            value = getattr(self, name)
            if value is not None:
                _check_seq(name, value)


def coordinator_tidy(epoch: int, seq: int, *, previous_finished: bool, uncounted: tuple[int, int] | None,
                     pruned: tuple[int, int] | None, has_store: bool, previous_absent: bool = False) -> Tidy:
    """Before the coordinator of ``epoch`` moves at attempt ``seq`` (pure).

    ``previous_finished``: attempt ``seq - 1`` is absent or every participant wrote its
    done key; ``previous_absent``: it is absent from the keys read (the epoch watch's);
    ``uncounted``: the (epoch, seq) this coordinator proposed last and has not counted;
    ``pruned``: the (epoch, seq) it pruned last; ``has_store``: the epoch's store is open.
    Attempt ``seq - 1`` was proposed once ``seq - 2`` had finished everywhere, so nobody
    reads ``seq - 2`` again (a member that fell behind skips to the next one). Acks land
    before the done keys: a state read before ``seq - 1`` finished may miss the last ones
    and propose a redundant catch-up, so it is read again.

    An attempt this coordinator proposed and that is absent has not finished: only this
    coordinator prunes, two attempts later, so its watch has not brought it back yet. Taking
    it for finished proposed the same attempt again at once, and pruned the one before,
    which its participants were still in (an H100 run: 23 catch-ups of one version in 160 ms,
    the restarted rank waiting for plan keys the prune had deleted). It waits instead: the
    watch wakes it.
    """
    _check_seq("epoch", epoch)
    _check_seq("seq", seq)
    if seq == 0:
        return Tidy(True, why="the epoch's first attempt")
    if previous_absent and uncounted == (epoch, seq - 1):
        return Tidy(False, why=f"attempt {seq - 1}, proposed here, is not in the watched keys yet")
    if not previous_finished:
        return Tidy(False, why=f"attempt {seq - 1} is still running")
    count = seq - 1 if uncounted == (epoch, seq - 1) else None
    prune = seq - 2 if seq >= 2 and pruned != (epoch, seq - 2) and has_store else None
    return Tidy(True, count, prune, reread=True, why=f"attempt {seq - 1} finished")


@dataclass(frozen=True, slots=True)
class Propose:
    """Propose ``spec`` as attempt ``seq`` of the epoch (unless one is there already)."""

    seq: int
    spec: AttemptSpec

    def __post_init__(self) -> None:
        _check_seq("seq", self.seq)


@dataclass(frozen=True, slots=True)
class Refuse:
    """Give ``version`` up before any attempt: it can never be planned with these members, or
    its sources disagree (``reason`` says why)."""

    version: int
    reason: str

    @property
    def cause(self) -> str:
        """The cause the ``failed`` record carries (as ``fault_cause`` spells a ``ValueError``)."""
        return f"ValueError: {self.reason}"


CoordinatorMove = CommitAction | Propose | Refuse


def coordinate(view: MembershipView, seq: int, state: VersionState, *,
               feasible: Callable[[AttemptSpec], bool] | None = None,
               disagreement: Callable[[AttemptSpec], str | None] | None = None,
               holders_serve: Callable[[AttemptSpec], bool] | None = None) -> CoordinatorMove | None:
    """The coordinator's move at attempt ``seq`` of ``view``'s epoch (pure, given pure
    ``feasible`` and ``disagreement``): commit what every live inference rank holds,
    propose the attempt :func:`~elastic_refit.runtime.attempt.next_action` calls for, or
    refuse a new version whose sources disagree on a region they share (``disagreement``
    says where, None: they agree; not given: replicas are not checked); None: nothing.
    ``holders_serve`` goes to ``next_action``."""
    _check_seq("seq", seq)
    action = next_action(view, state, feasible=feasible, holders_serve=holders_serve)
    if isinstance(action, AttemptSpec) and action.kind == REFIT and disagreement is not None:
        where = disagreement(action)
        if where is not None:  # nothing has moved: the version is refused before any attempt
            return Refuse(action.version, where)
    if isinstance(action, AttemptSpec):
        return Propose(seq, action)
    return action


@dataclass(frozen=True, slots=True)
class Proposal:
    """An attempt this coordinator proposed and has not counted yet."""

    view: MembershipView
    seq: int
    spec: AttemptSpec


@dataclass(frozen=True, slots=True)
class CoordinatorState:
    """What the coordinator remembers between moves: consecutive failed attempts per
    version, the attempt it proposed last and has not counted, the attempt it pruned last."""

    tallies: Mapping[int, FailureTally] = field(default_factory=dict)
    uncounted: Proposal | None = None
    pruned: tuple[int, int] | None = None  # (epoch, seq)

    def __post_init__(self) -> None:
        bad = [v for v, t in self.tallies.items() if t.version != v]
        if bad:
            raise ValueError(f"tallies must be keyed by their version, got {bad}")


@dataclass(frozen=True, slots=True)
class GiveUp:
    """``version`` failed ``num_attempts`` consecutive attempts for ``cause``."""

    version: int
    cause: str
    num_attempts: int


def proposed(state: CoordinatorState, proposal: Proposal) -> CoordinatorState:
    return replace(state, uncounted=proposal)


def counted(state: CoordinatorState, proposal: Proposal, done: Mapping[str, Done],
            max_attempts: int) -> tuple[CoordinatorState, GiveUp | None]:
    """The state after counting ``proposal``'s attempt from its participants' ``done``
    values (those that wrote one), and whether its version is given up (pure).

    Every participant ok: the version's tally goes. No own fault (only consequences: the
    epoch moved on, etcd, a lease): nothing counts. Else the tally grows
    (``count_failure``); at ``max_attempts`` the version is given up."""
    spec = proposal.spec
    tallies = dict(state.tallies)
    if len(done) == len(spec.participants) and all(d.ok for d in done.values()):
        tallies.pop(spec.version, None)
        return replace(state, tallies=tallies), None
    cause = attempt_cause(done)
    if cause is None:
        return state, None
    tally = count_failure(tallies.get(spec.version), proposal.view, spec.version, cause)
    tallies[spec.version] = tally
    give_up = GiveUp(spec.version, cause, tally.num_attempts) if tally.num_attempts >= max_attempts else None
    return replace(state, tallies=tallies), give_up


def forget_settled(state: CoordinatorState, versions: VersionState) -> CoordinatorState:
    """Tallies of versions that failed or that a commit settled are dropped."""
    latest = versions.latest_committed
    settled = [v for v in state.tallies if v in versions.failed or (latest is not None and v <= latest)]
    if not settled:
        return state
    return replace(state, tallies={v: t for v, t in state.tallies.items() if v not in settled})
