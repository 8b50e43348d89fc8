"""The revision guard: a store that answers below a revision seen before went back, latched."""

from __future__ import annotations

import pytest
from elastic_refit.membership import JobStateLost
from elastic_refit.membership.revisions import RevisionGuard
from hypothesis import given
from hypothesis import strategies as st


@given(st.lists(st.integers(min_value=1, max_value=1000), min_size=1, max_size=40))
def test_a_revision_below_the_highest_seen_is_latched(revisions):
    guard, highest, went_back = RevisionGuard(), 0, False
    for revision in revisions:
        if went_back or revision < highest:
            went_back = True
            with pytest.raises(JobStateLost, match="below revision"):
                guard.saw(revision, "127.0.0.1:2379", floor=guard.highest)
        else:
            guard.saw(revision, "127.0.0.1:2379", floor=guard.highest)
            highest = revision
        assert guard.highest == highest
    assert (guard.went_back is not None) == went_back


def test_the_finding_stays_once_the_store_grows_past_it_and_tells_listeners_once():
    guard, heard = RevisionGuard(), []
    remove = guard.on_went_back(heard.append)
    guard.saw(50, "a:1", floor=guard.highest)
    guard.floor(80)  # a watch event proved revision 80 committed: no check, a higher floor
    guard.saw(80, "a:1", floor=guard.highest)
    with pytest.raises(JobStateLost, match=r"at a:1 answered at revision 12, below revision 80"):
        guard.saw(12, "a:1", floor=guard.highest)
    with pytest.raises(JobStateLost, match="revision 12, below revision 80"):
        guard.saw(500, "a:1", floor=guard.highest)  # the restored store caught up: still the older state
    with pytest.raises(JobStateLost):
        guard.check()
    assert len(heard) == 1 and heard[0] is guard.went_back
    late = []
    guard.on_went_back(late.append)  # registered after the finding: told at once
    assert late == [guard.went_back]
    remove()
    remove()  # twice is harmless


def test_removed_listeners_hear_nothing_and_a_floor_never_lowers():
    guard, heard = RevisionGuard(), []
    guard.on_went_back(heard.append)()
    guard.floor(30)
    guard.floor(10)
    assert guard.highest == 30 and guard.went_back is None
    with pytest.raises(JobStateLost):
        guard.saw(29, "b:2", floor=guard.highest)
    assert heard == []


def test_requests_in_flight_together_may_be_answered_in_either_order():
    """Two requests sent when the highest revision was 10: the one answered second at a lower
    revision (7 < 12) is right, as long as it is not below what was seen when it was sent."""
    guard = RevisionGuard()
    guard.saw(10, "a:1", floor=0)
    floor = guard.highest
    guard.saw(12, "a:1", floor=floor)
    guard.saw(11, "a:1", floor=floor)
    assert guard.highest == 12 and guard.went_back is None
    with pytest.raises(JobStateLost, match="answered at revision 9, below revision 10"):
        guard.saw(9, "a:1", floor=floor)


def test_a_key_modified_before_the_write_seen_of_it_is_the_store_going_back():
    """A key's modification revision never decreases: the epoch key held at revision 40 (or
    absent) where this process saw it written at 47 is found even when etcd's revision has
    grown past everything seen (the restored store took writes before this process asked)."""
    guard, heard = RevisionGuard(), []
    guard.on_went_back(heard.append)
    guard.saw(47, "a:1", floor=0)
    guard.key_went_back("/j/epoch", 47, 47, "a:1")  # the same write: fine
    guard.key_went_back("/j/epoch", 60, 47, "a:1")  # a newer write: fine
    assert guard.went_back is None
    with pytest.raises(JobStateLost, match=r"holds /j/epoch at mod revision 40, where this process saw it written "
                                           r"at revision 47"):
        guard.key_went_back("/j/epoch", 40, 47, "a:1")
    assert len(heard) == 1
    with pytest.raises(JobStateLost, match="mod revision 40"):  # latched: the first cause stays
        guard.saw(900, "a:1", floor=guard.highest)
    other = RevisionGuard()
    with pytest.raises(JobStateLost, match="holds /j/epoch absent"):
        other.key_went_back("/j/epoch", 0, 12, "b:2")
