"""The coordinator's memory as frozen data turned by pure functions (issue 33): counting an
attempt from its done values, giving a version up, forgetting settled versions. Tables."""

from __future__ import annotations

import pytest
from elastic_refit.membership.attempts import OK, REFIT, AttemptSpec, Done
from elastic_refit.membership.versions import Commit, Failure, VersionState

from elastic_refit.runtime.attempt import FailureTally
from elastic_refit.runtime.coordination import (
    CoordinatorState,
    GiveUp,
    Proposal,
    counted,
    forget_settled,
    proposed,
)
from tests.unit.test_agent_decisions import view

V1, V2 = view(1), view(2, "t0", "i0", "i1@b")  # epoch 2: i1 restarted
SPEC = AttemptSpec(7, REFIT, ("t0",), (), ("i0", "i1"))
SHAPE = "ValueError: tensor 'w': source is [64, 32], destination is [64, 16]"
ABORT = "TransportAborted: peer t0 aborted"


def tally(n: int, cause: str = SHAPE, v=V1) -> FailureTally:
    return FailureTally(7, cause, n, v.identities)


# name, tallies before, view of the attempt, done values, max attempts, tallies after, give up
ROWS = [
    ("every participant ok: the tally goes", {7: tally(2)}, V1,
     {"t0": OK, "i0": OK, "i1": OK}, 3, {}, None),
    ("one missing done value: not all ok, no own fault: nothing counts", {7: tally(1)}, V1,
     {"t0": OK, "i0": OK}, 3, {7: tally(1)}, None),
    ("only consequences (aborted): nothing counts", {}, V1,
     {"t0": Done.aborted("epoch 2 superseded"), "i0": OK, "i1": OK}, 3, {}, None),
    ("first own fault: a tally of 1", {}, V1,
     {"t0": OK, "i0": Done.failed(SHAPE), "i1": OK}, 3, {7: tally(1)}, None),
    ("the same cause again: it grows", {7: tally(1)}, V1,
     {"t0": OK, "i0": Done.failed(SHAPE), "i1": OK}, 3, {7: tally(2)}, None),
    ("at max attempts: given up", {7: tally(2)}, V1,
     {"t0": OK, "i0": Done.failed(SHAPE), "i1": OK}, 3, {7: tally(3)}, GiveUp(7, SHAPE, 3)),
    ("the own fault wins over the aborts it caused", {7: tally(2)}, V1,
     {"t0": Done.failed(ABORT), "i0": Done.failed(SHAPE), "i1": Done.failed(ABORT)}, 3, {7: tally(3)},
     GiveUp(7, SHAPE, 3)),
    ("another cause starts over", {7: tally(2)}, V1,
     {"t0": OK, "i0": Done.failed(ABORT), "i1": OK}, 3, {7: tally(1, ABORT)}, None),
    ("other members (a restart) start over", {7: tally(2)}, V2,
     {"t0": OK, "i0": Done.failed(SHAPE), "i1": OK}, 3, {7: tally(1, v=V2)}, None),
]


@pytest.mark.parametrize(("name", "before", "v", "done", "max_attempts", "after", "give_up"), ROWS,
                         ids=[r[0] for r in ROWS])
def test_counted(name, before, v, done, max_attempts, after, give_up):
    proposal = Proposal(v, 4, SPEC)
    state = proposed(CoordinatorState(tallies=before), proposal)
    assert state.uncounted == proposal
    got, given_up = counted(state, proposal, done, max_attempts)
    assert (dict(got.tallies), given_up) == (after, give_up)
    assert dict(state.tallies) == before  # frozen: the old state is untouched


def _versions(committed=(), failed=()) -> VersionState:
    return VersionState(revision=9, committed={v: Commit(v, 1, "d") for v in committed},
                        failed={v: Failure(v, "c", 3, 1) for v in failed})


@pytest.mark.parametrize(("name", "tallies", "versions", "kept"), [
    ("nothing settled", (7, 8), _versions(committed=(6,)), (7, 8)),
    ("a commit settles it and every older one", (5, 7, 8), _versions(committed=(7,)), (8,)),
    ("a failure settles it", (7, 8), _versions(failed=(8,)), (7,)),
    ("no tallies", (), _versions(committed=(9,)), ()),
])
def test_forget_settled(name, tallies, versions, kept):
    state = CoordinatorState(tallies={v: FailureTally(v, "c", 1, V1.identities) for v in tallies})
    assert tuple(forget_settled(state, versions).tallies) == kept


def test_state_rejects_a_tally_under_another_version():
    with pytest.raises(ValueError, match=r"tallies must be keyed by their version, got \[8\]"):
        CoordinatorState(tallies={8: tally(1)})
