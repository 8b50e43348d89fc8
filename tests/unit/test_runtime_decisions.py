"""Table-driven tests of the runtime's pure decisions: ``next_action`` (what the coordinator
does next), ``plan_attempt`` (the plan of one attempt), and when a version is given up
(``attempt_cause`` / ``count_failure``); plus ``RefitConfig`` validation.

Each table row is one situation: the members of the epoch, the version state in etcd, and
what must happen. Records are built directly (no etcd, no processes).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from elastic_refit.membership.attempts import Done
from elastic_refit.membership.versions import Ack, Commit, Failure, VersionState
from elastic_refit.membership.view import MemberRecord, MembershipView

from elastic_refit._validate import check_timeout
from elastic_refit.errors import RefitError, RefitFailed, RefitTimeout
from elastic_refit.layout import parse_spec
from elastic_refit.runtime import (
    AttemptSpec,
    CommitAction,
    RefitConfig,
    by_role,
    next_action,
    plan_attempt,
)
from elastic_refit.runtime.attempt import (
    CATCH_UP,
    REFIT,
    REFORM_GRACE_S,
    FailureTally,
    attempt_cause,
    check_publish,
    count_failure,
    fault_cause,
    own_catch_up,
    reform_due,
    reform_due_in,
    version_digest,
)

# ---- helpers ----------------------------------------------------------------------------

LAYOUT_RANKS = {"t0": 0, "t1": 1, "i0": 2, "i1": 3, "i2": 4, "i3": 5}


def member(name: str, inc: str = "a") -> MemberRecord:
    """``t*`` are trainers, ``i*`` inference ranks; ``name@inc`` sets the incarnation."""
    if "@" in name:
        name, inc = name.split("@")
    role = "trainer" if name.startswith("t") else "inference"
    return MemberRecord(role=role, member_id=name, incarnation=inc, host="h", domain=f"d-{role}",
                        device="cpu", layout_rank=LAYOUT_RANKS.get(name, -1))


def view(*names: str, epoch: int = 1) -> MembershipView:
    return MembershipView(epoch=epoch, members=tuple(member(n) for n in names))


def state(sources: dict[int, list[str]] | None = None, acks: dict[int, list[str]] | None = None,
          committed: tuple[int, ...] = (), failed: tuple[int, ...] = (), committed_epoch: int = 1) -> VersionState:
    """``sources``/``acks``: version -> ``["t0", "t1@old", ...]`` (incarnation ``a`` unless
    given after ``@``)."""
    def split(name: str) -> tuple[str, str]:
        return tuple(name.split("@")) if "@" in name else (name, "a")  # type: ignore[return-value]

    return VersionState(
        revision=1,
        sources={v: dict(split(n) for n in names) for v, names in (sources or {}).items()},
        acks={v: {m: Ack(inc, 1, f"digest-{m}-{v}") for m, inc in map(split, names)}
              for v, names in (acks or {}).items()},
        committed={v: Commit(v, committed_epoch, "d") for v in committed},
        failed={v: Failure(v, "ValueError: bad", 5, 1) for v in failed},
    )


def summary(action: AttemptSpec | CommitAction | None):
    if action is None:
        return None
    if isinstance(action, CommitAction):
        return ("commit", action.version)
    return (action.kind, action.version, action.sources, action.holders, action.destinations)


ALL = ("t0", "t1", "i0", "i1")
BOTH = ["t0", "t1"]

# ---- next_action ------------------------------------------------------------------------

NEXT_ACTION_ROWS = [
    # (id, members, state, feasible, expected)
    ("nothing published", ALL, state(), True, None),
    ("no trainers in the epoch", ("i0", "i1"), state(sources={1: BOTH}), True, None),
    ("not all trainers published", ALL, state(sources={1: ["t0"]}), True, None),
    ("a trainer restarted since it published: the others send it", ALL, state(sources={1: ["t0", "t1@old"]}), True,
     (REFIT, 1, ("t0",), (), ("i0", "i1"))),
    ("a trainer restarted since it published, the others cannot cover it: wait", ALL,
     state(sources={1: ["t0", "t1@old"]}), False, None),
    ("every trainer restarted since it published: wait", ALL, state(sources={1: ["t0@old", "t1@old"]}), True, None),
    ("one trainer restarted, the other has not published yet: wait", ("t0", "t1", "t2", "i0"),
     state(sources={1: ["t0", "t1@old"]}), True, None),
    ("no inference ranks", ("t0", "t1"), state(sources={1: BOTH}), True, None),
    ("refit to every inference rank", ALL, state(sources={1: BOTH}), True,
     (REFIT, 1, ("t0", "t1"), (), ("i0", "i1"))),
    ("inference ranks that hold it serve as holders", ALL, state(sources={1: BOTH}, acks={1: ["i0"]}), True,
     (REFIT, 1, ("t0", "t1"), ("i0",), ("i1",))),
    ("commit once every live inference rank holds it", ALL, state(sources={1: BOTH}, acks={1: ["i0", "i1"]}),
     True, ("commit", 1)),
    ("a dead rank's ack does not block the commit", ("t0", "t1", "i0"),
     state(sources={1: BOTH}, acks={1: ["i0", "i1"]}), True, ("commit", 1)),
    ("held everywhere: the commit does not wait for a restarted trainer", ("t0", "t1@new", "i0", "i1"),
     state(sources={1: BOTH}, acks={1: ["i0", "i1"]}), True, ("commit", 1)),
    ("held everywhere, but no live trainer published it in this incarnation: wait", ("t0@new", "t1@new", "i0", "i1"),
     state(sources={1: BOTH}, acks={1: ["i0", "i1"]}), True, None),
    ("not held everywhere: the attempt goes without the restarted trainer", ("t0", "t1@new", "i0", "i1"),
     state(sources={1: BOTH}, acks={1: ["i0"]}), True, (REFIT, 1, ("t0",), ("i0",), ("i1",))),
    ("a restarted rank (new incarnation) is not a holder", ("t0", "t1", "i0", "i1@new"),
     state(sources={1: BOTH}, acks={1: ["i0", "i1"]}), True, (REFIT, 1, ("t0", "t1"), ("i0",), ("i1",))),
    ("the newest version supersedes older uncommitted ones", ALL, state(sources={1: BOTH, 2: BOTH}), True,
     (REFIT, 2, ("t0", "t1"), (), ("i0", "i1"))),
    ("a version older than the committed one is ignored", ALL,
     state(sources={1: BOTH, 2: BOTH}, acks={2: ["i0", "i1"]}, committed=(2,)), True, None),
    ("committed and held everywhere: nothing to do", ALL,
     state(sources={1: BOTH}, acks={1: ["i0", "i1"]}, committed=(1,)), True, None),
    ("catch up a restarted rank from the holders", ("t0", "t1", "i0", "i1@new"),
     state(sources={1: BOTH}, acks={1: ["i0", "i1"]}, committed=(1,)), True, (CATCH_UP, 1, (), ("i0",), ("i1",))),
    ("catch up a joined rank, trainers not involved", ("t0", "t1", "i0", "i1", "i2"),
     state(acks={1: ["i0", "i1"]}, committed=(1,)), True, (CATCH_UP, 1, (), ("i0", "i1"), ("i2",))),
    ("no holder left: no catch-up", ("t0", "t1", "i0@new", "i1@new"),
     state(acks={1: ["i0", "i1"]}, committed=(1,)), True, None),
    ("a pending version goes before catch-up", ("t0", "t1", "i0", "i1@new"),
     state(sources={2: BOTH}, acks={1: ["i0", "i1"]}, committed=(1,)), True,
     (REFIT, 2, ("t0", "t1"), (), ("i0", "i1"))),
    ("an infeasible refit is not proposed", ALL, state(sources={1: BOTH}), False, None),
    ("an infeasible catch-up is not proposed", ("t0", "t1", "i0", "i1@new"),
     state(acks={1: ["i0", "i1"]}, committed=(1,)), False, None),
    ("a failed version is never proposed", ALL, state(sources={1: BOTH}, failed=(1,)), True, None),
    ("a failed version is never committed", ALL,
     state(sources={1: BOTH}, acks={1: ["i0", "i1"]}, failed=(1,)), True, None),
    ("a failed version falls back to catching up the committed one", ("t0", "t1", "i0", "i1@new"),
     state(sources={2: BOTH}, acks={1: ["i0", "i1"]}, committed=(1,), failed=(2,)), True,
     (CATCH_UP, 1, (), ("i0",), ("i1",))),
    ("a newer version after a failed one moves", ALL,
     state(sources={2: BOTH, 3: BOTH}, acks={1: ["i0", "i1"]}, committed=(1,), failed=(2,)), True,
     (REFIT, 3, ("t0", "t1"), (), ("i0", "i1"))),
    ("a failed version still supersedes older ones", ALL,
     state(sources={1: BOTH, 2: BOTH}, failed=(2,)), True, None),
    # A trainer one step ahead publishes version 2 while version 1 moves: version 1, held
    # everywhere once its attempt is over, commits before version 2 is proposed (before: its
    # transfer was thrown away and the trainer's handle of 1 waited for 2's commit).
    ("an overtaken version held everywhere commits first", ALL,
     state(sources={1: BOTH, 2: BOTH}, acks={1: ["i0", "i1"]}), True, ("commit", 1)),
    ("... then the newer one moves", ALL,
     state(sources={1: BOTH, 2: BOTH}, acks={1: ["i0", "i1"]}, committed=(1,)), True,
     (REFIT, 2, ("t0", "t1"), (), ("i0", "i1"))),
    ("the newest of several overtaken versions held everywhere commits", ALL,
     state(sources={1: BOTH, 2: BOTH, 3: BOTH}, acks={1: ["i0", "i1"], 2: ["i0", "i1"]}), True, ("commit", 2)),
    ("an overtaken version held by some ranks only: the newest moves", ALL,
     state(sources={1: BOTH, 2: BOTH}, acks={1: ["i0"]}), True, (REFIT, 2, ("t0", "t1"), (), ("i0", "i1"))),
    ("an overtaken version held everywhere, no live trainer published it in this incarnation: not committed",
     ("t0@new", "t1@new", "i0", "i1"), state(sources={1: BOTH, 2: ["t0@new", "t1@new"]}, acks={1: ["i0", "i1"]}),
     True, (REFIT, 2, ("t0", "t1"), (), ("i0", "i1"))),
    ("an overtaken version that failed is never committed", ALL,
     state(sources={1: BOTH, 2: BOTH}, acks={1: ["i0", "i1"]}, failed=(1,)), True,
     (REFIT, 2, ("t0", "t1"), (), ("i0", "i1"))),
    ("an overtaken version is not committed under a failed newest one", ALL,
     state(sources={1: BOTH, 2: BOTH}, acks={1: ["i0", "i1"]}, failed=(2,)), True, None),
]


@pytest.mark.parametrize(("members", "version_state", "feasible", "expected"),
                         [row[1:] for row in NEXT_ACTION_ROWS], ids=[row[0] for row in NEXT_ACTION_ROWS])
def test_next_action(members, version_state, feasible, expected):
    v = view(*members)
    action = next_action(v, version_state, feasible=lambda spec: feasible)
    assert summary(action) == expected
    if isinstance(action, CommitAction):
        assert action.digest == version_digest(version_state, action.version, v.members_of("inference"))


def test_next_action_is_pure_and_asks_feasibility_of_what_it_proposes():
    v, s = view(*ALL), state(sources={1: BOTH})
    asked: list[AttemptSpec] = []
    first = next_action(v, s, feasible=lambda spec: asked.append(spec) or True)
    assert next_action(v, s) == first and asked == [first]


def test_the_commit_digest_depends_on_every_holder_digest():
    v = view(*ALL)
    a = state(sources={1: BOTH}, acks={1: ["i0", "i1"]})
    b = state(sources={1: BOTH}, acks={1: ["i0", "i1"]})
    b.acks[1]["i1"] = Ack("a", 1, "other")
    inference = v.members_of("inference")
    assert version_digest(a, 1, inference) != version_digest(b, 1, inference)


# ---- plan_attempt -----------------------------------------------------------------------

# Trainers 0 and 1 are data-parallel replicas; inference ranks [2, 3] and [4, 5] are two
# replicas of a 2-way tensor-parallel engine (2 and 4 hold the same shard, so do 3 and 5).
SPEC = parse_spec(json.loads(json.dumps({
    "domains": [0, 0, 1, 1, 2, 2],
    "tensors": [
        {"name": "w", "shape": [8, 4], "dtype": "float32",
         "source": {"mesh": [0, 1], "placements": ["R"]},
         "destination": {"mesh": [[2, 3], [4, 5]], "placements": ["R", "S(0)"]}},
        {"name": "norm", "shape": [4], "dtype": "float32",
         "source": {"mesh": [0, 1], "placements": ["R"]},
         "destination": {"mesh": [[2, 3], [4, 5]], "placements": ["R", "R"]}},
    ],
})))

PLAN_ROWS = [
    # (id, members, sources, holders, destinations, error)
    ("refit from the sources", ("t0", "t1", "i0", "i1"), ("t0", "t1"), (), ("i0", "i1"), None),
    ("one source is enough (replicas)", ("t0", "i0", "i1"), ("t0",), (), ("i0", "i1"), None),
    ("sources and holders together", ("t0", "t1", "i0", "i1", "i2", "i3"), ("t0", "t1"), ("i0",),
     ("i1", "i2", "i3"), None),
    ("catch-up from holders of both shards", ("t0", "i0", "i1", "i2", "i3"), (), ("i0", "i1"), ("i2", "i3"),
     None),
    ("catch-up from a holder of the same shard", ("i0", "i2"), (), ("i0",), ("i2",), None),
    ("catch-up without a holder of the shard is infeasible", ("i0", "i3"), (), ("i0",), ("i3",),
     "not covered by any source piece"),
    ("a member without a layout rank", ("t0", "i0", "i9"), ("t0",), (), ("i0", "i9"), "has no layout rank"),
]


@pytest.mark.parametrize(("members", "sources", "holders", "destinations", "error"),
                         [row[1:] for row in PLAN_ROWS], ids=[row[0] for row in PLAN_ROWS])
def test_plan_attempt(members, sources, holders, destinations, error):
    v = view(*members)
    kind = REFIT if sources else CATCH_UP
    spec = AttemptSpec(1, kind, sources, holders, destinations)
    if error is not None:
        with pytest.raises(ValueError, match=error):
            plan_attempt(by_role(SPEC.source, SPEC.destination), v, spec)
        return
    plan = plan_attempt(by_role(SPEC.source, SPEC.destination), v, spec)
    senders = {v.rank_of(m) for m in sources + holders}
    assert set(plan.source.ranks) <= senders
    assert set(plan.destination.ranks) == {v.rank_of(m) for m in destinations}
    assert plan.stats.cross_domain_bytes == plan.stats.lower_bound_bytes
    # the same inputs plan the same fingerprint (every rank computes it on its own)
    assert plan_attempt(by_role(SPEC.source, SPEC.destination), v, spec).fingerprint == plan.fingerprint


def _side(placements_by_rank: dict[int, str]):
    """An inference side of its own (ranks 0..): ``w`` row-sharded in two (``"S0"`` rows 0-3,
    ``"S1"`` rows 4-7) or whole (``"R"``) on each rank; ``norm`` everywhere."""
    from elastic_refit.layout import LayoutBuilder

    b = LayoutBuilder()
    w, norm = b.tensor("w", (8, 4), "float32"), b.tensor("norm", (4,), "float32")
    for rank, placement in placements_by_rank.items():
        rows = (0, 8) if placement == "R" else (4 * int(placement[1]), 4)
        b.pieces(w, b.buffers("w", [rank], (rows[1], 4), "float32"), [[rows[0], 0]], [[rows[1], 4]], [[0, 0]])
        b.pieces(norm, b.buffers("norm", [rank], (4,), "float32"), [[0]], [[4]], [[0]])
    return b.build()


def test_each_participant_is_planned_with_the_layout_the_attempt_names_for_it():
    """Self-described sides: i0 keeps its shard, i1 rejoined holding all of w; each
    contributes its own rows of its own layout (a layout of its side, ranks from 0)."""
    old, wide = _side({0: "S0", 1: "S1"}), _side({0: "S0", 1: "R"})
    layouts = {SPEC.source.fingerprint: SPEC.source, old.fingerprint: old, wide.fingerprint: wide}
    records = [member("t0"), member("t1"),
               MemberRecord("inference", "i0", "a", "h", "d-i0", "cpu", layout_rank=0, layout=old.fingerprint),
               MemberRecord("inference", "i1", "a", "h", "d-i1", "cpu", layout_rank=1, layout=wide.fingerprint)]
    v = MembershipView(epoch=1, members=tuple(records))
    spec = AttemptSpec(1, REFIT, ("t0", "t1"), (), ("i0", "i1"),
                       (("t0", SPEC.source.fingerprint), ("t1", SPEC.source.fingerprint),
                        ("i0", old.fingerprint), ("i1", wide.fingerprint)))
    plan = plan_attempt(lambda record, fingerprint: layouts[fingerprint], v, spec)
    received = {r: sorted((p.tensor, p.box.offsets, p.box.lengths) for p in plan.destination.pieces() if p.rank == r)
                for r in (2, 3)}
    assert received[2] == [("norm", (0,), (4,)), ("w", (0, 0), (4, 4))]
    assert received[3] == [("norm", (0,), (4,)), ("w", (0, 0), (8, 4))]
    assert plan.stats.cross_domain_bytes == plan.stats.lower_bound_bytes == (4 * 4 + 4 + 8 * 4 + 4) * 4
    # Two members claiming one rank of one layout is an error, never one of them dropped.
    twin = MemberRecord("inference", "i1", "a", "h", "d-i1", "cpu", layout_rank=0, layout=old.fingerprint)
    v2 = MembershipView(epoch=1, members=tuple(records[:3]) + (twin,))
    spec2 = AttemptSpec(1, REFIT, ("t0",), (), ("i0", "i1"), (("t0", SPEC.source.fingerprint),
                                                            ("i0", old.fingerprint), ("i1", old.fingerprint)))
    with pytest.raises(ValueError, match=rf"^members 'i0' and 'i1' both hold rank 0 of layout {old.fingerprint}$"):
        plan_attempt(lambda record, fingerprint: layouts[fingerprint], v2, spec2)


def test_a_rank_that_changed_its_layout_holds_nothing_and_sources_must_agree_on_theirs():
    from elastic_refit.runtime.attempt import holds, source_layout_disagreement

    record = MemberRecord("inference", "i0", "a", "h", "d", "cpu", layout_rank=0, layout="new")
    acked = VersionState(revision=1, acks={3: {"i0": Ack("a", 1, "d0", layout="old")}})
    assert not holds(acked, 3, record)
    assert holds(acked, 3, MemberRecord("inference", "i0", "a", "h", "d", "cpu", layout_rank=0, layout="old"))
    # next_action plans a source with the layout it published the version in, not its record's
    v = MembershipView(epoch=1, members=(
        MemberRecord("trainer", "t0", "a", "h", "d", "cpu", layout_rank=0, layout="now"),
        MemberRecord("inference", "i0", "a", "h", "d", "cpu", layout_rank=0, layout="L")))
    published = VersionState(revision=1, sources={4: {"t0": "a"}}, source_layouts={4: {"t0": "then"}})
    action = next_action(v, published)
    assert isinstance(action, AttemptSpec) and dict(action.layouts) == {"t0": "then", "i0": "L"}
    split = AttemptSpec(4, REFIT, ("t0", "t1"), (), ("i0",), (("t0", "A"), ("t1", "B"), ("i0", "L")))
    assert source_layout_disagreement(split) == (
        "the trainers published version 4 in different layouts (t0 in A, t1 in B): every trainer must "
        "describe the same training side")
    assert source_layout_disagreement(replace(split, layouts=(("t0", "A"), ("t1", "A"), ("i0", "L")))) is None
    with pytest.raises(ValueError, match=r"^attempt names no layout for participants \['t1'\]$"):
        AttemptSpec(4, REFIT, ("t0", "t1"), (), ("i0",), (("t0", "A"), ("i0", "L")))


def test_attempt_spec_rejects_a_member_on_both_sides():
    with pytest.raises(ValueError, match=r"source or holder and a destination: \['i0'\]"):
        AttemptSpec(1, REFIT, ("t0",), ("i0",), ("i0", "i1"))
    with pytest.raises(ValueError, match="attempt kind must be"):
        AttemptSpec(1, "push", ("t0",), (), ("i0",))


def test_attempt_spec_round_trips_through_json():
    spec = AttemptSpec(3, CATCH_UP, (), ("i0",), ("i1", "i2"), (("i2", "c"), ("i0", "a"), ("i1", "b")))
    assert AttemptSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert spec.layouts == (("i0", "a"), ("i1", "b"), ("i2", "c")) and spec.layout("i1") == "b"
    assert spec.participants == ("i0", "i1", "i2")


# ---- giving up on a version -------------------------------------------------------------

CAUSE_ROWS = [
    # (id, done values, expected cause)
    ("every participant ok", {"t0": "ok", "i0": "ok"}, None),
    ("only consequences", {"t0": "aborted: _AttemptAborted: epoch 3 was superseded", "i0": "ok"}, None),
    ("one own fault", {"t0": "failed: ValueError: bad", "i0": "aborted: _AttemptAborted: t0 failed"},
     "ValueError: bad"),
    ("a root fault wins over the transport faults it caused",
     {"i0": "failed: TransportAborted: rank 2: recv from 0 failed", "t0": "failed: ValueError: bad",
      "i1": "failed: TransportAborted: rank 3: recv from 0 failed"}, "ValueError: bad"),
    ("transport faults only: the first in member order",
     {"i1": "failed: TransportAborted: rank 3", "i0": "failed: TransportAborted: rank 2"},
     "TransportAborted: rank 2"),
    ("several own faults: the first in member order",
     {"t1": "failed: KeyError: 'x'", "t0": "failed: PlanMismatch: t0 planned a, i0 planned b"},
     "PlanMismatch: t0 planned a, i0 planned b"),
    ("participants that wrote nothing are left out", {"t0": "failed: ValueError: bad"}, "ValueError: bad"),
    ("nothing written", {}, None),
]


@pytest.mark.parametrize(("done", "expected"), [row[1:] for row in CAUSE_ROWS], ids=[row[0] for row in CAUSE_ROWS])
def test_attempt_cause(done, expected):
    assert attempt_cause({m: Done.decode(v) for m, v in done.items()}) == expected


@pytest.mark.parametrize("value", ["ok", "failed: ValueError: bad", "aborted: _AttemptAborted: t0 failed"])
def test_done_values_round_trip(value):
    assert Done.decode(value).encode() == value


@pytest.mark.parametrize("value", ["", "sha256:0123", "failed", "ok "])
def test_a_fingerprint_is_not_a_done_value(value):
    assert Done.decode(value) is None


V1 = view(*ALL)
V1_REBUILT = view(*ALL, epoch=2)  # same members, a new communicator
V_SHRUNK = view("t0", "t1", "i0", epoch=3)
V_RESTARTED = view("t0", "t1", "i0", "i1@new", epoch=4)

# Each row: a sequence of (view, version, cause) failures; the expected tally after the last.
COUNT_ROWS = [
    ("first failure", [(V1, 2, "ValueError: bad")], (2, "ValueError: bad", 1)),
    ("same cause, same members adds up", [(V1, 2, "ValueError: bad")] * 3, (2, "ValueError: bad", 3)),
    ("a rebuilt communicator with the same members keeps counting",
     [(V1, 2, "ValueError: bad"), (V1_REBUILT, 2, "ValueError: bad")], (2, "ValueError: bad", 2)),
    ("a different cause starts over", [(V1, 2, "ValueError: bad"), (V1, 2, "ValueError: bad"),
                                       (V1, 2, "KeyError: 'w'")], (2, "KeyError: 'w'", 1)),
    ("a member that left starts over",
     [(V1, 2, "TransportAborted: rank 2"), (V_SHRUNK, 2, "TransportAborted: rank 2")],
     (2, "TransportAborted: rank 2", 1)),
    ("a restarted member starts over",
     [(V1, 2, "ValueError: bad"), (V_RESTARTED, 2, "ValueError: bad")], (2, "ValueError: bad", 1)),
    ("another version starts over", [(V1, 2, "ValueError: bad"), (V1, 3, "ValueError: bad")],
     (3, "ValueError: bad", 1)),
]


@pytest.mark.parametrize(("failures", "expected"), [row[1:] for row in COUNT_ROWS], ids=[row[0] for row in COUNT_ROWS])
def test_count_failure(failures, expected):
    tally: FailureTally | None = None
    for v, version, cause in failures:
        tally = count_failure(tally, v, version, cause)
    assert tally is not None
    assert (tally.version, tally.cause, tally.num_attempts) == expected
    assert tally.identities == failures[-1][0].identities


@pytest.mark.parametrize(("exc", "expected"), [
    (ValueError("rank 0: source buffer 'w' is missing\nmore detail"), "ValueError: rank 0: source buffer 'w' is missing"),
    (RefitError(""), "RefitError"),
    (KeyError("w"), "KeyError: 'w'"),
    (RuntimeError("x" * 1000), "RuntimeError: " + "x" * 286),
])
def test_fault_cause_is_type_and_first_line(exc, expected):
    assert fault_cause(exc) == expected


def test_refit_failed_and_refit_timeout_say_why():
    failed = RefitFailed(2, "ValueError: trainer 't0', version 2: published buffer 'w' is missing", 5, epoch=3)
    assert str(failed) == ("version 2 failed 5 consecutive attempts: ValueError: trainer 't0', version 2: "
                           "published buffer 'w' is missing")
    assert (failed.version, failed.num_attempts, failed.epoch) == (2, 5, 3)
    timeout = RefitTimeout("version 2 to commit", 120.0, member_id="t0", last_failure="PlanMismatch: x (3.0 s ago)")
    assert str(timeout) == "t0: timed out after 120.0 s waiting for version 2 to commit; last failure: PlanMismatch: x (3.0 s ago)"
    assert "no attempt failed on this rank" in str(RefitTimeout("any committed version", 1.0))
    assert isinstance(timeout, TimeoutError) and isinstance(timeout, RefitError)


# ---- RefitConfig ------------------------------------------------------------------------

def config(**overrides) -> RefitConfig:
    values = {"job": "job", "role": "trainer", "member_id": "t0", "layout_rank": 0, "etcd": ("127.0.0.1:2379",)}
    return RefitConfig(**{**values, **overrides})


def test_config_defaults_are_valid():
    c = config(etcd="127.0.0.1:2379")
    assert c.etcd == ("127.0.0.1:2379",) and c.backend == "gloo" and c.max_attempts == 5
    assert config(backend="nccl4py", device="cuda:0").backend == "nccl4py"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"backend": "mpi"}, r"backend must be one of gloo, nccl, nccl4py, got 'mpi'"),
    ({"backend": "nccl4py"}, r"backend 'nccl4py' moves cuda tensors, but device is 'cpu'"),
    ({"backend": "gloo", "device": "cuda:0"}, r"backend 'gloo' moves cpu tensors, but device is 'cuda:0'"),
    ({"role": "critic"}, r"role must be one of .* got 'critic'"),
    ({"mode": "lazy"}, r"mode must be one of .* got 'lazy'"),
    ({"member_id": "a/b"}, r"member_id must match .* got 'a/b'"),
    ({"job": ""}, r"job must match .* got ''"),
    ({"layout_rank": -1}, r"layout_rank must be an int >= 0, got -1"),
    ({"layout_rank": True}, r"layout_rank must be an int >= 0, got True"),
    ({"etcd": ()}, r"etcd needs at least one endpoint"),
    ({"domain": ""}, r"domain must be a non-empty string, got ''"),
    ({"ttl_s": 1}, r"ttl_s must be an int >= 2 .* got 1"),
    ({"ttl_s": 2.5}, r"ttl_s must be an int >= 2 .* got 2.5"),
    ({"collective_timeout_s": 5.0}, r"collective < lease TTL < epoch deadline, got 5.0, 4, 10.0"),
    ({"epoch_deadline_s": math.inf}, r"epoch_deadline_s must be a finite number of seconds > 0, got inf"),
    ({"version_timeout_s": 0}, r"version_timeout_s must be a finite number of seconds > 0, got 0"),
    ({"version_timeout_s": math.nan}, r"version_timeout_s must be a finite number of seconds > 0, got nan"),
    ({"poll_s": -0.1}, r"poll_s must be a finite number of seconds > 0, got -0.1"),
    ({"bucket_bytes": 0}, r"bucket_bytes must be an int >= 1, got 0"),
    ({"staging_bytes": 100, "bucket_bytes": 64}, r"staging_bytes 100 must hold 4 buckets of 64"),
    ({"max_attempts": 0}, r"max_attempts must be an int >= 1, got 0"),
    ({"max_attempts": 2.0}, r"max_attempts must be an int >= 1, got 2.0"),
    ({"verify": "yes"}, r"verify must be a bool, got 'yes'"),
    ({"connect_ahead": True}, r"connect_ahead must be one of auto, on, off, got True"),
])
def test_config_rejects_bad_values_quoting_them(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


def test_config_from_env_reads_max_attempts_and_backend():
    c = RefitConfig.from_env({"ELASTIC_REFIT_JOB": "j", "ELASTIC_REFIT_ROLE": "inference",
                              "ELASTIC_REFIT_MEMBER_ID": "i0", "ELASTIC_REFIT_LAYOUT_RANK": "2",
                              "ELASTIC_REFIT_ETCD": "a:1, b:2", "ELASTIC_REFIT_MAX_ATTEMPTS": "3",
                              "ELASTIC_REFIT_BACKEND": "nccl", "ELASTIC_REFIT_DEVICE": "cuda:1"})
    assert (c.max_attempts, c.backend, c.device, c.etcd) == (3, "nccl", "cuda:1", ("a:1", "b:2"))


BASE_ENV = {"ELASTIC_REFIT_JOB": "j", "ELASTIC_REFIT_ROLE": "inference", "ELASTIC_REFIT_MEMBER_ID": "i0",
            "ELASTIC_REFIT_LAYOUT_RANK": "2", "ELASTIC_REFIT_ETCD": "a:1"}


@pytest.mark.parametrize("variable, raw, message", [
    ("ELASTIC_REFIT_VERIFY", "maybe",
     "ELASTIC_REFIT_VERIFY='maybe' is not a boolean (one of 1, true, yes, on, 0, false, no, off)"),
    ("ELASTIC_REFIT_BUCKET_BYTES", "0",
     "bucket_bytes must be an int >= 1, got 0 (from ELASTIC_REFIT_BUCKET_BYTES='0')"),
    ("ELASTIC_REFIT_BUCKET_BYTES", "16MiB", "ELASTIC_REFIT_BUCKET_BYTES='16MiB' is not an integer"),
    ("ELASTIC_REFIT_VERSION_TIMEOUT_S", "nan", "ELASTIC_REFIT_VERSION_TIMEOUT_S='nan' is not a finite number"),
    ("ELASTIC_REFIT_VERSION_TIMEOUT_S", "soon", "ELASTIC_REFIT_VERSION_TIMEOUT_S='soon' is not a number"),
    ("ELASTIC_REFIT_LAYOUT_RANK", "-3",
     "layout_rank must be an int >= 0, got -3 (from ELASTIC_REFIT_LAYOUT_RANK='-3')"),
])
def test_config_from_env_is_strict_and_names_the_variable(variable, raw, message):
    with pytest.raises(ValueError) as info:
        RefitConfig.from_env({**BASE_ENV, variable: raw})
    assert str(info.value) == message


def test_config_bind_interface_must_exist_on_this_host():
    assert config(bind_interface="lo").bind_interface == "lo"
    with pytest.raises(ValueError, match=r"bind_interface 'nosuch0' is not an interface of this host \(lo"):
        config(bind_interface="nosuch0")


def test_config_from_env_reads_booleans_from_a_fixed_set():
    assert RefitConfig.from_env({**BASE_ENV, "ELASTIC_REFIT_VERIFY": " Off "}).verify is False
    assert RefitConfig.from_env({**BASE_ENV, "ELASTIC_REFIT_VERIFY": "yes"}).verify is True


# ---- reform_due: shrink first, rebuild only when the peer turns out to be alive ---------

@pytest.mark.parametrize(("broken_for_s", "ttl_s", "due"), [
    (0.0, 2, False),  # just broke: a dead peer's lease has not expired yet
    (2.0, 2, False),  # its lease just expired: the leader's epoch without it is on its way
    (2.0 + REFORM_GRACE_S - 0.01, 2, False),
    (2.0 + REFORM_GRACE_S, 2, True),  # no epoch came: the peer is alive, rebuild with it
    (30.0, 10, True),
    (10.5, 10, False),
])
def test_reform_is_due_only_after_a_dead_peer_would_have_been_dropped(broken_for_s, ttl_s, due):
    assert reform_due(broken_for_s, ttl_s) is due


@pytest.mark.parametrize(("broken_for_s", "ttl_s"), [(-0.1, 2), (1.0, 0), (1.0, -2)])
def test_reform_due_rejects_bad_input(broken_for_s, ttl_s):
    with pytest.raises(ValueError, match="broken_for_s must be >= 0 and ttl_s > 0"):
        reform_due(broken_for_s, ttl_s)


@pytest.mark.parametrize(("broken_for_s", "ttl_s", "due_in"), [
    (0.0, 2, 2 + REFORM_GRACE_S), (1.5, 2, 0.5 + REFORM_GRACE_S), (2 + REFORM_GRACE_S, 2, 0.0), (30.0, 2, 0.0),
])
def test_reform_due_in_counts_down_to_zero(broken_for_s, ttl_s, due_in):
    assert reform_due_in(broken_for_s, ttl_s) == pytest.approx(due_in)


# ---- check_publish: versions increase strictly, a version never changes its data ---------

def published(committed: dict[int, str] | None = None, digests: dict[int, str] | None = None) -> VersionState:
    """Versions committed (v -> commit digest) and t0's source digests (v -> digest)."""
    s = VersionState(revision=1)
    for v, d in (committed or {}).items():
        s.committed[v] = Commit(v, 1, d)
    for v, d in (digests or {}).items():
        s.source_digests.setdefault(v, {})["t0"] = d
    return s


@pytest.mark.parametrize("version, data, job, last, expected", [
    # a new version: nothing to return, it moves
    (1, "a", published(), None, None),
    (6, "a", published({5: "c"}, {5: "x"}), (5, "x"), None),
    # a retry of this trainer's pending version with the same data (after a RefitTimeout)
    (6, "a", published({5: "c"}), (6, "a"), None),
    # a repeat of a committed version: idempotent with the same data...
    (5, "x", published({5: "c"}, {5: "x"}), None, Commit(5, 1, "c")),
    # ...and where this trainer's record of it is gone (its lease expired, a restart)
    (5, "x", published({5: "c"}), None, Commit(5, 1, "c")),
    # going backwards
    (3, "a", published({5: "c"}), None,
     "version 3 is older than the job's latest committed version 5: versions must increase"),
    (4, "a", published(), (5, "b"),
     "version 4 is older than version 5, which t0 published before: versions must increase"),
    # the same version with other data
    (5, "y", published({5: "c"}, {5: "x"}), None,
     "version 5 is already committed, and t0 published other data for it then (digest x, now y): "
     "publish a new version, or, if this is another run reusing the job's name, give it a name of its own"),
    # ...also once its source record was pruned: the commit keeps the digest (a second run)
    (5, "y", VersionState(revision=1, committed={5: Commit(5, 1, "c", (("t0", "x"),))}), None,
     "version 5 is already committed, and t0 published other data for it then (digest x, now y): "
     "publish a new version, or, if this is another run reusing the job's name, give it a name of its own"),
    (5, "x", VersionState(revision=1, committed={5: Commit(5, 1, "c", (("t0", "x"),))}), None, Commit(5, 1, "c")),
    (6, "b", published(), (6, "a"),
     "version 6 was published by t0 before with other data (digest a, now b): publish a new version"),
    # not a version
    (-1, "a", published(), None, "version must be an integer >= 0, got -1"),
    (2.0, "a", published(), None, "version must be an integer >= 0, got 2.0"),
    (True, "a", published(), None, "version must be an integer >= 0, got True"),
])
def test_check_publish(version, data, job, last, expected):
    if isinstance(expected, str):
        with pytest.raises(ValueError) as info:
            check_publish(version, data, "t0", job, last)
        assert str(info.value) == expected
    else:
        assert check_publish(version, data, "t0", job, last) == expected


@pytest.mark.parametrize("value, message", [
    (math.nan, "nan"), (math.inf, "inf"), (0, "0"), (-1.0, "-1.0"), ("5", "'5'"), (True, "True"),
])
def test_check_timeout_rejects_what_would_never_or_always_expire(value, message):
    with pytest.raises(ValueError) as info:
        check_timeout("timeout_s", value)
    assert str(info.value) == f"timeout_s must be a finite number of seconds > 0 (or None), got {message}"


def test_check_timeout_passes_none_and_positive_numbers():
    assert check_timeout("t", None) is None and check_timeout("t", 2) == 2.0 and check_timeout("t", 0.5) == 0.5


# ---- torchrun's environment -------------------------------------------------------------
TORCHRUN = {"TORCHELASTIC_RUN_ID": "abc", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "GROUP_RANK": "1",
            "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "2", "ELASTIC_REFIT_JOB": "j",
            "ELASTIC_REFIT_ROLE": "trainer", "ELASTIC_REFIT_ETCD": "127.0.0.1:2379"}


def test_a_rank_started_by_torchrun_needs_only_the_job_the_role_and_etcd():
    config = RefitConfig.from_env(TORCHRUN)
    assert (config.member_id, config.layout_rank, config.domain) == ("trainer-3", 3, "node-1")
    assert config.incarnation.startswith("r2-") and config.device == "cpu"
    again = RefitConfig.from_env(TORCHRUN)
    assert again.member_id == config.member_id and again.incarnation != config.incarnation  # a new process
    nccl = RefitConfig.from_env({**TORCHRUN, "ELASTIC_REFIT_BACKEND": "nccl"})
    assert nccl.device == "cuda:1"
    # ELASTIC_REFIT_* and keyword arguments win over torchrun's
    mine = RefitConfig.from_env({**TORCHRUN, "ELASTIC_REFIT_LAYOUT_RANK": "7"}, member_id="t7")
    assert (mine.member_id, mine.layout_rank) == ("t7", 7)
    # without torchrun, nothing is guessed from RANK
    plain = {k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"}
    with pytest.raises(ValueError, match=r"^missing configuration: ELASTIC_REFIT_MEMBER_ID, ELASTIC_REFIT_LAYOUT_RANK$"):
        RefitConfig.from_env(plain)
    with pytest.raises(ValueError, match=r"^torchrun's RANK='x' is not an integer$"):
        RefitConfig.from_env({**TORCHRUN, "RANK": "x"})


def test_unknown_variables_and_the_password_file(tmp_path):
    base = {"ELASTIC_REFIT_JOB": "j", "ELASTIC_REFIT_ROLE": "trainer", "ELASTIC_REFIT_MEMBER_ID": "t0",
            "ELASTIC_REFIT_LAYOUT_RANK": "0", "ELASTIC_REFIT_ETCD": "127.0.0.1:2379"}
    with pytest.raises(ValueError, match=r"^unknown variable ELASTIC_REFIT_TTL='5' \(did you mean "
                                         r"ELASTIC_REFIT_TTL_S\?\): no RefitConfig field of that name$"):
        RefitConfig.from_env({**base, "ELASTIC_REFIT_TTL": "5"})
    # what a Kubernetes service link named elastic-refit-etcd adds is not ours: ignored
    links = {"ELASTIC_REFIT_ETCD_SERVICE_HOST": "10.0.0.1", "ELASTIC_REFIT_ETCD_SERVICE_PORT": "2379",
             "ELASTIC_REFIT_ETCD_PORT": "tcp://10.0.0.1:2379", "ELASTIC_REFIT_ETCD_PORT_2379_TCP_ADDR": "10.0.0.1"}
    assert RefitConfig.from_env({**base, **links}).ttl_s == 4  # the default
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    config = RefitConfig.from_env({**base, "ELASTIC_REFIT_ETCD_USER": "u", "ELASTIC_REFIT_ETCD_PASSWORD_FILE": str(secret),
                                   "ELASTIC_REFIT_ETCD_ALLOW_PLAINTEXT_PASSWORD": "1"})
    assert (config.etcd_user, config.etcd_password) == ("u", "s3cret")
    with pytest.raises(ValueError, match=r"^ELASTIC_REFIT_ETCD_PASSWORD_FILE='/nope': No such file or directory$"):
        RefitConfig.from_env({**base, "ELASTIC_REFIT_ETCD_PASSWORD_FILE": "/nope"})


# ---- connecting ahead ------------------------------------------------------------------

def test_steady_refit_is_every_trainer_to_every_inference_rank_and_plans_as_the_usual_refit():
    from elastic_refit.runtime.attempt import steady_refit

    v = view("t0", "t1", "i0", "i1")
    spec = steady_refit(v)
    assert (spec.kind, spec.sources, spec.holders, spec.destinations) == (REFIT, ("t0", "t1"), (), ("i0", "i1"))
    # the attempt next_action proposes once both trainers published a new version
    state = VersionState(revision=1, sources={7: {"t0": "a", "t1": "a"}})
    usual = next_action(v, state)
    assert isinstance(usual, AttemptSpec)
    layout_of = by_role(SPEC.source, SPEC.destination)
    assert plan_attempt(layout_of, v, usual).fingerprint == plan_attempt(layout_of, v, spec).fingerprint
    assert steady_refit(view("t0", "t1")) is None and steady_refit(view("i0", "i1")) is None


@pytest.mark.parametrize("members", [("t0", "t1", "i0", "i1"), ("t0", "i0", "i1", "i2", "i3"),
                                     ("t0", "t1", "i0", "i1", "i2", "i3")])
def test_plan_peers_match_between_the_two_ends_of_every_pair_and_cover_every_message(members):
    from elastic_refit.runtime.attempt import steady_refit
    from elastic_refit.transport.connect import plan_peers

    v = view(*members)
    plan = plan_attempt(by_role(SPEC.source, SPEC.destination), v, steady_refit(v))
    ranks = range(v.num_ranks)
    peers = {r: plan_peers(plan, r) for r in ranks}
    sent = {(r, p) for r in ranks for p in peers[r].send_to}
    received = {(p, r) for r in ranks for p in peers[r].recv_from}
    assert sent == received  # every connect send has its receive on the other end
    t = plan.transfers
    messages = {(int(a), int(b)) for a, b in zip(t.src_rank, t.dst_rank, strict=True) if a != b}
    assert sent == messages and messages
    assert all(r not in peers[r].send_to + peers[r].recv_from for r in ranks)
    assert all(peers[r].participants == tuple(sorted(set(plan.source.ranks) | set(plan.destination.ranks)))
               for r in ranks)


@pytest.mark.parametrize(("backend", "device", "connect_ahead", "connects"), [
    ("gloo", "cpu", "auto", False),  # gloo's group connected every pair when it was built
    ("nccl4py", "cuda:0", "auto", True), ("nccl", "cuda:0", "auto", True),
    ("gloo", "cpu", "on", True), ("nccl4py", "cuda:0", "off", False),
])
def test_connect_ahead_auto_means_nccl_backends(backend, device, connect_ahead, connects):
    assert config(backend=backend, device=device, connect_ahead=connect_ahead).connects_ahead is connects


@pytest.mark.parametrize(("name", "me", "members", "versions", "expected"), [
    ("holds the latest: nothing to reach", "i0", ("t0", "i0", "i1"),
     state(acks={3: ["i0", "i1"]}, committed=(3,)), None),
    ("joined after the commit: from its holders", "i1", ("t0", "i0", "i1"),
     state(acks={3: ["i0"]}, committed=(3,)), (3, (), ("i0",), ("i1",))),
    ("restarted since its ack: behind too", "i1", ("t0", "i0", "i1@b"),
     state(acks={3: ["i0", "i1"]}, committed=(3,)), (3, (), ("i0",), ("i1",))),
    ("a newer version on its way reaches it instead", "i1", ("t0", "i0", "i1"),
     state(sources={4: ["t0"]}, acks={3: ["i0"]}, committed=(3,)), None),
    ("a newer failed version does not", "i1", ("t0", "i0", "i1"),
     state(sources={4: ["t0"]}, acks={3: ["i0"]}, committed=(3,), failed=(4,)), (3, (), ("i0",), ("i1",))),
    ("nothing committed yet", "i1", ("t0", "i0", "i1"), state(sources={1: ["t0"]}), None),
    ("a trainer never catches up", "t0", ("t0", "i0", "i1"), state(acks={3: ["i0"]}, committed=(3,)), None),
    # The 3-node chaos matrix, etcd_stall2x>ttl: every lease expired in the stall; i1 came back
    # as a new incarnation and holds v3, committed in epoch 3, before i0 saw that it was lost:
    # from its epoch-1 view no holder was live and v3 was "unreachable" (lost/reached_last).
    ("committed in an epoch it has not seen: its view is behind", "i0", ("t0", "i0", "i1"),
     state(acks={3: ["i1@b"]}, committed=(3,), committed_epoch=3), None),
    ("committed in the epoch it sees: judged", "i0", ("t0", "i0", "i1@b"),
     state(acks={3: ["i1@b"]}, committed=(3,), committed_epoch=1), (3, (), ("i1",), ("i0",))),
])
def test_own_catch_up(name, me, members, versions, expected):
    spec = own_catch_up(view(*members), versions, me)
    got = None if spec is None else (spec.version, spec.sources, spec.holders, spec.destinations)
    assert got == expected, name
