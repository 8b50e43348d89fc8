"""The leader holds an inference newcomer out of the epoch while a version is on its way
(``membership.admission``), against a real etcd: members in this process, one client each."""

from __future__ import annotations

import time

import pytest
from elastic_refit.membership import MembershipConfig
from elastic_refit.membership.service import Membership
from elastic_refit.membership.versions import VersionStore, VersionTracker
from elastic_refit.membership.view import MemberRecord

from tests.integration.conftest import wait_until

pytestmark = pytest.mark.etcd


def _member(make_client, endpoints, job, role, member_id, hold_s):
    client = make_client(endpoints)
    # every inference rank a replica of one shard: a held newcomer can catch up from i0
    record = MemberRecord(role, member_id, "inc-" + member_id, "h", "d0" if role == "trainer" else "d1", "cpu",
                          shard="shard-0" if role == "inference" else "")
    membership = Membership(client, job, record, MembershipConfig(join_hold_s=hold_s)).start()
    tracker = VersionTracker(client, job).start()
    tracker.on_change(membership.hold_newcomers_for(tracker.state))
    return membership, tracker, VersionStore(client, job)


@pytest.fixture
def members(etcd_server, make_client, job):
    made = []

    def make(role, member_id, hold_s=5.0):
        made.append(_member(make_client, etcd_server.endpoints, job, role, member_id, hold_s))
        return made[-1]

    yield make
    for membership, tracker, _ in reversed(made):
        tracker.stop()
        membership.close()


def _seen_by_all(trackers, version: int) -> None:
    """Every member's tracker holds ``version``'s source (whoever leads reads its own)."""
    wait_until(lambda: all(version in t.state().sources for t in trackers), 10, f"version {version} seen")


def _ids(membership) -> list[str]:
    view = membership.view
    return [m.member_id for m in view.members] if view else []


def test_a_newcomer_waits_for_the_pending_version_then_joins(members):
    t0, t0_versions, store = members("trainer", "t0")
    _, i0_versions, _ = members("inference", "i0")
    wait_until(lambda: _ids(t0) == ["t0", "i0"], 10, "the first epoch")
    epoch = t0.view.epoch
    store.publish_source(t0, 1, "digest")  # version 1 is on its way to i0
    _seen_by_all([t0_versions, i0_versions], 1)
    i1, _, _ = members("inference", "i1")
    time.sleep(1.0)  # well past the debounce: without the hold, i1 would be in
    assert _ids(t0) == ["t0", "i0"] and t0.view.epoch == epoch, "the newcomer joined while v1 was on its way"
    committed_at = time.monotonic()
    assert store.commit(t0, 1, epoch, "digest")
    wait_until(lambda: _ids(i1) == ["t0", "i0", "i1"], 5, "the newcomer's epoch after the commit")
    assert time.monotonic() - committed_at < 2.0  # the commit woke the leader, not the 5 s bound


def test_a_newcomer_joins_when_its_hold_runs_out(members):
    t0, t0_versions, store = members("trainer", "t0", hold_s=0.6)
    _, i0_versions, _ = members("inference", "i0", hold_s=0.6)
    wait_until(lambda: _ids(t0) == ["t0", "i0"], 10, "the first epoch")
    store.publish_source(t0, 1, "digest")  # never committed
    _seen_by_all([t0_versions, i0_versions], 1)
    registered = time.monotonic()
    members("inference", "i1", hold_s=0.6)
    wait_until(lambda: _ids(t0) == ["t0", "i0", "i1"], 10, "the newcomer's epoch after the bound")
    assert time.monotonic() - registered >= 0.5  # held (0.6 s from the leader's first sight)


def test_nothing_pending_and_trainers_join_at_once(members):
    t0, _, store = members("trainer", "t0")
    members("inference", "i0")
    wait_until(lambda: _ids(t0) == ["t0", "i0"], 10, "the first epoch")
    started = time.monotonic()
    members("inference", "i1")  # no version pending: no hold
    wait_until(lambda: "i1" in _ids(t0), 3, "the inference newcomer")
    store.publish_source(t0, 2, "digest")
    members("trainer", "t1")  # a trainer is never held
    wait_until(lambda: "t1" in _ids(t0), 3, "the trainer newcomer")
    assert time.monotonic() - started < 4.0
