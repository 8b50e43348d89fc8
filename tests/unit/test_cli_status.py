"""status explains itself: what each member serves and its lag, why a version is pending
(pure functions over the data status reads; the live job is in tests/integration/test_status.py)."""

from __future__ import annotations

import pytest
from elastic_refit.membership.versions import Ack, Commit, VersionState

from elastic_refit.cli.status_cmd import add_serving, pending_reason, render_status


def _member(member_id: str, incarnation: str = "a", in_epoch: bool = True) -> dict:
    return {"member_id": member_id, "incarnation": incarnation, "host": "h", "domain": "d", "device": "cpu",
            "layout_rank": 0, "layout": "f" * 32, "state": "ready", "in_epoch": in_epoch, "rank": 0 if in_epoch else None}


def test_each_member_serves_its_newest_acked_committed_version_and_a_joiner_serves_nothing():
    state = VersionState(revision=9, sources={3: {"t0": "a"}, 4: {"t0": "a"}},
                         acks={3: {"i0": Ack("a", 1, "x"), "i1": Ack("old", 1, "x")}, 4: {"i0": Ack("a", 2, "y")}},
                         committed={3: Commit(3, 1, "x"), 4: Commit(4, 2, "y")})
    members = {"trainer": [_member("t0")], "inference": [_member("i0"), _member("i1", "new"), _member("i2")]}
    add_serving(members, state)
    assert [(m["member_id"], m["serving"], m["lag"]) for m in members["inference"]] == [
        ("i0", 4, 0), ("i1", None, None), ("i2", None, None)]  # i1's ack was by an earlier incarnation
    assert members["trainer"][0]["serving"] == 4
    data = {"job": "j", "epoch": 2, "leader": None, "latest_committed": 4, "committed": [], "latest_acks": [],
            "pending": [], "failed": [{"version": 5, "cause": "ValueError: bad shape", "num_attempts": 1, "epoch": 2}],
            "members": members}
    table = render_status(data)
    assert "nothing" in table and "rank in epoch" in table and "v5 failed after 1 attempt(s)" in table
    assert "epoch: the membership generation" in table


@pytest.mark.parametrize(("version", "members", "sources", "acks", "expected"), [
    (5, {"trainer": [_member("t0")], "inference": [_member("i0")]}, {"t0": "a"}, {}, "superseded by v6"),
    (6, {"trainer": [_member("t0"), _member("t1")], "inference": [_member("i0")]}, {"t0": "a"}, {},
     "waiting for trainer(s) t1 to publish it"),
    (6, {"trainer": [_member("t0")], "inference": []}, {"t0": "a"}, {}, "no inference member"),
    (6, {"trainer": [_member("t0")], "inference": [_member("i0"), _member("i1", in_epoch=False)]}, {"t0": "a"}, {},
     "member(s) i1 not in epoch 7 yet"),
    (6, {"trainer": [_member("t0")], "inference": [_member("i0"), _member("i1")]}, {"t0": "a"}, {"i0": object()},
     "acked by 1 of 2 inference members; moving to i1"),
    (6, {"trainer": [_member("t0")], "inference": [_member("i0")]}, {"t0": "a"}, {"i0": object()},
     "every inference member acked it"),
])
def test_why_a_version_is_pending(version, members, sources, acks, expected):
    assert expected in pending_reason(version, [5, 6], members, sources, acks, 7)


def test_members_whose_lease_is_gone_are_out_of_the_job_and_a_rejoined_one_says_from_what():
    """Who the job counts on (the epoch, the newest commit's acks, a pending version's
    sources) with no registration now is listed once, with the version it held; a member
    registered again under a new incarnation is not (its row says it rejoined)."""
    from elastic_refit.membership import MemberRecord, MembershipView

    from elastic_refit.cli.status_cmd import out_of_job

    def rec(role, member_id, incarnation):
        return MemberRecord(role, member_id, incarnation, "h", "d", "cpu")

    view = MembershipView(4, (rec("trainer", "t0", "a"), rec("inference", "i0", "a"), rec("inference", "i1", "a"),
                              rec("inference", "i2", "a")))
    state = VersionState(revision=9, sources={3: {"t0": "a"}, 4: {"t0": "a", "t1": "b"}},
                         acks={3: {"i0": Ack("a", 4, "x"), "i1": Ack("a", 4, "x"), "i3": Ack("c", 3, "x")}},
                         committed={3: Commit(3, 4, "x")})
    members = {"trainer": [_member("t0")],
               "inference": [_member("i0"), {**_member("i1", "new", in_epoch=False), "rejoined_from": "a",
                                             "rejoins": 1}]}
    gone = out_of_job(members, view, state)
    assert [(g["member_id"], g["role"], g["incarnation"], g["held"], g["known_from"]) for g in gone] == [
        ("i2", "inference", "a", None, "epoch 4"), ("i3", "inference", "c", 3, "acks of v3"),
        ("t1", "trainer", "b", None, "sources of v4")]
    assert out_of_job({"trainer": [], "inference": []}, None, VersionState(revision=1)) == []
    data = {"job": "j", "run_id": "r1", "epoch": 4, "leader": None, "latest_committed": 3, "committed": [],
            "latest_acks": [], "pending": [], "failed": [], "members": members, "out_of_job": gone}
    table = render_status(data)
    assert "run r1" in table and "x1 (was a)" in table and "rejoined" in table
    assert "out of the job: lease gone (3)" in table and "acks of v3" in table
