"""The pure decisions of fast crash detection (membership/liveness.py): which transport
errors are evidence of a dead peer, who refutes, confirms or drops a suspicion and when,
and which peer the liveness ring watches. Table-driven, the clock passed in."""

from __future__ import annotations

import pytest
from elastic_refit.membership.config import MembershipConfig
from elastic_refit.membership.liveness import (
    RingPeer,
    Suspicion,
    dead_peer_evidence,
    decide_suspicions,
    reachable_probe,
    ring_order,
    ring_successor,
    ring_successor_in,
)

W = 0.3  # refute window


@pytest.mark.parametrize(("message", "evidence"), [
    ("rank 1: recv with rank 2 failed: [../gloo/transport/tcp/pair.cc:598] Connection closed by peer "
     "[127.0.0.1]:4242", "closed"),
    ("rank 0: send with rank 3 failed: Connection reset by peer", "reset"),
    ("rank 0: send with rank 3 failed: Broken pipe", "reset"),
    ("rank 2: connect to 127.0.0.1:5000 failed: Connection refused", "refused"),
    ("transfer: NCCL reports error 6: remote process exited or there was a network error", "remote"),
    # A slow or stopped peer: never evidence.
    ("rank 1: recv with rank 2 failed: [pair.cc:510] Timed out waiting 1500ms for recv operation", None),
    ("rank 1: recv with rank 2 not done within 1.5 s (timeout)", None),
    ("rank 0: send on an aborted transport", None),
    ("transfer: given up, superseded", None),
    # A timeout that mentions a closed connection is still a timeout.
    ("Timed out after the connection closed", None),
    ("something else entirely", None),
])
def test_dead_peer_evidence(message, evidence):
    assert dead_peer_evidence(message) == evidence


def sus(suspect="i1", lease=11, reporter="i0", reporter_lease=10, revision=100, evidence="closed"):
    return Suspicion(suspect, "inference", lease, f"{suspect}-inc", reporter, reporter_lease, evidence,
                     revision=revision)


LEASES = {"t0": 1, "i0": 10, "i1": 11}


@pytest.mark.parametrize(("case", "my_lease", "leader_lease", "members", "now", "seen", "expect"), [
    # The suspect sees its own suspicion: refute at once, whatever the window.
    ("suspect refutes", 11, 1, LEASES, 0.0, {}, "refute"),
    # The leader (not the suspect) confirms, once its window (from its first sight) is over.
    ("leader waits", 1, 1, LEASES, 5.0, {}, "wait"),
    ("leader still waits", 1, 1, LEASES, 5.2, {("i1", 100): 5.0}, "wait"),
    ("leader confirms", 1, 1, LEASES, 5.3, {("i1", 100): 5.0}, "confirm"),
    # The reporter leaves it to the leader; a bystander does nothing.
    ("reporter defers to leader", 10, 1, LEASES, 9.0, {("i1", 100): 0.0}, "none"),
    ("bystander", 99, 1, LEASES, 9.0, {}, "none"),
    # The suspect holds the leader key (or there is no leader): the reporter confirms.
    ("suspect leads: reporter confirms", 10, 11, LEASES, 1.0, {("i1", 100): 0.5}, "confirm"),
    ("suspect leads: old leader's token ignored", 1, 11, LEASES, 1.0, {("i1", 100): 0.0}, "none"),
    ("no leader: reporter confirms", 10, None, LEASES, 1.0, {("i1", 100): 0.0}, "confirm"),
    # The suspected incarnation is gone (left, expired, replaced by a restart): drop it.
    ("suspect gone", 1, 1, {"t0": 1, "i0": 10}, 0.0, {}, "drop"),
    ("suspect restarted", 1, 1, {**LEASES, "i1": 12}, 0.0, {}, "drop"),
])
def test_decide_suspicions(case, my_lease, leader_lease, members, now, seen, expect):
    d = decide_suspicions(now, [sus()], seen, my_lease=my_lease, member_leases=members,
                          leader_lease=leader_lease, refute_window_s=W)
    got = {"refute": d.refute, "confirm": d.confirm, "drop": d.drop}
    if expect in got:
        assert got[expect] == (sus(),), case
        assert all(not v for k, v in got.items() if k != expect), case
    else:
        assert not (d.refute or d.confirm or d.drop), case
    if expect == "wait":
        first = seen.get(("i1", 100), now)
        assert d.wake_in_s == pytest.approx(first + W - now)
        assert d.seen == {("i1", 100): first}
    if expect in ("none", "refute", "drop"):
        assert d.wake_in_s is None


def test_a_suspicion_the_confirmer_verified_itself_is_confirmed_at_once():
    kw = dict(my_lease=1, member_leases=LEASES, leader_lease=1, refute_window_s=W)
    waiting = decide_suspicions(5.0, [sus()], {}, **kw)
    assert waiting.pending == (sus(),) and not waiting.confirm
    now = decide_suspicions(5.0, [sus()], {}, verified=frozenset({("i1", 100)}), **kw)
    assert now.confirm == (sus(),) and not now.pending
    # Verification never fences another incarnation, nor overrides the suspect's refutation.
    assert decide_suspicions(5.0, [sus()], {}, verified=frozenset({("i1", 100)}),
                             **{**kw, "member_leases": {**LEASES, "i1": 12}}).drop == (sus(),)
    assert decide_suspicions(5.0, [sus()], {}, verified=frozenset({("i1", 100)}),
                             **{**kw, "my_lease": 11}).refute == (sus(),)


def test_a_new_suspicion_of_the_same_member_starts_its_own_window():
    # A suspicion deleted and raised again (a new create revision) is a new one.
    d = decide_suspicions(10.0, [sus(revision=200)], {("i1", 100): 0.0}, my_lease=1, member_leases=LEASES,
                          leader_lease=1, refute_window_s=W)
    assert not d.confirm and d.seen == {("i1", 200): 10.0}


def test_decide_suspicions_rejects_a_bad_window():
    with pytest.raises(ValueError, match="refute_window_s"):
        decide_suspicions(0.0, [], {}, my_lease=1, member_leases={}, leader_lease=None, refute_window_s=0)


def test_suspicion_round_trips_and_checks_its_fields():
    s = sus()
    assert Suspicion.decode(s.encode(), revision=100) == s
    with pytest.raises(ValueError, match="evidence"):
        sus(evidence="timeout")
    with pytest.raises(ValueError, match="leases"):
        sus(lease=0)


def peer(key, probe="127.0.0.1:1", host="h0"):
    return RingPeer(f"/m/{key}", key, 1, probe, host)


@pytest.mark.parametrize(("me", "peers", "expect"), [
    ("b", ["a", "b", "c"], "c"),
    ("c", ["a", "b", "c"], "a"),  # wraps around
    ("a", ["a"], None),  # alone
    ("a", ["a", "b"], "b"),
    ("b", ["a", "b"], "a"),  # two members watch each other
])
def test_ring_successor(me, peers, expect):
    got = ring_successor(f"/m/{me}", [peer(p) for p in peers], "h0")
    assert (got.member_id if got else None) == expect


def test_the_shared_ring_order_gives_every_member_the_same_successor():
    """ring_order is built once per snapshot and host for a process's members; each looks
    its successor up by bisection: the answer of the per-member scan, for every member."""
    import random

    rng = random.Random(7)
    for trial in range(200):
        keys = sorted(rng.sample([f"k{i:03d}" for i in range(60)], rng.randint(1, 12)))
        peers = [peer(k, probe=rng.choice(["127.0.0.1:1", "10.0.0.1:2", "bad"]), host=rng.choice(["h0", "h1"]))
                 for k in keys]
        rng.shuffle(peers)
        for me in [*keys, "k000", "k999", "a"]:  # members, and keys that are not (a member's own key gone)
            for host in ("h0", "h1"):
                expect = ring_successor(f"/m/{me}", peers, host)
                got = ring_successor_in(f"/m/{me}", ring_order(peers, host))
                assert got == expect, (trial, me, host, keys)


def test_ring_skips_loopback_probes_of_other_hosts():
    peers = [peer("a"), peer("b", host="h1"), peer("c", probe="10.0.0.3:7", host="h1")]
    assert ring_successor("/m/a", peers, "h0").member_id == "c"
    assert reachable_probe("127.0.0.1:5", "h0", "h0")
    assert not reachable_probe("127.0.0.1:5", "h1", "h0")
    assert reachable_probe("[::1]:5", "h0", "h0") and not reachable_probe("[::1]:5", "h1", "h0")
    assert not reachable_probe("no-port", "h0", "h0")


@pytest.mark.parametrize(("changes", "match"), [
    ({"refute_window_s": 0}, "refute_window_s"),
    ({"refute_window_s": 1.0}, "refute_window_s"),  # not well under a 2 s TTL
    ({"liveness_host": ""}, "liveness_host"),
])
def test_membership_config_rejects_bad_suspicion_settings(changes, match):
    with pytest.raises(ValueError, match=match):
        MembershipConfig(**changes)


def test_a_stale_reform_request_calls_for_no_new_epoch():
    from dataclasses import replace

    from elastic_refit.membership.view import MemberRecord, MembershipView, needs_new_epoch

    a = MemberRecord("trainer", "t0", "a", "h", "d", "cpu")
    b = MemberRecord("inference", "i0", "b", "h", "d", "cpu")
    current = MembershipView(epoch=5, members=(a, b))
    cases = [
        ((a, b), False),  # nothing changed
        ((a,), True),  # a member left
        ((a, replace(b, reform=1, reform_epoch=5)), True),  # asked for a rebuild of epoch 5
        ((a, replace(b, reform=1, reform_epoch=4)), False),  # asked for epoch 4's, before 5 arrived
        ((a, replace(b, reform=1, reform_epoch=4, layout="f")), True),  # and something else changed
        ((a, replace(b, incarnation="c")), True),  # a restart
        ((), False),
    ]
    for desired, expect in cases:
        assert needs_new_epoch(current, desired) is expect, desired
    assert needs_new_epoch(None, (a,)) is True


def test_the_leader_holds_epochs_while_a_suspicion_is_pending_and_no_longer():
    from types import SimpleNamespace

    from elastic_refit.membership.client import KeyValue
    from elastic_refit.membership.keys import JobKeys
    from elastic_refit.membership.leader import LeaderLoop
    from elastic_refit.membership.watch import RangeSnapshot

    keys = JobKeys("j")
    loop = LeaderLoop(SimpleNamespace(keys=keys, config=MembershipConfig()))  # type: ignore[arg-type]
    bound = 2 * MembershipConfig().refute_window_s + 0.05

    def snap(member_lease: int | None) -> RangeSnapshot:
        items = {keys.suspect("i1"): KeyValue(keys.suspect("i1"), sus().encode(), 100, 100, 1, 10)}
        if member_lease is not None:
            key = keys.member("inference", "i1")
            items[key] = KeyValue(key, b"{}", 5, 5, 1, member_lease)
        return RangeSnapshot(100, items)

    assert loop.suspicion_hold_s(snap(11), now=1.0) == pytest.approx(bound)
    assert loop.suspicion_hold_s(snap(11), now=1.1) == pytest.approx(bound - 0.1)  # from first sight
    assert loop.suspicion_hold_s(snap(11), now=1.0 + bound + 1) == 0.0  # bounded: never held for good
    assert loop.suspicion_hold_s(snap(12), now=2.0) == 0.0  # another incarnation: nothing pending
    assert loop.suspicion_hold_s(snap(None), now=2.0) == 0.0  # suspect gone (fenced, left)
    assert loop.suspicion_hold_s(RangeSnapshot(1, {}), now=2.0) == 0.0


def test_an_epoch_conflict_against_an_older_epoch_key_is_the_store_going_back():
    """The leader's epoch write conflicts; the epoch key etcd holds (the failed write's read)
    was modified before the write the leader's watcher holds: etcd went back (restored from an
    older copy), its watcher will never bring a newer epoch and every retry would conflict at
    once. JobStateLost, latched in the client's guard; a newer key is an ordinary conflict."""
    from types import SimpleNamespace

    from elastic_refit.membership import JobStateLost
    from elastic_refit.membership.client import KeyValue
    from elastic_refit.membership.keys import JobKeys
    from elastic_refit.membership.leader import LeaderLoop
    from elastic_refit.membership.revisions import RevisionGuard

    keys = JobKeys("j")
    guard = RevisionGuard()
    loop = LeaderLoop(SimpleNamespace(keys=keys, config=MembershipConfig(),  # type: ignore[arg-type]
                                      client=SimpleNamespace(revisions=guard, endpoint="e:1")))
    leader = KeyValue(keys.leader, b"{}", 49, 49, 1, 7)

    def epoch(mod: int) -> KeyValue:
        return KeyValue(keys.epoch, b"{}", 3, mod, 2, 0)

    def failed(*held: KeyValue) -> SimpleNamespace:
        return SimpleNamespace(gets=[[leader], list(held)])

    seen = epoch(47)
    loop._check_epoch_went_back(failed(epoch(52)), seen)  # another leader wrote after: retry
    loop._check_epoch_went_back(failed(epoch(47)), None)  # nothing seen yet: nothing to compare
    assert guard.went_back is None
    with pytest.raises(JobStateLost, match=r"holds /elastic-refit/j/epoch at mod revision 40, where this process "
                                           r"saw it written at revision 47"):
        loop._check_epoch_went_back(failed(epoch(40)), seen)
    assert guard.went_back is not None
    bare = LeaderLoop(SimpleNamespace(keys=keys, config=MembershipConfig(),  # type: ignore[arg-type]
                                      client=SimpleNamespace(revisions=None, endpoint="e:1")))
    with pytest.raises(JobStateLost, match="at mod revision 0, where this leader saw it written at revision 47"):
        bare._check_epoch_went_back(failed(), seen)  # a client without a guard: raised all the same
