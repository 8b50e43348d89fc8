"""Latched errors keep nothing of the code that raised them.

A member that failed for good keeps its error for the rest of its life and raises it to
every later caller. Raising the kept object itself grew it at every raise: the raising
frames joined its traceback and the fault being handled became its ``__context__``. On the
3-node etcd cluster, after etcd was wiped mid-refit, that chain held a trainer's failed
send work, whose gloo context kept its pair of sockets to the other trainer open after
every member had stopped (tests/chaos/test_etcd_cluster.py, the wipe cell).
"""

from __future__ import annotations

import threading
import weakref

import pytest
from elastic_refit.membership import EtcdUnavailable, JobStateLost
from elastic_refit.membership.revisions import RevisionGuard

from elastic_refit.errors import (
    MembershipLost,
    RefitFailed,
    RefitTimeout,
    VersionUnreachable,
    drop_frames,
    raise_latched,
)
from elastic_refit.runtime.outcomes import Outcomes

_KEPT = (JobStateLost, MembershipLost, RefitFailed)


class _Work:
    """Stands for posted work that holds a transport's sockets."""


def _fail_holding(work: _Work) -> None:
    held = work  # noqa: F841 -- a local of the failing frame, as a transport's wait has
    raise ConnectionError("Connection closed by peer")


def _handle_transfer_fault(raise_kept) -> weakref.ref:
    """Raise a kept error while handling a transfer fault whose frame holds work; returns a
    reference to that work (dead once nothing holds it)."""
    work = _Work()
    ref = weakref.ref(work)
    try:
        _fail_holding(work)
    except ConnectionError:
        del work
        with pytest.raises(_KEPT) as caught:
            raise_kept()
        caught = None  # noqa: F841 -- what a caller does when it is done with the error
    return ref


def test_a_guard_finding_raised_while_handling_a_fault_does_not_keep_that_fault():
    guard = RevisionGuard()
    guard.saw(40, "a:1", floor=0)
    with pytest.raises(JobStateLost):
        guard.saw(3, "a:1", floor=guard.highest)
    ref = _handle_transfer_fault(guard.check)
    assert ref() is None, "the latched finding keeps the handled fault's frames (and the work in them)"
    kept = guard.went_back
    assert kept is not None and kept.__context__ is None and kept.__traceback__ is None


def test_a_latched_agent_error_raised_to_waiters_keeps_none_of_their_frames():
    outcomes = Outcomes("t0")
    outcomes.latch(JobStateLost("the job's control state in etcd is not the one it joined"))

    def wait() -> None:
        outcomes.wait_for(lambda: None, 5.0, "version 4")

    ref = _handle_transfer_fault(wait)
    assert ref() is None, "the latched error keeps a waiter's handled fault"
    with pytest.raises(JobStateLost, match="not the one it joined"):
        wait()


def test_drop_frames_drops_the_locals_of_every_frame_in_the_chain_but_keeps_where():
    work = _Work()
    ref = weakref.ref(work)
    try:
        try:
            _fail_holding(work)
        except ConnectionError as exc:
            raise MembershipLost("lost while sending") from exc
    except MembershipLost as exc:
        kept = drop_frames(exc)
    del work
    assert ref() is None, "a frame of the latched chain still holds its locals"
    assert isinstance(kept.__cause__, ConnectionError)
    assert kept.__traceback__ is not None and kept.__cause__.__traceback__ is not None  # where, still


def test_a_copy_is_the_same_fault_type_message_fields_and_cause():
    cause = ConnectionError("Connection closed by peer")
    kept = RefitFailed(7, "TransportAborted: rank 1 send failed", 3, epoch=4)
    kept.__cause__ = cause
    with pytest.raises(RefitFailed) as caught:
        raise_latched(kept)
    copy = caught.value
    assert copy is not kept and str(copy) == str(kept)
    assert (copy.version, copy.cause, copy.num_attempts, copy.epoch) == (7, kept.cause, 3, 4)
    assert copy.__cause__ is cause and kept.__traceback__ is None


def test_waiters_on_many_threads_each_get_their_own_copy():
    outcomes = Outcomes("i0")
    outcomes.latch(MembershipLost("i0 (incarnation 2) lost: lease expired"))
    seen: list[BaseException] = []

    def wait() -> None:
        try:
            outcomes.wait_for(lambda: None, 5.0, "version 2")
        except MembershipLost as exc:
            seen.append(exc)

    threads = [threading.Thread(target=wait) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(seen) == 4 and len({id(e) for e in seen}) == 4
    assert {str(e) for e in seen} == {"i0 (incarnation 2) lost: lease expired"}


@pytest.mark.parametrize("kept", [
    RefitTimeout("version 3", 5.0, member_id="i0", last_failure="TransportAborted: rank 1"),  # an OSError too
    VersionUnreachable(3, "its TP peer is gone", member_id="i1"),
    EtcdUnavailable(("127.0.0.1:2379",), "put", ConnectionError("refused")),
    JobStateLost("wiped"),
])
def test_every_kind_of_kept_error_copies_without_its_init(kept):
    with pytest.raises(type(kept)) as caught:
        raise_latched(kept)
    assert caught.value is not kept and str(caught.value) == str(kept) and vars(caught.value) == vars(kept)


def test_drop_frames_leaves_a_suspended_generator_running():
    """A fault caught inside a generator that goes on (a retry loop) has that generator's
    frame in its traceback: clearing it would close the generator."""
    caught: list[BaseException] = []

    def retrying():
        for attempt in range(3):
            try:
                raise ConnectionError(f"attempt {attempt}")
            except ConnectionError as exc:
                caught.append(exc)
            yield attempt

    gen = retrying()
    assert next(gen) == 0
    drop_frames(caught[0])  # the generator is suspended, its frame is in the traceback
    assert next(gen) == 1 and next(gen) == 2
