"""The control plane at scale, on a real etcd: shared watches, watched version state, the bench.

- ``WatchHub``: many consumers of one stream each see every change, a stopped one no more;
  members of one process registered through one hub follow epochs and notice a peer's
  expired lease like members with watches of their own.
- ``VersionTracker``: the version state it keeps from watch events equals a fresh read.
- ``EtcdStore.check``: more keys than one transaction may read.
- ``elastic-refit bench control-plane`` (8 members): its JSON keys, and the SIGKILLed
  member's epoch was seen by every survivor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from elastic_refit.membership.attempts import REFIT, AttemptLedger, AttemptSpec
from elastic_refit.membership.config import MembershipConfig
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.leases import lease_keeper
from elastic_refit.membership.service import Membership
from elastic_refit.membership.store import EtcdStore
from elastic_refit.membership.versions import VersionStore, VersionTracker
from elastic_refit.membership.view import MemberRecord
from elastic_refit.membership.watch import WatchHub

REPO_ROOT = Path(__file__).resolve().parents[2]


def _record(member_id: str, role: str = "inference") -> MemberRecord:
    return MemberRecord(role=role, member_id=member_id, incarnation=f"{os.getpid()}-{member_id}", host="h",
                        domain="d", device="cpu")


def test_every_view_of_a_hub_sees_each_change_and_a_stopped_one_no_more(etcd_server, make_client, job):
    client = make_client(etcd_server.endpoints)
    client.put(f"/{job}/w/a", b"1")
    hub = WatchHub(client, f"/{job}/w/", f"/{job}/w0", name="test")
    seen: dict[int, list[tuple[bool, list[str]]]] = {0: [], 1: []}
    views = [hub.view() for _ in seen]
    for i, view in enumerate(views):
        view.add_listener(lambda reset, events, snap, i=i: seen[i].append((reset, [e.key for e in events])))
        view.start()
    # Each view starts with a reset that holds what was there before it attached.
    assert all(seen[i][0][0] and not seen[i][0][1] for i in seen)
    assert f"/{job}/w/a" in views[0].snapshot().items
    revision = client.put(f"/{job}/w/b", b"2")
    views[0].wait_for(lambda s: s.revision >= revision, 10.0)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and not all(any(f"/{job}/w/b" in keys for _, keys in seen[i]) for i in seen):
        time.sleep(0.01)
    assert all(any(f"/{job}/w/b" in keys for _, keys in seen[i]) for i in seen), seen
    views[1].stop()
    time.sleep(0.2)  # the detach runs on the client loop
    before = len(seen[1])
    revision = client.put(f"/{job}/w/c", b"3")
    views[0].wait_for(lambda s: f"/{job}/w/c" in s.items, 10.0)
    time.sleep(0.2)
    assert len(seen[1]) == before, "a stopped view was still given changes"
    assert hub.num_views == 1
    # One stream and one snapshot for all: the views read the same object until a change.
    assert views[0].snapshot() is views[0].snapshot()
    hub.close()


def test_a_burst_of_changes_reaches_a_hubs_views_in_fewer_deliveries_every_event_in_order(
        etcd_server, make_client, job):
    # 200 puts in 4 transactions of 50 and 100 single puts, as fast as etcd takes them: the
    # views get every event, in revision order, in fewer deliveries than changes (a hub of
    # hundreds of members did per-member work once per change).
    client = make_client(etcd_server.endpoints)
    hub = WatchHub(client, f"/{job}/w/", f"/{job}/w0", name="test", batch_s=0.05)
    seen: list[tuple[bool, list[tuple[int, str]]]] = []
    view = hub.view()
    view.add_listener(lambda reset, events, snap: seen.append((reset, [(e.revision, e.key) for e in events])))
    view.start()
    from elastic_refit.membership.client import Put

    for batch in range(4):
        client.txn([], [Put(f"/{job}/w/t{batch}-{k:02d}", b"x") for k in range(50)])
    last = 0
    for k in range(100):
        last = client.put(f"/{job}/w/p{k:03d}", b"y")
    view.wait_for(lambda snap: snap.revision >= last, 10.0)
    time.sleep(0.2)  # the last batch window
    events = [e for reset, evs in seen[1:] for e in evs]
    assert not any(reset for reset, _ in seen[1:])
    assert [key for _, key in events] == ([f"/{job}/w/t{b}-{k:02d}" for b in range(4) for k in range(50)]
                                          + [f"/{job}/w/p{k:03d}" for k in range(100)])
    assert [rev for rev, _ in events] == sorted(rev for rev, _ in events)
    changes = 4 + 100
    assert len(seen) - 1 < changes, f"{len(seen) - 1} deliveries for {changes} changes"
    hub.close()


def test_members_on_one_hub_follow_epochs_and_see_a_peer_expire(etcd_server, make_client, job):
    client = make_client(etcd_server.endpoints)
    keys = JobKeys(job)
    start, end = keys.control_range
    hub = WatchHub(client, start, end, name="control")
    config = MembershipConfig(ttl_s=2)
    members = [Membership(client, job, _record(f"i{k}"), MembershipConfig(ttl_s=2, candidate=k == 0),
                          watch_hub=hub).start() for k in range(3)]
    # The member that will "crash" has a client and a watch of its own (its own process).
    other = make_client(etcd_server.endpoints)
    victim = Membership(other, job, _record("v0"), MembershipConfig(ttl_s=2, candidate=False)).start()
    try:
        views = [m.wait_for_view(lambda v: v.num_ranks == 4, timeout_s=20) for m in members]
        assert {v.epoch for v in views} == {views[0].epoch}
        # Shared decode: every member of the hub holds the very same view object.
        assert all(m.view is members[0].view for m in members)
        other.close()  # the victim's keepalives stop: its lease runs out, as in a crash
        killed = time.monotonic()
        after = [m.wait_for_view(lambda v: "v0" not in v, after_epoch=views[0].epoch, timeout_s=20)
                 for m in members]
        assert time.monotonic() - killed < config.ttl_s + 3.0
        assert all(v.member_ids == after[0].member_ids for v in after) and len(after[0].members) == 3
        assert not any(m.lost.is_set() for m in members)
    finally:
        victim.closing = True
        for m in members:
            m.close()
        hub.close()


def test_the_tracked_version_state_equals_a_fresh_read(etcd_server, make_client, job):
    client = make_client(etcd_server.endpoints)
    keys = JobKeys(job)
    membership = Membership(client, job, _record("t0", role="trainer"), MembershipConfig(ttl_s=2)).start()
    acker = Membership(client, job, _record("i0"), MembershipConfig(ttl_s=2, candidate=False)).start()
    store = VersionStore(client, job)
    tracker = VersionTracker(client, job).start()
    seen: list[int] = []
    tracker.on_change(lambda reset, events: seen.append(len(events)))
    try:
        view = membership.wait_for_view(lambda v: v.num_ranks == 2, timeout_s=20)
        epoch_store = EtcdStore(client, job, view.epoch)
        for version in (1, 2, 3):
            store.publish_source(membership, version, digest=f"d{version}")
            store.ack(acker, version, view.epoch, f"a{version}", done=(epoch_store.prefix + "attempt/0/done/i0", b"ok"))
            assert store.commit(membership, version, view.epoch, f"c{version}")
        store.prune(membership, view.epoch, store.snapshot(), 3)
        fresh = store.snapshot()

        def same() -> bool:  # the revisions differ: the read's is the store's, the watch's its last event's
            return replace(tracker.state(), revision=fresh.revision) == fresh

        deadline = time.monotonic() + 10
        while not same() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert same(), (tracker.state(), fresh)
        assert 0 < tracker.revision <= fresh.revision
        assert tracker.num_acks(3) == 1 and tracker.num_acks(1) == 0  # pruned: gone from both
        assert tracker.committed(3) is not None and seen
        # The ack's done key went in the ack's transaction.
        assert client.get(epoch_store.prefix + "attempt/0/done/i0").value == b"ok"
        assert keys.parse_done_key(epoch_store.prefix + "attempt/0/done/i0") == (view.epoch, 0, "i0")
    finally:
        tracker.stop()
        acker.close()
        membership.close()


def test_store_check_reads_more_keys_than_one_transaction_may(etcd_server, make_client, job):
    client = make_client(etcd_server.endpoints)
    store = EtcdStore(client, job, 1)
    names = [f"k{i:03d}" for i in range(150)]  # etcd's --max-txn-ops is 128
    for name in names[:-1]:
        store.set(name, b"x")
    assert not store.check(names)
    assert store._missing(names) == [names[-1]]
    store.set(names[-1], b"x")
    assert store.check(names)
    store.wait(names)


def test_bench_control_plane_json_and_the_kill_seen_by_all(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-m", "elastic_refit.cli", "bench", "control-plane", "--members", "8",
                           "--versions", "2", "--processes", "2", "--idle", "1", "--json"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    for key in ("members", "epoch_convergence_p99_s", "commit_round_p50_s", "commit_round_p99_s",
                "etcd_requests_per_s_per_member", "etcd_db_bytes"):
        assert key in result, key
    assert result["members"] == 8 and result["versions"] == 2 and result["kills"] == 1
    assert result["kill_seen_by_all"] and not result["members_lost"] and result["num_errors"] == 0
    (kill,) = result["per_kill"]
    assert kill["seen_by_all"] and kill["victims"] == ["v0000"]
    # The survivors saw the epoch without the victim after its lease could expire, not before.
    assert 0 < result["epoch_convergence_p99_s"] < 30
    assert result["commit_round_p50_s"] > 0 and result["etcd_db_bytes"] > 0
    assert result["etcd_requests_per_s_per_member"] > 0  # at least the lease keepalives
    assert "LeaseKeepAlive" in result["etcd_requests_by_method"]


def test_the_tracker_waits_for_a_revision_of_a_write_it_watches(etcd_server, make_client, job):
    client = make_client(etcd_server.endpoints)
    membership = Membership(client, job, _record("t0", role="trainer"), MembershipConfig(ttl_s=2)).start()
    acker = Membership(client, job, _record("i0"), MembershipConfig(ttl_s=2, candidate=False)).start()
    store = VersionStore(client, job)
    tracker = VersionTracker(client, job).start()
    try:
        view = membership.wait_for_view(lambda v: v.num_ranks == 2, timeout_s=20)
        epoch_store = EtcdStore(client, job, view.epoch)
        store.ack(acker, 1, view.epoch, "a1", done=(epoch_store.etcd_key("attempt/0/done/i0"), b"ok"))
        done = epoch_store.read(["attempt/0/done/i0"])["attempt/0/done/i0"]
        # The done key a coordinator reads names the revision its ack landed at.
        state = tracker.state_at(done.mod_revision, timeout_s=10)
        assert state is not None and "i0" in state.acks[1]
        assert tracker.state_at(done.mod_revision + 1_000, timeout_s=0.2) is None  # no such write: it gives up
    finally:
        tracker.stop()
        acker.close()
        membership.close()


def test_store_values_and_attempts_come_in_one_request_or_from_a_watch(etcd_server, make_client, job):
    client = make_client(etcd_server.endpoints)
    membership = Membership(client, job, _record("t0", role="trainer"), MembershipConfig(ttl_s=2)).start()
    calls: list[str] = []
    for name in ("get", "txn", "first"):
        method = getattr(client, name)
        setattr(client, name, lambda *a, _m=method, _n=name, **kw: (calls.append(_n), _m(*a, **kw))[1])
    try:
        view = membership.wait_for_view(lambda v: v.num_ranks == 1, timeout_s=20)
        store = EtcdStore(client, job, view.epoch, namespace="comm")
        names = [f"plan/{i}" for i in range(5)]
        for i, name in enumerate(names):
            store.set(name, f"fp{i}")
        calls.clear()
        assert store.multi_get(names) == [f"fp{i}".encode() for i in range(5)]
        assert calls == ["txn"]  # was a wait and a get per key
        ledger = AttemptLedger(VersionStore(client, job))
        for seq in (3, 5):
            assert ledger.propose(membership, view.epoch, seq, AttemptSpec(seq, REFIT, ("t0",), (), ()))
        known = {kv.key: kv for kv in client.get_prefix(JobKeys(job).store(view.epoch)).kvs}
        calls.clear()
        for seq in (0, 3, 4, 6):
            assert ledger.next_attempt(view.epoch, seq, known) == ledger.next_attempt(view.epoch, seq)
            assert ledger.attempt(view.epoch, seq, known) == ledger.attempt(view.epoch, seq)
        assert store.read(names, known) == store.read(names)
        assert calls.count("txn") == 1 and calls.count("first") == 4 and calls.count("get") == 4  # known: none
    finally:
        membership.close()


def test_retract_withdraws_acks_a_watched_state_does_not_show_yet(etcd_server, make_client, job):
    client = make_client(etcd_server.endpoints)
    membership = Membership(client, job, _record("t0", role="trainer"), MembershipConfig(ttl_s=2)).start()
    acker = Membership(client, job, _record("i0"), MembershipConfig(ttl_s=2, candidate=False)).start()
    store = VersionStore(client, job)
    try:
        view = membership.wait_for_view(lambda v: v.num_ranks == 2, timeout_s=20)
        store.ack(acker, 1, view.epoch, "a1")
        stale = store.snapshot()
        store.ack(acker, 2, view.epoch, "a2")
        assert store.retract(acker, stale, also={2}) == 2
        assert not store.snapshot().acks
    finally:
        acker.close()
        membership.close()


def test_a_member_keeps_its_lease_while_its_client_loop_is_blocked(etcd_server, make_client, job):
    """Keepalives come from the client's LeaseKeeper (a thread and channel of its own):
    a client loop busy for twice the TTL (a burst of events, a slow callback) no longer
    starves them. Sent from that loop, as before, the lease ran out."""

    client = make_client(etcd_server.endpoints)
    config = MembershipConfig(ttl_s=2)
    member = Membership(client, job, _record("i0"), config).start()
    try:
        member.wait_for_view(lambda v: v.num_ranks == 1, timeout_s=20)
        keeper = lease_keeper(client)
        sent = keeper.keepalives_sent

        async def block() -> None:
            time.sleep(2 * config.ttl_s + 0.5)  # holds the loop: nothing else runs on it

        client.run(block(), timeout_s=30)
        assert keeper.keepalives_sent - sent >= 2 * config.ttl_s / config.keepalive_interval - 1
        assert client.lease_ttl(member.lease_id) > 0
        time.sleep(0.5)  # the watch catches up: the member key is still ours
        assert not member.lost.is_set(), member.lost_reason
        assert client.get(member.member_key).lease == member.lease_id
    finally:
        member.close()
    deadline = time.monotonic() + 5
    while keeper.num_leases and time.monotonic() < deadline:  # the release runs on the keeper's loop
        time.sleep(0.01)
    assert keeper.num_leases == 0


def test_batched_acks_are_fenced_member_by_member(etcd_server, make_client, job):
    """ack_many writes many members' acks in one transaction; a member that lost its lease
    is refused (MembershipLost) and the others' acks still land."""
    from elastic_refit.membership.versions import AckRequest

    from elastic_refit.errors import MembershipLost

    client = make_client(etcd_server.endpoints)
    hub = WatchHub(client, *JobKeys(job).control_range, name="control")
    members = [Membership(client, job, _record(f"i{k}"), MembershipConfig(ttl_s=2, candidate=k == 0),
                          watch_hub=hub).start() for k in range(4)]
    store = VersionStore(client, job)
    try:
        view = members[0].wait_for_view(lambda v: v.num_ranks == 4, timeout_s=20)
        epoch_store = EtcdStore(client, job, view.epoch)
        # One index per snapshot for every member sharing the watch.
        snap = members[0].watcher.snapshot()
        assert members[1].index(snap) is members[2].index(snap) and set(members[3].index(snap).members) == {
            "i0", "i1", "i2", "i3"}

        def requests(version: int) -> list[AckRequest]:
            return [AckRequest(m, version, view.epoch, f"d{version}",
                               done=(epoch_store.etcd_key(f"attempt/{version}/done/{m.record.member_id}"), b"ok"))
                    for m in members]

        calls: list[str] = []
        txn = client.txn
        client.txn = lambda *a, **kw: (calls.append("txn"), txn(*a, **kw))[1]  # type: ignore[method-assign]
        assert store.ack_many(requests(1)) == [None] * 4
        assert calls == ["txn"]  # four fenced acks and their done keys: one request
        assert set(store.snapshot().acks[1]) == {"i0", "i1", "i2", "i3"}
        client.revoke_lease(members[2].lease_id)  # i2 is gone, as if fenced
        errors = store.ack_many(requests(2))
        assert isinstance(errors[2], MembershipLost) and [errors[i] for i in (0, 1, 3)] == [None] * 3
        assert set(store.snapshot().acks[2]) == {"i0", "i1", "i3"}
        assert not epoch_store.check(["attempt/2/done/i2"]) and epoch_store.check(["attempt/2/done/i3"])
    finally:
        for m in members:
            m.close()
        hub.close()
