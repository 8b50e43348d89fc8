"""A transfer in flight is aborted as soon as an epoch drops one of its participants
(Participant.peer_left, on the membership thread); joins and epochs that keep every
participant leave it alone."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import structlog
from elastic_refit.membership.attempts import REFIT, AttemptSpec
from elastic_refit.membership.view import MemberRecord, MembershipView

from elastic_refit.runtime.participant import Participant


class _Transport:
    """A unit-test double: counts interruptions (the real transports': a flag, a pg abort)."""

    def __init__(self) -> None:
        self.aborts = 0

    def interrupt(self) -> None:
        self.aborts += 1

    def abort(self) -> None:  # only the attempt's own thread aborts
        raise AssertionError("peer_left must interrupt, not abort")


def _rec(member_id: str, role: str = "trainer", inc: str = "a") -> MemberRecord:
    return MemberRecord(role=role, member_id=member_id, incarnation=inc, host="h", domain="d0", device="cpu")


def _participant() -> Participant:
    services = SimpleNamespace(log=structlog.get_logger())
    return Participant(services, planner=None, outcomes=None, side=lambda: None, published=None, serving=None)


SPEC = AttemptSpec(version=2, kind=REFIT, sources=("t0",), holders=(), destinations=("i0",))
EPOCH3 = MembershipView(epoch=3, members=(_rec("t0"), _rec("t1"), _rec("i0", "inference")))


def _moving(p: Participant, transport: _Transport):
    return p._in_flight(EPOCH3, SPEC.participants, transport)


def test_an_epoch_without_a_participant_aborts_the_transfer_once():
    p, t = _participant(), _Transport()
    with _moving(p, t):
        p.peer_left(MembershipView(epoch=4, members=(_rec("t0"), _rec("t1"))))  # i0 gone
        assert t.aborts == 1
        p.peer_left(MembershipView(epoch=5, members=(_rec("t0"),)))  # already aborted: once
        assert t.aborts == 1


def test_a_restarted_participant_is_a_participant_gone():
    p, t = _participant(), _Transport()
    with _moving(p, t):
        p.peer_left(MembershipView(epoch=4, members=(_rec("t0"), _rec("t1"), _rec("i0", "inference", inc="b"))))
    assert t.aborts == 1


def test_joins_non_participants_and_old_views_leave_the_transfer_alone():
    p, t = _participant(), _Transport()
    with _moving(p, t):
        p.peer_left(MembershipView(epoch=4, members=(*EPOCH3.members, _rec("i1", "inference"))))  # a join
        p.peer_left(MembershipView(epoch=5, members=(_rec("t0"), _rec("i0", "inference"))))  # t1 not in SPEC
        p.peer_left(MembershipView(epoch=3, members=(_rec("t0"),)))  # not newer than the transfer's
    assert t.aborts == 0
    p.peer_left(MembershipView(epoch=6, members=()))  # nothing in flight any more
    assert t.aborts == 0


def test_peer_left_races_the_end_of_the_transfer_safely():
    """The membership thread and the agent meet only through the participant's own lock."""
    p = _participant()
    transports = [_Transport() for _ in range(200)]
    gone = MembershipView(epoch=9, members=(_rec("t1"),))
    stop = threading.Event()

    def membership_thread() -> None:
        while not stop.is_set():
            p.peer_left(gone)

    thread = threading.Thread(target=membership_thread)
    thread.start()
    try:
        for t in transports:
            with _moving(p, t):
                pass
    finally:
        stop.set()
        thread.join()
    assert all(t.aborts <= 1 for t in transports)


def test_follow_registers_for_every_view():
    """follow() hands the membership's views to peer_left (a rejoined member follows its new one)."""
    p, t = _participant(), _Transport()
    callbacks = []
    p.follow(SimpleNamespace(on_view=callbacks.append))
    assert len(callbacks) == 1
    with _moving(p, t):
        callbacks[0](EPOCH3, MembershipView(epoch=4, members=(_rec("t0"),)))
    assert t.aborts == 1


def test_any_newer_epoch_interrupts_connecting_ahead():
    """Seen on the H100 (chaos, kill during a grow): the coordinator connected ahead in
    epoch 1 while its peer, which saw epoch 2 first, skipped it; the coordinator waited for
    the transport's 5 s timeout. A newer epoch, even a join, ends connecting ahead now."""
    p, t = _participant(), _Transport()
    with p.connecting(EPOCH3, SPEC.participants, t):
        p.peer_left(MembershipView(epoch=3, members=EPOCH3.members))  # its own epoch: nothing
        assert t.aborts == 0
        p.peer_left(MembershipView(epoch=4, members=(*EPOCH3.members, _rec("i1", "inference"))))  # a join
        assert t.aborts == 1
    p.peer_left(MembershipView(epoch=5, members=()))  # connected (or not): nothing in flight
    assert t.aborts == 1
