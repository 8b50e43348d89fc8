"""The leader's admission of inference newcomers (``membership.admission``): table tests."""

from __future__ import annotations

import pytest
from elastic_refit.membership.admission import Sighting, admit, pending_version, settled
from elastic_refit.membership.versions import Commit, Failure, VersionState
from elastic_refit.membership.view import MemberRecord, MembershipView

T0 = MemberRecord("trainer", "t0", "a", "h", "d0", "cpu")
I0 = MemberRecord("inference", "i0", "a", "h", "d1", "cpu", shard="s0")
I1 = MemberRecord("inference", "i1", "a", "h", "d1", "cpu", shard="s0")  # a replica of i0's shard
I2 = MemberRecord("inference", "i2", "a", "h", "d1", "cpu", shard="s1")  # a TP peer: another shard
I3 = MemberRecord("inference", "i3", "a", "h", "d1", "cpu")  # says nothing of its shard
T1 = MemberRecord("trainer", "t1", "b", "h", "d0", "cpu")
CURRENT = MembershipView(3, (T0, I0))


def _state(*, sources=(), committed=(), failed=()) -> VersionState:
    return VersionState(revision=9, sources={v: {"t0": "a"} for v in sources},
                        committed={v: Commit(v, 3, "d") for v in committed},
                        failed={v: Failure(v, "cause", 3, 3) for v in failed})


@pytest.mark.parametrize("state, want", [
    (_state(), None),
    (_state(sources=(1, 2), committed=(1, 2)), None),
    (_state(sources=(1, 2, 3), committed=(1, 2)), 3),
    (_state(sources=(2, 3, 4), committed=(2,)), 4),  # the newest open one
    (_state(sources=(2, 3), committed=(2,), failed=(3,)), None),
    (_state(sources=(2, 3), committed=(4,)), None),  # older than a commit: superseded
])
def test_pending_version(state, want):
    assert pending_version(state) == want


@pytest.mark.parametrize("version, state, want", [
    (3, _state(sources=(3,), committed=(2,)), False),
    (3, _state(sources=(3,), committed=(3,)), True),
    (3, _state(sources=(3, 4), committed=(4,)), True),
    (3, _state(sources=(3,), failed=(3,)), True),
    (3, _state(sources=(4,)), True),  # pruned or never published: nothing to wait for
])
def test_settled(version, state, want):
    assert settled(version, state) is want


PENDING = _state(sources=(3,), committed=(2,))
SEEN = {I1.identity: Sighting(first_seen=10.0, waits_for=3)}


@pytest.mark.parametrize("name, now, current, desired, sightings, state, bound, members, held, hold_s", [
    ("held while its version is on its way", 10.5, CURRENT, (T0, I0, I1), SEEN, PENDING, 2.0,
     (T0, I0), ("i1",), 1.5),
    ("admitted once the version commits", 10.5, CURRENT, (T0, I0, I1), SEEN,
     _state(sources=(3,), committed=(3,)), 2.0, (T0, I0, I1), (), 0.0),
    ("admitted once the version failed", 10.5, CURRENT, (T0, I0, I1), SEEN,
     _state(sources=(3,), failed=(3,)), 2.0, (T0, I0, I1), (), 0.0),
    ("admitted when the bound runs out", 12.0, CURRENT, (T0, I0, I1), SEEN, PENDING, 2.0,
     (T0, I0, I1), (), 0.0),
    ("nothing was pending at its arrival", 10.5, CURRENT, (T0, I0, I1),
     {I1.identity: Sighting(10.0, None)}, PENDING, 2.0, (T0, I0, I1), (), 0.0),
    ("holding off", 10.5, CURRENT, (T0, I0, I1), SEEN, PENDING, 0.0, (T0, I0, I1), (), 0.0),
    ("no epoch yet", 10.5, None, (T0, I0, I1), SEEN, PENDING, 2.0, (T0, I0, I1), (), 0.0),
    ("no inference rank to commit to", 10.5, MembershipView(3, (T0,)), (T0, I1), SEEN, PENDING, 2.0,
     (T0, I1), (), 0.0),
    ("a trainer is never held", 10.5, CURRENT, (T0, I0, T1), {T1.identity: Sighting(10.0, 3)}, PENDING,
     2.0, (T0, I0, T1), (), 0.0),
    ("no live rank holds its shard (it could not catch up)", 10.5, CURRENT, (T0, I0, I2),
     {I2.identity: Sighting(10.0, 3)}, PENDING, 2.0, (T0, I0, I2), (), 0.0),
    ("its shard unknown", 10.5, CURRENT, (T0, I0, I3), {I3.identity: Sighting(10.0, 3)}, PENDING, 2.0,
     (T0, I0, I3), (), 0.0),
    ("a removal goes out while the newcomer waits", 10.5, MembershipView(3, (T0, T1, I0)), (T0, I0, I1),
     SEEN, PENDING, 2.0, (T0, I0), ("i1",), 1.5),
])
def test_admit(name, now, current, desired, sightings, state, bound, members, held, hold_s):
    out = admit(now, current, desired, sightings, state, hold_bound_s=bound)
    assert (out.members, out.held) == (members, held), name
    assert out.hold_s == pytest.approx(hold_s), name
    assert out.why, name  # every decision says why


def test_replicas_share_a_shard_and_tp_peers_do_not():
    from elastic_refit.layout import TensorFormats
    from elastic_refit.layout.presets import checkpoint_formats, vllm_layout
    from elastic_refit.runtime.checks import shard_of

    layout = vllm_layout("qwen3-30b-a3b", "tp=2,dp=2")  # ranks 0, 2 and 1, 3 replicate each other
    plain = [shard_of(layout, r, TensorFormats()) for r in layout.ranks]
    assert plain[0] == plain[2] and plain[1] == plain[3] and plain[0] != plain[1]
    fp8 = [shard_of(layout, r, checkpoint_formats("qwen3-30b-a3b")) for r in layout.ranks]
    assert fp8[0] == fp8[2] and fp8[0] != plain[0]  # held in other formats: not the same bytes
    shifted = vllm_layout("qwen3-30b-a3b", "tp=2,dp=2", first_rank=4)
    assert shard_of(shifted, 4, TensorFormats()) == plain[0]  # what it holds, not where it sits
