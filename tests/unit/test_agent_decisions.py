"""Table tests of the agent's state machine, ``decide`` (runtime/agent.py).

Each row is one situation: the agent's state, the latest membership view, the outcome of
the action the driver executed last and the clock; and what must follow: the action and
the state after it. The coordinator's decisions (``coordinator_tidy``, ``coordinate``) are
tables too, their version states built with ``test_runtime_decisions``' helpers. The agent here is inference rank ``i0`` (incarnation ``a``) unless a
row says otherwise. A hypothesis property then drives ``decide`` through random runs (views
changing, actions succeeding, breaking, faulting) and checks what must hold on every turn.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from elastic_refit.membership.view import MemberRecord, MembershipView
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_refit.runtime.agent import (
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
    Rejoin,
    RunAttempt,
    decide,
    lists,
)
from elastic_refit.runtime.attempt import (
    CATCH_UP,
    REFIT,
    REFORM_GRACE_S,
    AttemptSpec,
    CommitAction,
    version_digest,
)
from elastic_refit.runtime.config import RefitConfig
from elastic_refit.runtime.coordination import Propose, Refuse, Tidy, coordinate, coordinator_tidy
from tests.unit.test_runtime_decisions import state as version_state
from tests.unit.test_runtime_decisions import view as version_view

TTL_S, POLL_S, COLLECTIVE_S, DEADLINE_S, IDLE_S = 2, 0.02, 1.5, 10.0, 5.0


def agent(member_id: str = "i0", incarnation: str = "a") -> AgentSettings:
    return AgentSettings(member_id, incarnation, ttl_s=TTL_S, poll_s=POLL_S, collective_timeout_s=COLLECTIVE_S,
                         epoch_deadline_s=DEADLINE_S, idle_wake_s=IDLE_S)


def member(name: str) -> MemberRecord:
    """``t*`` trainers, ``i*`` inference ranks; ``name@inc`` sets the incarnation (default ``a``)."""
    name, _, inc = name.partition("@")
    role = "trainer" if name.startswith("t") else "inference"
    return MemberRecord(role=role, member_id=name, incarnation=inc or "a", host="h", domain=f"d-{role}",
                        device="cpu", layout_rank=0)


def view(epoch: int, *names: str) -> MembershipView:
    """The epoch's members in rank order: the first is the coordinator."""
    return MembershipView(epoch=epoch, members=tuple(member(n) for n in names or ("t0", "i0", "i1")))


def spec(*destinations: str, version: int = 7) -> AttemptSpec:
    return AttemptSpec(version, REFIT, ("t0",), (), tuple(sorted(destinations)))


V1, V2 = view(1), view(2)
MINE = spec("i0", "i1")  # i0 takes part
OTHERS = spec("i1")  # i0 does not
STEADY = AgentState(view=V1, seq=3, connected=True)  # in epoch 1, looking for attempt 3
NOW = 100.0


def broken(epoch: int = 1, at: float = NOW, asked: bool = False, view: MembershipView | None = V1,
           seq: int = 3) -> AgentState:
    """An agent whose epoch ``epoch`` broke at ``at`` (``view`` None: it was dropped, gloo)."""
    return AgentState(view=view, seq=seq if view else 0, connected=view is not None, broken_epoch=epoch,
                      broken_at=at, reform_asked=asked)


# name, state, latest view, outcome, now, expected action, expected state (None: unchanged), settings
ROWS = [
    # ---- membership: is this incarnation listed?
    ("no view yet", AgentState(), None, None, NOW, AwaitMembership(POLL_S), None, agent()),
    ("not in the view", AgentState(), view(1, "t0", "i1"), None, NOW, AwaitMembership(POLL_S), None, agent()),
    ("an earlier incarnation listed", AgentState(), view(1, "t0", "i0@old"), None, NOW,
     AwaitMembership(POLL_S), None, agent()),
    ("dropped from the view while steady", STEADY, view(2, "t0", "i1"), None, NOW,
     AwaitMembership(POLL_S), None, agent()),
    ("membership lost -> fail", STEADY, V1, Lost("lease expired"), NOW, Fail("lease expired"), None, agent()),
    ("membership lost while not listed", AgentState(), None, Lost("gone"), NOW, Fail("gone"), None, agent()),
    ("lease lost while steady -> rejoin as a new incarnation, from no epoch", STEADY, V1,
     Lost("lease expired", rejoin=True), NOW, Rejoin("lease expired"), AgentState(), agent()),
    ("lease lost while broken -> rejoin, nothing of the old epochs kept", broken(), V2,
     Lost("fenced as a suspect", rejoin=True), NOW, Rejoin("fenced as a suspect"), AgentState(), agent()),
    # ---- entering epochs
    ("first epoch", AgentState(), V1, None, NOW, EnterEpoch(V1, None, broken=False), None, agent()),
    ("new epoch after a steady one", STEADY, V2, None, NOW, EnterEpoch(V2, V1, broken=False), None, agent()),
    ("new epoch after a broken one that can shrink", broken(), V2, None, NOW,
     EnterEpoch(V2, V1, broken=True), None, agent()),
    ("new epoch after a broken one that was dropped (gloo)", broken(view=None, asked=True), V2, None, NOW,
     EnterEpoch(V2, None, broken=False), None, agent()),
    ("entered -> connect ahead", AgentState(), V1, Entered(V1), NOW, ConnectAhead(1),
     AgentState(view=V1), agent()),
    ("entered a later epoch -> seq starts over", STEADY, V2, Entered(V2), NOW, ConnectAhead(2),
     AgentState(view=V2), agent()),
    ("entered, but a newer epoch is out already", AgentState(), V2, Entered(V1), NOW,
     EnterEpoch(V2, V1, broken=False), AgentState(view=V1), agent()),
    ("communicator failure -> reform now", STEADY, V2, CommunicatorFailed(2), NOW,
     AwaitEpoch(2, DEADLINE_S, request_reform=True), broken(epoch=2, view=None, asked=True), agent()),
    # ---- steady in an epoch: observe the versions, coordinator or not
    ("connected -> observe (not the coordinator)", AgentState(view=V1), V1, Connected(1), NOW,
     Observe(1, 0, coordinate=False), AgentState(view=V1, connected=True), agent()),
    ("connected -> observe (the coordinator)", AgentState(view=V1), V1, Connected(1), NOW,
     Observe(1, 0, coordinate=True), AgentState(view=V1, connected=True), agent("t0")),
    ("the coordinator is the epoch's first member", AgentState(view=view(1, "i0", "t0"), connected=True),
     view(1, "i0", "t0"), None, NOW, Observe(1, 0, coordinate=True), None, agent()),
    ("connecting ahead broke a transport that can shrink", AgentState(view=V1), V1,
     Connected(1, broke=True, can_shrink=True), NOW, AwaitEpoch(1, TTL_S + REFORM_GRACE_S),
     broken(seq=0), agent()),
    ("connecting ahead broke gloo -> reform now", AgentState(view=V1), V1, Connected(1, broke=True), NOW,
     AwaitEpoch(1, DEADLINE_S, request_reform=True), broken(view=None, asked=True), agent()),
    ("no attempt -> idle until a key changes", STEADY, V1, Observed(1, None), NOW, Idle(IDLE_S), None, agent()),
    ("attempt found, this rank takes part", STEADY, V1, Observed(1, NextAttempt(3, MINE)), NOW,
     RunAttempt(1, 3, MINE), None, agent()),
    ("a later attempt found (earlier ones pruned)", STEADY, V1, Observed(1, NextAttempt(5, MINE)), NOW,
     RunAttempt(1, 5, MINE), replace(STEADY, seq=5), agent()),
    ("attempt found, not a participant -> skip it, look again", STEADY, V1,
     Observed(1, NextAttempt(3, OTHERS)), NOW, Observe(1, 4, coordinate=False), replace(STEADY, seq=4), agent()),
    ("the coordinator skips an attempt it is not in", replace(STEADY, view=view(1, "t9", "t0")),
     view(1, "t9", "t0"), Observed(1, NextAttempt(3, OTHERS)), NOW, Observe(1, 4, coordinate=True),
     replace(STEADY, view=view(1, "t9", "t0"), seq=4), agent("t9")),
    ("attempt found after a newer epoch came: it runs (and aborts) in its own", STEADY, V2,
     Observed(1, NextAttempt(3, MINE)), NOW, RunAttempt(1, 3, MINE), None, agent()),
    ("attempt ran -> the next one", STEADY, V1, AttemptRan(1, 3), NOW, Observe(1, 4, coordinate=False),
     replace(STEADY, seq=4), agent()),
    ("attempt ran and a newer epoch is out", STEADY, V2, AttemptRan(1, 3), NOW, EnterEpoch(V2, V1),
     replace(STEADY, seq=4), agent()),
    ("attempt broke a transport that can shrink -> wait, reform later", STEADY, V1,
     AttemptRan(1, 3, broke=True, can_shrink=True), NOW, AwaitEpoch(1, TTL_S + REFORM_GRACE_S),
     broken(seq=4), agent()),
    ("attempt broke gloo -> drop the communicator, reform now", STEADY, V1, AttemptRan(1, 3, broke=True), NOW,
     AwaitEpoch(1, DEADLINE_S, request_reform=True), broken(view=None, asked=True), agent()),
    ("an outcome of an epoch left since is void", AgentState(view=V2, connected=True), V2,
     Observed(1, NextAttempt(0, MINE)), NOW, Observe(2, 0, coordinate=False), None, agent()),
    # ---- a broken epoch: wait for its successor, ask for a reform once due
    ("broken, reform not due yet", broken(at=NOW - 1.0), V1, None, NOW,
     AwaitEpoch(1, TTL_S + REFORM_GRACE_S - 1.0), None, agent()),
    ("broken, reform due in less than a poll", broken(at=NOW - TTL_S - REFORM_GRACE_S + 0.001), V1, None, NOW,
     AwaitEpoch(1, POLL_S), None, agent()),
    ("broken, reform due -> ask once", broken(at=NOW - TTL_S - REFORM_GRACE_S), V1, None, NOW,
     AwaitEpoch(1, DEADLINE_S, request_reform=True), broken(at=NOW - TTL_S - REFORM_GRACE_S, asked=True), agent()),
    ("broken, reform asked already -> wait the deadline", broken(asked=True), V1, None, NOW + 60,
     AwaitEpoch(1, DEADLINE_S), None, agent()),
    ("broken, a clock behind broken_at counts as just broken", broken(at=NOW + 5), V1, None, NOW,
     AwaitEpoch(1, TTL_S + REFORM_GRACE_S), None, agent()),
    ("broken and not listed -> membership first", broken(), view(1, "t0", "i1"), None, NOW,
     AwaitMembership(POLL_S), None, agent()),
    # ---- faults outside attempts: skip the attempt, back off until the epoch changes
    ("fault in an epoch -> back off, next attempt", STEADY, V1, Faulted("EtcdError: down"), NOW,
     Backoff(1, COLLECTIVE_S), replace(STEADY, seq=4), agent()),
    ("fault before any epoch", AgentState(), V1, Faulted("RuntimeError: hook"), NOW, Backoff(0, COLLECTIVE_S),
     None, agent()),
    ("fault after a failed formation", broken(view=None, asked=True), V1, Faulted("x"), NOW,
     Backoff(0, COLLECTIVE_S), None, agent()),
]


@pytest.mark.parametrize(("name", "state", "latest", "outcome", "now", "action", "after", "me"), ROWS,
                         ids=[r[0] for r in ROWS])
def test_decide(name, state, latest, outcome, now, action, after, me) -> None:
    got, new = decide(state, AgentInputs(me, latest, outcome), now)
    assert got == action, f"{name}: {got!r} ({got.why})"
    assert new == (state if after is None else after), name
    assert got.why, f"{name}: every action says why"


def test_decide_is_deterministic_and_keeps_its_inputs() -> None:
    for _, state, latest, outcome, now, _, _, me in ROWS:
        inputs = AgentInputs(me, latest, outcome)
        assert decide(state, inputs, now) == decide(state, inputs, now)


def test_lists_matches_incarnation() -> None:
    assert lists(V1, agent())
    assert not lists(V1, agent(incarnation="b"))
    assert not lists(view(1, "t0", "i1"), agent())
    assert not lists(None, agent())


def test_settings_of_config() -> None:
    config = RefitConfig(job="j", role="inference", member_id="i0", layout_rank=0, etcd=("127.0.0.1:2379",))
    s = AgentSettings.of(config)
    assert (s.member_id, s.incarnation, s.ttl_s, s.idle_wake_s) == ("i0", config.incarnation, config.ttl_s,
                                                                     config.idle_wake_s)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: AgentState(seq=-1), "seq must be an int >= 0, got -1"),
    (lambda: AgentState(seq=2), "no seq nor connection, got seq 2"),
    (lambda: AgentState(connected=True), "connected True"),
    (lambda: AgentState(broken_epoch=-2), "broken_epoch must be an int >= -1, got -2"),
    (lambda: AgentState(broken_at=float("nan")), "broken_at must be finite"),
    (lambda: replace(agent(), poll_s=0), "poll_s must be a finite number of seconds > 0, got 0"),
    (lambda: replace(agent(), member_id=""), "member_id and incarnation must be non-empty"),
    (lambda: EnterEpoch(V1, V1), "entering epoch 1 from itself"),
    (lambda: EnterEpoch(V1, None, broken=True), "only a previous epoch can be broken"),
    (lambda: AwaitEpoch(1, float("inf")), "timeout_s must be a finite number"),
    (lambda: Observe(1, -1, False), "seq must be an int >= 0, got -1"),
])
def test_bad_values_are_refused(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


# ---- property: random runs of the driver ---------------------------------------------------
# Views the membership can show: the epoch only moves forward; this agent (i0@a) may be
# listed, missing, or listed under an older incarnation.
_LISTINGS = [("t0", "i0", "i1")] * 4 + [("i0", "t0"), ("t0", "i1"), ("t0", "i0@old")]


@st.composite
def runs(draw):
    """A run: per turn, whether the epoch moves on, how this agent is listed, what the
    action executed brings (an index into its possible outcomes) and the seconds passing."""
    n = draw(st.integers(1, 60))
    return [(draw(st.booleans()) and draw(st.booleans()), draw(st.sampled_from(_LISTINGS)),
             draw(st.integers(0, 20)), draw(st.sampled_from([0.0, 0.01, 0.5, 2.0, 4.0])))
            for _ in range(n)]


def _outcome(action, pick: int, later_seq: int):
    """What the simulated driver brings back from ``action`` (``pick`` chooses)."""
    if pick == 20:  # rare: it ends the run
        return Lost("lease gone")
    pick %= 5
    if isinstance(action, EnterEpoch):
        return [Entered(action.view), CommunicatorFailed(action.epoch), Faulted("hook"), Entered(action.view),
                Entered(action.view)][pick]
    if isinstance(action, ConnectAhead):
        return [Connected(action.epoch), Connected(action.epoch, broke=True),
                Connected(action.epoch, broke=True, can_shrink=True), Faulted("etcd"), Connected(action.epoch)][pick]
    if isinstance(action, Observe):
        return [Observed(action.epoch, None), Observed(action.epoch, NextAttempt(action.seq, MINE)),
                Observed(action.epoch, NextAttempt(action.seq + later_seq, OTHERS)), Faulted("etcd"),
                Observed(action.epoch, NextAttempt(action.seq + later_seq, MINE))][pick]
    if isinstance(action, RunAttempt):
        return [AttemptRan(action.epoch, action.seq), AttemptRan(action.epoch, action.seq, broke=True),
                AttemptRan(action.epoch, action.seq, broke=True, can_shrink=True), AttemptRan(action.epoch, action.seq),
                AttemptRan(action.epoch, action.seq)][pick]
    return None  # waits bring nothing but time


@settings(max_examples=300, deadline=None)
@given(runs())
def test_decide_over_random_runs(run) -> None:
    me = agent()
    state, outcome, epoch, now = AgentState(), None, 1, 0.0
    reforms: dict[int, int] = {}
    for turn, (bump, listing, pick, dt) in enumerate(run):
        epoch += bump
        latest = view(epoch, *listing)
        inputs = AgentInputs(me, latest, outcome)
        action, new = decide(state, inputs, now)
        assert (action, new) == decide(state, inputs, now), "decide is a function of its inputs"
        # Fail exactly when the membership is lost, and then nothing else.
        assert isinstance(action, Fail) == isinstance(outcome, Lost)
        if isinstance(action, Fail):
            return
        # Never an action for an epoch whose view does not list this incarnation.
        if isinstance(action, EnterEpoch):
            assert action.view is latest and lists(latest, me) and action.epoch != state.broken_epoch
        if isinstance(action, ConnectAhead | Observe):
            assert action.epoch == latest.epoch == new.epoch and lists(latest, me)
        if isinstance(action, RunAttempt):
            assert action.epoch == new.epoch and lists(new.view, me) and me.member_id in action.spec.participants
            assert action.seq == new.seq
        # Within an epoch, seq never decreases.
        if state.view is not None and new.view is not None and state.epoch == new.epoch:
            assert new.seq >= state.seq, f"turn {turn}: seq {state.seq} -> {new.seq}"
        # A broken epoch is never entered again, and asks for one reform at most.
        if isinstance(action, AwaitEpoch):
            assert action.after_epoch == new.broken_epoch
            reforms[action.after_epoch] = reforms.get(action.after_epoch, 0) + action.request_reform
            assert reforms[action.after_epoch] <= 1
        state = new
        outcome = _outcome(action, pick, later_seq=1 + turn % 3)
        now += dt


# ---- the coordinator: tidy up after an attempt, then move -----------------------------------
TIDY_ROWS = [
    # name, seq, previous finished, uncounted, pruned, has store, expected
    ("the epoch's first attempt", 0, False, None, None, True, Tidy(True)),
    ("previous attempt still running", 3, False, (1, 2), None, True, Tidy(False)),
    ("previous finished, proposed by me: count it, prune seq-2", 3, True, (1, 2), None, True,
     Tidy(True, count=2, prune=1, reread=True)),
    ("previous proposed by another coordinator: nothing to count", 3, True, None, None, True,
     Tidy(True, prune=1, reread=True)),
    ("uncounted is of another epoch", 3, True, (0, 2), None, True, Tidy(True, prune=1, reread=True)),
    ("uncounted is an older attempt", 3, True, (1, 1), None, True, Tidy(True, prune=1, reread=True)),
    ("seq-2 pruned already", 3, True, (1, 2), (1, 1), True, Tidy(True, count=2, reread=True)),
    ("an earlier epoch's prune does not count", 3, True, None, (0, 1), True, Tidy(True, prune=1, reread=True)),
    ("second attempt: nothing to prune yet", 1, True, (1, 0), None, True, Tidy(True, count=0, reread=True)),
    ("no store: count, but prune nothing", 3, True, (1, 2), None, False, Tidy(True, count=2, reread=True)),
]


@pytest.mark.parametrize(("name", "seq", "finished", "uncounted", "pruned", "has_store", "expected"), TIDY_ROWS,
                         ids=[r[0] for r in TIDY_ROWS])
def test_coordinator_tidy(name, seq, finished, uncounted, pruned, has_store, expected) -> None:
    got = coordinator_tidy(1, seq, previous_finished=finished, uncounted=uncounted, pruned=pruned,
                           has_store=has_store)
    assert got == expected, f"{name}: {got!r} ({got.why})"
    assert got.why


# Attempt seq-1 absent from the keys read (the ledger counts that as finished): the
# coordinator's own proposal is only not watched yet, so it waits (an H100 run proposed 23
# catch-ups of one version in 160 ms, pruning the attempts its participants were in);
# anyone else's was pruned or never proposed.
ABSENT_ROWS = [
    # name, seq, uncounted, expected
    ("its own proposal, not watched yet: wait (no count, no prune, no proposal)", 3, (1, 2), Tidy(False)),
    ("its own first proposal, not watched yet: wait", 1, (1, 0), Tidy(False)),
    ("proposed by another coordinator: finished", 3, None, Tidy(True, prune=1, reread=True)),
    ("its own proposal of an earlier epoch: finished", 3, (0, 2), Tidy(True, prune=1, reread=True)),
    ("its own older proposal (a fault skipped seq-1): finished", 3, (1, 1), Tidy(True, prune=1, reread=True)),
]


@pytest.mark.parametrize(("name", "seq", "uncounted", "expected"), ABSENT_ROWS, ids=[r[0] for r in ABSENT_ROWS])
def test_coordinator_tidy_with_the_previous_attempt_absent(name, seq, uncounted, expected) -> None:
    got = coordinator_tidy(1, seq, previous_finished=True, previous_absent=True, uncounted=uncounted, pruned=None,
                           has_store=True)
    assert got == expected, f"{name}: {got!r} ({got.why})"
    assert got.why


def test_a_waiting_coordinator_does_nothing_else() -> None:
    with pytest.raises(ValueError, match="does nothing else, got count 2"):
        Tidy(False, count=2)


PAIR = version_view("t0", "t1", "i0", "i1", epoch=4)
AGREE = None  # disagreement(): the sources agree


def _refit(destinations=("i0", "i1"), holders=()):
    return AttemptSpec(2, REFIT, ("t0", "t1"), tuple(holders), tuple(destinations),
                       tuple((m, "") for m in ("t0", "t1", *holders, *destinations)))


COORDINATE_ROWS = [
    # name, version state, feasible, disagreement (None: not checked), expected move
    ("nothing published", version_state(), None, None, None),
    ("one trainer of two published: wait", version_state(sources={2: ["t0"]}), None, None, None),
    ("every trainer published: propose the refit", version_state(sources={2: ["t0", "t1"]}), None, None,
     Propose(5, _refit())),
    ("sources agree: propose", version_state(sources={2: ["t0", "t1"]}), None, lambda spec: AGREE,
     Propose(5, _refit())),
    ("sources disagree: refuse before any attempt", version_state(sources={2: ["t0", "t1"]}), None,
     lambda spec: "region 3 differs", Refuse(2, "region 3 differs")),
    ("infeasible: nothing", version_state(sources={2: ["t0", "t1"]}), lambda spec: False, None, None),
    ("every inference rank holds it: commit", version_state(sources={2: ["t0", "t1"]}, acks={2: ["i0", "i1"]}),
     None, lambda spec: "never asked", "commit"),
    ("catch-up is never checked for replicas",
     version_state(sources={2: ["t0", "t1"]}, acks={2: ["i0"]}, committed=(2,)), None,
     lambda spec: "never asked", Propose(5, AttemptSpec(2, CATCH_UP, (), ("i0",), ("i1",),
                                                          (("i0", ""), ("i1", ""))))),
]


@pytest.mark.parametrize(("name", "versions", "feasible", "disagreement", "expected"), COORDINATE_ROWS,
                         ids=[r[0] for r in COORDINATE_ROWS])
def test_coordinate(name, versions, feasible, disagreement, expected) -> None:
    got = coordinate(PAIR, 5, versions, feasible=feasible, disagreement=disagreement)
    if expected == "commit":
        expected = CommitAction(2, version_digest(versions, 2, PAIR.members_of("inference")))
    assert got == expected, name


def test_refuse_cause_names_the_disagreement() -> None:
    assert Refuse(2, "region 3 differs").cause == "ValueError: region 3 differs"
