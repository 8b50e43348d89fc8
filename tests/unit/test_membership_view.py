"""Pure tests of member records, views, diff, rank order, path choice and timeouts."""

from __future__ import annotations

import threading
import time

import pytest
import structlog
from elastic_refit.membership.comm import (
    RuntimeSupport,
    abort_with_watchdog,
    agree_fast_path,
    build_stranded,
    choose_path,
    rebuild_if_formed,
)
from elastic_refit.membership.config import MembershipConfig
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.view import MemberRecord, MembershipView, diff, next_member_order


def rec(member_id: str, role: str = "trainer", inc: str = "a", state: str = "ready") -> MemberRecord:
    return MemberRecord(role=role, member_id=member_id, incarnation=inc, host="h",
                        domain="d0", device="cpu", state=state)


def view(epoch: int, *members: MemberRecord) -> MembershipView:
    return MembershipView(epoch=epoch, members=members)


def support(nccl=None, shrink=False, grow=False, store_clone=True) -> RuntimeSupport:
    return RuntimeSupport(torch_version="x", num_gpus=0, nccl_version=nccl,
                          torch_shrink_group=True, nccl_backend_shrink=shrink,
                          nccl4py_version="1" if grow else None, nccl4py_shrink=grow,
                          nccl4py_grow=grow, nccl4py_nccl_version=nccl if grow else None,
                          store_clone=store_clone)


def test_diff_reports_added_and_removed_members():
    old = view(1, rec("t0"), rec("t1"), rec("i0", "inference"))
    new = view(2, rec("t0"), rec("i0", "inference"), rec("i1", "inference"))
    d = diff(old, new)
    assert [m.member_id for m in d.added] == ["i1"]
    assert [m.member_id for m in d.removed] == ["t1"]
    assert not d.removals_only and not d.additions_only and not d.unchanged


def test_diff_treats_a_restart_as_remove_plus_add():
    d = diff(view(1, rec("t0"), rec("t1", inc="a")), view(2, rec("t0"), rec("t1", inc="b")))
    assert [m.incarnation for m in d.added] == ["b"]
    assert [m.incarnation for m in d.removed] == ["a"]


def test_diff_from_nothing_adds_everyone():
    d = diff(None, view(1, rec("t0"), rec("t1")))
    assert d.additions_only and len(d.added) == 2 and d.removed == ()


def test_view_groups_by_role_and_ranks_in_member_order():
    v = view(3, rec("t1"), rec("i0", "inference"), rec("t0"))
    assert [m.member_id for m in v.by_role()["trainer"]] == ["t1", "t0"]
    assert [m.member_id for m in v.members_of("inference")] == ["i0"]
    assert v.rank_of("t0") == 2 and "i0" in v and "zz" not in v
    with pytest.raises(KeyError, match="'zz' is not in epoch 3"):
        v.rank_of("zz")


def test_view_round_trips_through_json():
    v = MembershipView(epoch=7, members=(rec("t0"), rec("i0", "inference")), based_on_revision=42)
    assert MembershipView.decode(v.encode()) == v


def test_the_epoch_record_is_columns_and_every_field_round_trips():
    members = tuple(MemberRecord(role="trainer" if i < 4 else "inference", member_id=f"m{i:04d}",
                                 incarnation=f"{100 + i % 3}-m{i}", host=f"h{i % 3}", domain=f"d{i % 3}", device="cpu",
                                 probe=f"127.0.0.1:{4000 + i}", layout_rank=i if i < 4 else -1,
                                 layout="fp-a" if i < 4 else "", reform=1 if i == 5 else 0,
                                 reform_epoch=3 if i == 5 else 0, state="ready",
                                 address=f"10.0.0.{i}:29500" if i % 2 else "")
                    for i in range(64))
    v = MembershipView(epoch=9, members=members, based_on_revision=1234)
    raw = v.encode()
    back = MembershipView.decode(raw)
    assert back == v and back.members == members and back.based_on_revision == 1234
    # Every field of every member survives (== compares the records field by field).
    assert [m.to_json() for m in back.members] == [m.to_json() for m in members]
    columns = __import__("json").loads(raw)["columns"]
    assert columns["role"]["of"] == ["trainer", "inference"]  # repeated values stored once
    assert "state" not in columns  # a column of defaults is left out
    # Several times smaller than one JSON object per member (the old encoding), which
    # decode still reads.
    old = __import__("json").dumps(v.to_json(), sort_keys=True).encode()
    assert len(raw) * 3 < len(old), (len(raw), len(old))
    assert MembershipView.decode(old) == v
    assert MembershipView.decode(MembershipView(epoch=1, members=()).encode()).members == ()


def test_a_bad_epoch_column_is_refused():
    raw = b'{"epoch": 2, "columns": {"n": 2, "role": ["trainer"], "member_id": ["a", "b"]}}'
    with pytest.raises(ValueError, match="column 'role' has 1 values for 2 members"):
        MembershipView.decode(raw)


def test_view_rejects_duplicate_members_and_bad_epochs():
    with pytest.raises(ValueError, match="'t0' appears twice in epoch 1"):
        view(1, rec("t0"), rec("t0", inc="b"))
    with pytest.raises(ValueError, match="epoch must be an int >= 0, got -1"):
        view(-1)


def test_member_record_validation_quotes_values():
    with pytest.raises(ValueError, match=r"role must be one of .* got 'learner'"):
        rec("t0", role="learner")
    with pytest.raises(ValueError, match=r"member_id must match .* got 'a/b'"):
        rec("a/b")
    with pytest.raises(ValueError, match=r"state must be one of .* got 'zombie'"):
        rec("t0", state="zombie")


def test_next_member_order_keeps_survivors_and_appends_newcomers():
    prev = view(1, rec("t2"), rec("t0"), rec("i0", "inference"))
    alive = [rec("i1", "inference"), rec("t0"), rec("i0", "inference"), rec("t1")]
    order = [m.member_id for m in next_member_order(prev, alive)]
    assert order == ["t0", "i0", "t1", "i1"]  # survivors in old order; trainers before inference


def test_choose_path_gloo_always_rebuilds():
    old = view(1, rec("t0"), rec("t1"))
    s = support(nccl=(2, 29, 2), shrink=True, grow=True)
    assert choose_path(None, old, "gloo", s) == "build"
    assert choose_path(old, view(2, rec("t0")), "gloo", s) == "rebuild"
    assert choose_path(old, view(2, rec("t0"), rec("t1")), "gloo", s) == "unchanged"


@pytest.mark.parametrize("backend", ["gloo", "nccl", "nccl4py"])
def test_a_reform_request_makes_every_rank_rebuild(backend):
    old = view(1, rec("t0"), rec("t1"), rec("t2"))
    bumped = MemberRecord(**{**rec("t1").to_json(), "reform": 1})
    s = support(nccl=(2, 29, 2), shrink=True, grow=True)
    assert choose_path(old, view(2, rec("t0"), bumped, rec("t2")), backend, s) == "rebuild"
    # even where a removal alone would shrink the old communicator
    assert choose_path(old, view(2, rec("t0"), bumped), backend, s) == "rebuild"
    assert MemberRecord.decode(bumped.encode()) == bumped
    assert MemberRecord.decode(rec("t1").encode()).reform == 0
    with pytest.raises(ValueError, match="reform"):
        MemberRecord(**{**rec("t1").to_json(), "reform": -1})


@pytest.mark.parametrize(
    ("nccl", "shrink", "grow", "backend", "new_ids", "peer_died", "expected"),
    [
        ((2, 28, 9), True, False, "nccl", ("t0", "t2"), True, "shrink_abort"),
        ((2, 28, 9), True, False, "nccl", ("t0", "t2"), False, "shrink"),
        ((2, 26, 0), True, False, "nccl", ("t0", "t2"), True, "rebuild"),  # NCCL too old
        ((2, 28, 9), False, False, "nccl", ("t0", "t2"), True, "rebuild"),  # no shrink API
        ((2, 29, 2), True, True, "nccl4py", ("t0", "t1", "t2", "t3"), True, "grow"),
        ((2, 28, 9), True, True, "nccl4py", ("t0", "t1", "t2", "t3"), True, "rebuild"),  # < 2.29.2
        ((2, 29, 2), True, True, "nccl", ("t0", "t1", "t2", "t3"), True, "rebuild"),  # torch: no grow
        ((2, 29, 2), True, True, "nccl4py", ("t0", "t3"), True, "rebuild"),  # mixed change
        ((2, 29, 2), True, True, "nccl4py", ("t3", "t0", "t1", "t2"), True, "rebuild"),  # reordered
    ],
)
def test_choose_path_nccl_table(nccl, shrink, grow, backend, new_ids, peer_died, expected):
    old = view(1, rec("t0"), rec("t1"), rec("t2"))
    new = view(2, *(rec(i) for i in new_ids))
    assert choose_path(old, new, backend, support(nccl, shrink, grow),
                       peer_died=peer_died) == expected


def test_timeouts_must_be_ordered():
    MembershipConfig(ttl_s=2, collective_timeout_s=1.5, epoch_deadline_s=10)
    with pytest.raises(ValueError, match=r"collective < lease TTL < epoch deadline.*"
                       "collective_timeout_s=3.0, ttl_s=2"):
        MembershipConfig(ttl_s=2, collective_timeout_s=3.0)
    with pytest.raises(ValueError, match=r"ttl_s must be an int >= 2 .* got 1"):
        MembershipConfig(ttl_s=1)


def test_key_layout_matches_the_design():
    k = JobKeys("job1")
    assert k.member("trainer", "t0") == "/elastic-refit/job1/members/trainer/t0"
    assert k.leader == "/elastic-refit/job1/leader"
    assert k.epoch == "/elastic-refit/job1/epoch"
    assert k.store(3) == "/elastic-refit/job1/store/3/"
    assert k.ack(5, "i0") == "/elastic-refit/job1/versions/5/acks/i0"
    assert k.committed(5) == "/elastic-refit/job1/versions/5/committed"
    assert k.failed(5) == "/elastic-refit/job1/versions/5/failed"
    assert k.parse_version_key(k.failed(5)) == (5, "failed", None)
    assert k.parse_version_key(k.committed(5)) == (5, "committed", None)
    assert k.parse_version_key(k.ack(5, "i0")) == (5, "acks", "i0")
    assert k.parse_version_key(k.version(5) + "other") is None
    start, end = k.control_range
    inside = [k.epoch, k.leader, k.member("inference", "i9")]
    outside = [k.store(1) + "x", k.ack(1, "t0"), "/elastic-refit/job1/members"]
    assert all(start <= key < end for key in inside)
    assert not any(start <= key < end for key in outside[:2])
    assert k.parse_member_key(k.member("inference", "i9")) == ("inference", "i9")
    assert k.parse_member_key(k.store(1)) is None
    with pytest.raises(ValueError, match="job must match"):
        JobKeys("bad/job")


def test_every_membership_fault_is_a_refit_error():
    from elastic_refit.membership import errors as membership_errors

    from elastic_refit import errors

    assert membership_errors.MembershipLost is errors.MembershipLost
    faults = [membership_errors.EtcdUnavailable(["a:1"], "get", None), membership_errors.MembershipLost("x"),
              membership_errors.FencedWrite("x"), membership_errors.LeadershipLost("x"),
              membership_errors.EpochTimeout("x"), membership_errors.CommunicatorError("x"),
              membership_errors.StoreTimeout("x"), errors.TransportAborted("x"), errors.PlanMismatch("x"),
              errors.VerificationFailed("x"), errors.RefitFailed(2, "ValueError: x", 5),
              errors.RefitTimeout("version 2 to commit", 1.0)]
    for fault in faults:
        with pytest.raises(errors.RefitError):
            raise fault
    assert isinstance(membership_errors.StoreTimeout("x"), TimeoutError)
    assert isinstance(errors.RefitTimeout("version 2 to commit", 1.0), TimeoutError)
    assert not issubclass(errors.RefitError, ValueError)


def test_torch_nccl_rebuilds_when_its_store_cannot_be_cloned():
    """ProcessGroupNCCL.shrink clones the store; the etcd store (Python) cannot be cloned."""
    old = view(1, rec("t0"), rec("t1"), rec("t2"))
    new = view(2, rec("t0"), rec("t2"))
    assert choose_path(old, new, "nccl", support((2, 28, 9), True, False, store_clone=False)) == "rebuild"
    assert choose_path(old, new, "nccl", support((2, 28, 9), True, False, store_clone=True)) == "shrink_abort"
    assert choose_path(old, new, "nccl4py", support((2, 28, 9), True, True, store_clone=False)) == "shrink_abort"


@pytest.mark.parametrize(("path", "ready", "expected"), [
    ("shrink_abort", {"t0": True, "t2": True}, "shrink_abort"),
    ("shrink_abort", {"t0": True, "t2": False}, "rebuild"),  # t2's communicator is in an error state
    ("shrink", {"t0": False}, "rebuild"),
    ("grow", {"t0": True, "t1": True}, "grow"),
    ("grow", {"t0": True, "t1": False}, "rebuild"),
    ("rebuild", {"t0": False}, "rebuild"),
    ("unchanged", {"t0": True}, "unchanged"),
    ("build", {}, "build"),
])
def test_a_fast_path_needs_every_survivor_ready(path, ready, expected):
    assert agree_fast_path(path, ready) == expected


@pytest.mark.parametrize(("path", "came_from", "expected"), [
    ("build", None, "build"),  # a rank's first communicator (a new incarnation)
    ("build", 3, "rebuild"),  # a survivor whose communicator of epoch 3 was dropped or failed to form
    ("rebuild", 3, "rebuild"),
    ("shrink_abort", 3, "shrink_abort"),
    ("unchanged", 3, "unchanged"),
])
def test_only_a_ranks_first_communicator_is_a_build(path, came_from, expected):
    assert rebuild_if_formed(path, came_from) == expected


_BUILD = view(3, rec("t0"), rec("t1"), rec("i0", "inference"))


@pytest.mark.parametrize(("latest", "stranded"), [
    (None, False),
    (_BUILD, False),  # its own epoch
    (view(4, rec("t0"), rec("t1"), rec("i0", "inference"), rec("i1", "inference")), False),  # a newcomer
    (view(4, rec("t0"), rec("t1"), rec("i0", "inference", inc="b")), True),  # i0 restarted: the old one is gone
    (view(4, rec("t0"), rec("i0", "inference")), True),  # t1 left or died
    (view(5, rec("t1"), rec("t0"), rec("i0", "inference")), False),  # same participants, other order
    (view(2, rec("t0")), False),  # an older view is no news
])
def test_an_nccl_build_past_its_barrier_is_given_up_only_for_a_lost_participant(latest, stranded):
    assert build_stranded(_BUILD, latest) is stranded


class _SlowAbort:
    """A communicator double whose abort takes a while (NCCL's takes about 0.5 s)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.aborted = threading.Event()

    def abort(self) -> None:
        time.sleep(self.seconds)
        self.aborted.set()


def test_abort_with_watchdog_waits_bounded_or_reaps_in_the_background():
    log = structlog.get_logger()
    waited = _SlowAbort(0.2)
    assert abort_with_watchdog(waited, 5.0, log) >= 0.2 and waited.aborted.is_set()
    stuck = _SlowAbort(2.0)
    assert abort_with_watchdog(stuck, 0.1, log) < 1.0  # gives up waiting, never hangs the caller
    reaping: list[threading.Thread] = []
    background = _SlowAbort(0.2)
    t0 = time.monotonic()
    assert abort_with_watchdog(background, 5.0, log, reaping=reaping) == 0.0
    assert time.monotonic() - t0 < 0.15 and not background.aborted.is_set() and len(reaping) == 1
    reaping[0].join(5.0)
    assert background.aborted.is_set()
