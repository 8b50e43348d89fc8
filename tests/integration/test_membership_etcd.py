"""Membership against a real etcd: join, leave, crash, freeze, etcd restart, leader loss."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import pytest
from elastic_refit.membership.client import EtcdClient
from elastic_refit.membership.errors import EtcdUnavailable
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.view import MembershipView
from elastic_refit.membership.watch import RangeWatcher

from elastic_refit.testing.etcd import EtcdServer, EtcdServerError
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.etcd

TTL = 2
# A lost member's lease expires about TTL after its last keepalive; a generous bound for
# seeing it gone from the epoch on a loaded CI machine.
EXPIRY_WAIT_S = 5 * TTL
# The longest TTL the agents may take (below their 10 s epoch deadline): tests that tell a
# lease revocation from a lease expiry use it, so the expiry is far away.
LONG_TTL = 9


def epoch_of(client: EtcdClient, job: str) -> MembershipView | None:
    kv = client.get(JobKeys(job).epoch)
    return MembershipView.decode(kv.value) if kv else None


def wait_epoch(client, job, predicate, timeout_s=15.0, what="epoch") -> MembershipView:
    return wait_until(lambda: (v := epoch_of(client, job)) is not None and predicate(v) and v,
                      timeout_s, what, interval=0.005)


class EpochRecorder:
    """Every value the ``epoch`` key takes, with the time it was seen (watch-based)."""

    def __init__(self, client: EtcdClient, job: str):
        keys = JobKeys(job)
        self.values: list[tuple[float, MembershipView]] = []
        self.lock = threading.Lock()
        self.watcher = RangeWatcher(client, keys.epoch, keys.epoch + "\0", name="epochs")
        self.watcher.add_listener(self._on)
        self.watcher.start()

    def _on(self, reset, events, snap) -> None:
        for kv in snap.items.values():
            view = MembershipView.decode(kv.value)
            with self.lock:
                if not self.values or self.values[-1][1].epoch != view.epoch:
                    self.values.append((time.time(), view))

    def epochs(self) -> list[int]:
        with self.lock:
            return [v.epoch for _, v in self.values]


def test_join_then_all_members_in_one_epoch(etcd_server, make_client, agents, job):
    client = make_client(etcd_server.endpoints)
    members = [agents(etcd_server.endpoints, job, f"t{i}") for i in range(2)]
    members.append(agents(etcd_server.endpoints, job, "i0", role="inference"))
    view = wait_epoch(client, job, lambda v: v.num_ranks == 3, what="3 members")
    assert set(view.member_ids) == {"t0", "t1", "i0"}
    assert [m.member_id for m in view.by_role()["inference"]] == ["i0"]
    keys = client.get_prefix(JobKeys(job).members_prefix).kvs
    records = [json.loads(kv.value) for kv in keys]
    assert {r["member_id"] for r in records} == {"t0", "t1", "i0"}
    assert all(kv.lease != 0 for kv in keys), "member keys must live on a lease"
    assert {"incarnation", "host", "domain", "device", "address", "state"} <= set(records[0])
    leader = json.loads(client.get(JobKeys(job).leader).value)
    assert leader["member_id"] in {"t0", "t1", "i0"}
    # Exactly one process believes it leads.
    elected = [m for m in members if m.find("membership.leader.elected")]
    assert len(elected) == 1


def test_clean_leave_revokes_the_lease_at_once(etcd_server, make_client, agents, job):
    client = make_client(etcd_server.endpoints)
    _a, b = (agents(etcd_server.endpoints, job, f"t{i}", ttl=LONG_TTL) for i in range(2))
    before = wait_epoch(client, job, lambda v: v.num_ranks == 2, what="2 members")
    leases_before = set(client.leases())
    t0 = time.monotonic()
    assert b.stop() == 0
    after = wait_epoch(client, job, lambda v: v.member_ids == ("t0",), what="t1 gone")
    elapsed = time.monotonic() - t0
    assert after.epoch == before.epoch + 1
    # An expiry could not come before TTL minus one keepalive interval (6 s).
    assert elapsed < LONG_TTL - LONG_TTL / 3, f"a clean leave must not wait for lease expiry ({elapsed:.2f}s)"
    assert len(set(client.leases())) == len(leases_before) - 1
    assert client.get(JobKeys(job).member("trainer", "t1")) is None
    assert b.find("membership.member.left")


def test_sigkill_member_is_removed_at_once_by_a_confirmed_suspicion(etcd_server, make_client, agents, job):
    client = make_client(etcd_server.endpoints)
    a = agents(etcd_server.endpoints, job, "t0")
    wait_epoch(client, job, lambda v: v.num_ranks == 1, what="t0 leads")
    b = agents(etcd_server.endpoints, job, "t1", candidate=False)
    before = wait_epoch(client, job, lambda v: v.num_ranks == 2, what="2 members")
    lease = client.get(JobKeys(job).member("trainer", "t1")).lease
    b.kill()
    after = wait_epoch(client, job, lambda v: "t1" not in v, timeout_s=EXPIRY_WAIT_S, what="t1 removed")
    assert after.epoch == before.epoch + 1
    # Its ring neighbour saw the connection end without a goodbye; the leader fenced it
    # (member key deleted, lease revoked) instead of waiting for the lease to expire.
    assert a.wait_event(lambda e: e.get("event") == "membership.suspect.confirmed")["suspect"] == "t1"
    assert a.find("membership.member.gone")
    assert client.lease_ttl(lease) == -1


def test_a_restart_ends_its_predecessors_lease_and_takes_over_without_waiting_the_ttl(
        etcd_server, make_client, agents, job):
    ttl = LONG_TTL  # the old lease lives >= 6 s after the kill: only a revocation explains a quicker takeover
    client = make_client(etcd_server.endpoints)
    a = agents(etcd_server.endpoints, job, "t0", ttl=ttl)
    wait_epoch(client, job, lambda v: v.num_ranks == 1, what="t0 leads")
    b = agents(etcd_server.endpoints, job, "t1", ttl=ttl, candidate=False)
    before = wait_epoch(client, job, lambda v: v.num_ranks == 2, what="2 members")
    old_incarnation = before.member("t0").incarnation
    old_lease = client.get(JobKeys(job).member("trainer", "t0")).lease
    assert json.loads(client.get(JobKeys(job).leader).value)["member_id"] == "t0"
    a.kill()  # the leader dies holding the leader key; a new incarnation starts at once
    killed = time.monotonic()
    a.start()
    registered = a.wait_event(lambda e: e.get("event") == "membership.member.registered"
                              and e.get("incarnation") != old_incarnation, timeout_s=30.0)
    # Whichever came first ended the old lease: the new incarnation replacing it, or the
    # survivor fencing the dead leader on its ring evidence (then nothing is left to replace).
    replaced = a.find("membership.member.replaced")
    fenced = b.find("membership.suspect.confirmed", suspect="t0")
    assert (replaced and replaced[0]["previous_lease_id"] == old_lease) or fenced, registered
    after = wait_epoch(client, job, lambda v: "t0" in v and v.member("t0").incarnation != old_incarnation,
                       timeout_s=ttl, what="t0's new incarnation in an epoch")
    assert after.num_ranks == 2 and after.epoch > before.epoch
    assert time.monotonic() - killed < ttl - ttl / 3, "the takeover waited for the old lease to expire"
    assert client.lease_ttl(old_lease) == -1, "the dead incarnation's lease must be gone"


def test_frozen_member_and_leader_are_fenced_after_resume(etcd_server, make_client, agents, job):
    client = make_client(etcd_server.endpoints)
    keys = JobKeys(job)
    stale = agents(etcd_server.endpoints, job, "t0")
    stale.wait_event(lambda e: e.get("event") == "membership.leader.elected")
    other = agents(etcd_server.endpoints, job, "t1")
    wait_epoch(client, job, lambda v: v.num_ranks == 2, what="2 members")
    stale.signal(signal.SIGSTOP)
    try:
        # The frozen leader's lease expires; t1 takes over and publishes without t0.
        taken = wait_epoch(client, job, lambda v: v.member_ids == ("t1",), timeout_s=EXPIRY_WAIT_S,
                           what="epoch without the frozen member")
        other.wait_event(lambda e: e.get("event") == "membership.leader.elected")
        time.sleep(0.5)
    finally:
        stale.signal(signal.SIGCONT)
    stale.signal(signal.SIGUSR1)  # attempt a member write and an epoch write
    member_probe = stale.wait_event(lambda e: e.get("event") == "agent.probe"
                                    and e.get("write") == "member")
    epoch_probe = stale.wait_event(lambda e: e.get("event") == "agent.probe"
                                   and e.get("write") == "epoch")
    assert member_probe["succeeded"] is False
    assert epoch_probe["succeeded"] is False
    assert stale.find("membership.member.lost"), "the stale member must know it was lost"
    # etcd holds none of the stale writes.
    assert all(kv.value != b"stale-write" for kv in client.get_prefix(keys.prefix).kvs)
    current = epoch_of(client, job)
    assert current is not None and current.epoch == taken.epoch
    assert current.member_ids == ("t1",)
    leader = json.loads(client.get(keys.leader).value)
    assert leader["member_id"] == "t1"
    # A stopped process keeps its sockets open: no evidence of death, so nobody fenced it
    # early; the lease TTL was its bound.
    assert not other.find("membership.suspect.reported") and not other.find("membership.suspect.confirmed")


def test_watches_resume_after_etcd_restart(etcd_server, make_client, agents, job):
    client = make_client(etcd_server.endpoints)
    a = agents(etcd_server.endpoints, job, "t0")
    b = agents(etcd_server.endpoints, job, "t1")
    before = wait_epoch(client, job, lambda v: v.num_ranks == 2, what="2 members")
    etcd_server.kill(signal.SIGKILL)
    time.sleep(1.0)
    etcd_server.restart()
    # Leases survive a restart (etcd renews them on recovery); a newcomer joins.
    c = agents(etcd_server.endpoints, job, "t2")
    after = wait_epoch(client, job, lambda v: v.num_ranks == 3, timeout_s=20,
                       what="newcomer after restart")
    assert after.epoch > before.epoch
    for agent in (a, b):
        agent.wait_event(lambda e: e.get("event") == "membership.watch.resumed")
        agent.wait_event(lambda e: e.get("event") == "membership.epoch.changed"
                         and e.get("epoch") == after.epoch)
    assert not a.find("membership.member.lost") and not b.find("membership.member.lost")
    c.kill()
    gone = wait_epoch(client, job, lambda v: "t2" not in v, timeout_s=EXPIRY_WAIT_S, what="t2 expired")
    a.wait_event(lambda e: e.get("event") == "membership.epoch.changed"
                 and e.get("epoch") == gone.epoch)


def test_watch_relists_when_its_revision_was_compacted(etcd_server, make_client):
    client = make_client(etcd_server.endpoints)
    client.put("/w/a", b"1")
    start_rev = client.revision()
    client.put("/w/b", b"2")
    client.delete("/w/a")
    client.put("/w/c", b"3")
    client.compact(client.revision())
    watcher = RangeWatcher(client, "/w/", "/w0", name="compacted", start_revision=start_rev)
    watcher.start()
    snap = watcher.wait_for(lambda s: set(s.items) == {"/w/b", "/w/c"}, timeout_s=5)
    assert watcher.relists >= 1
    client.put("/w/d", b"4")
    snap = watcher.wait_for(lambda s: "/w/d" in s.items, timeout_s=5)
    assert snap.items["/w/d"].value == b"4"
    watcher.stop()


def test_watch_notices_a_stalled_stream(etcd_cluster, make_client):
    # Freeze the node the watcher talks to: no progress answer -> reconnect elsewhere.
    client = make_client(etcd_cluster.endpoints, request_timeout_s=1.0)
    watcher = RangeWatcher(client, "/s/", "/s0", name="stall", progress_interval_s=0.3,
                           stall_timeout_s=1.0)
    watcher.start()
    frozen = etcd_cluster.endpoints.index(client.endpoint)
    pid = etcd_cluster.nodes[frozen].pid
    import os

    os.kill(pid, signal.SIGSTOP)
    try:
        other = make_client([e for i, e in enumerate(etcd_cluster.endpoints) if i != frozen])
        wait_until(lambda: watcher.stalls >= 1, 10, "stall detection")
        other.put("/s/x", b"after-stall")
        snap = watcher.wait_for(lambda s: "/s/x" in s.items, timeout_s=10)
        assert snap.items["/s/x"].value == b"after-stall"
    finally:
        os.kill(pid, signal.SIGCONT)
        watcher.stop()


@contextlib.contextmanager
def _stopped(pid: int):
    """``pid`` (an etcd node this test started) SIGSTOPped for the block."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_single_endpoints_first_stall_keeps_the_channel_a_second_replaces_it(etcd_server, make_client):
    # One endpoint: a stall is mostly a loaded server, and closing the channel would fail
    # every request in flight on it; the stream alone is re-opened. A second stall in a row
    # (no answer since) replaces the channel, as a dead connection needs.
    client = make_client(etcd_server.endpoints, request_timeout_s=1.0)
    watcher = RangeWatcher(client, "/s/", "/s0", name="stall", progress_interval_s=0.2, stall_timeout_s=0.6)
    watcher.start()
    client.put("/s/a", b"1")
    watcher.wait_for(lambda s: "/s/a" in s.items, timeout_s=5)
    channel = client._conn
    pid = etcd_server.pids[0]
    with _stopped(pid):
        wait_until(lambda: watcher.stalls >= 1, 5, "first stall")
    client.put("/s/b", b"2")
    watcher.wait_for(lambda s: "/s/b" in s.items, timeout_s=10)
    assert watcher.stalls == 1 and client._conn is channel, (watcher.stalls, client._conn, channel)

    with _stopped(pid):
        wait_until(lambda: watcher.stalls >= 3, 10, "two stalls in a row")
    client.put("/s/c", b"3")
    snap = watcher.wait_for(lambda s: "/s/c" in s.items, timeout_s=10)
    assert snap.items["/s/c"].value == b"3"
    assert client._conn is not channel
    watcher.stop()


def test_leader_death_in_3_node_cluster_takeover_and_increasing_epochs(
        etcd_cluster, make_client, agents, job):
    eps = etcd_cluster.endpoints
    client = make_client(eps)
    recorder = EpochRecorder(client, job)
    first = agents(eps, job, "t0")
    first.wait_event(lambda e: e.get("event") == "membership.leader.elected")
    others = [agents(eps, job, f"t{i}") for i in (1, 2, 3)]
    wait_epoch(client, job, lambda v: v.num_ranks == 4, what="4 members")
    old_token = client.get(JobKeys(job).leader).create_revision
    first.kill()  # the membership leader dies
    view = wait_epoch(client, job, lambda v: "t0" not in v, timeout_s=EXPIRY_WAIT_S, what="takeover")
    new_leader = client.get(JobKeys(job).leader)
    assert new_leader.create_revision > old_token
    assert json.loads(new_leader.value)["member_id"] in {"t1", "t2", "t3"}
    # Now lose the raft leader of etcd itself; membership keeps working.
    etcd_cluster.stop_node(etcd_cluster.leader_index(), signal.SIGKILL)
    victim = next(a for a in others if json.loads(new_leader.value)["member_id"] != a.member_id)
    victim.kill()
    try:
        view = wait_epoch(client, job, lambda v: victim.member_id not in v, timeout_s=EXPIRY_WAIT_S + 8,
                          what="epoch after raft leader loss")
    except AssertionError:
        for a in others:
            for e in a.events[-25:]:
                print(a.member_id, json.dumps(e)[:300])
        raise
    assert view.num_ranks == 2
    wait_until(lambda: recorder.epochs() and recorder.epochs()[-1] == view.epoch, 5,
               f"recorder to see epoch {view.epoch} (saw {recorder.epochs()}; "
               f"watch: rev={recorder.watcher.revision} progress={recorder.watcher.progress_responses}"
               f" reconnects={recorder.watcher.reconnects} stalls={recorder.watcher.stalls}, "
               f"endpoint={client.endpoint}, etcd={client.get(JobKeys(job).epoch)})")
    seen = recorder.epochs()
    assert seen == sorted(set(seen)), f"epochs must strictly increase, saw {seen}"
    assert seen == list(range(seen[0], seen[-1] + 1)), f"epochs skip or repeat: {seen}"
    recorder.watcher.stop()


def test_no_leases_keys_or_processes_left_after_clean_exit(etcd_server, make_client, agents, job):
    client = make_client(etcd_server.endpoints)
    procs = [agents(etcd_server.endpoints, job, f"t{i}") for i in range(3)]
    wait_epoch(client, job, lambda v: v.num_ranks == 3, what="3 members")
    assert len(client.leases()) == 3
    for p in procs:
        assert p.stop() == 0
    assert client.leases() == []
    assert client.get_prefix(JobKeys(job).members_prefix).kvs == ()
    assert client.get(JobKeys(job).leader) is None
    for p in procs:
        assert p.proc.poll() is not None


def test_unreachable_etcd_raises_a_typed_error_naming_the_endpoint():
    from elastic_refit.testing.etcd import free_ports

    port = free_ports(1)[0]
    client = EtcdClient([f"127.0.0.1:{port}"], retry_deadline_s=0.5, request_timeout_s=0.3)
    try:
        with pytest.raises(EtcdUnavailable, match=f"127.0.0.1:{port}"):
            client.get("/x")
    finally:
        client.close()


def test_missing_etcd_binary_gives_a_clear_message(monkeypatch):
    monkeypatch.setenv("ETCD_BIN", "/nonexistent/etcd")
    with pytest.raises(EtcdServerError, match="apt-get install -y etcd-server"):
        EtcdServer()


def test_a_resumed_watch_finds_the_store_went_back_after_its_revision_caught_up(etcd_server, make_client):
    """etcd restored from an older copy, then written past every revision this process saw
    before the stream resumed: no answer is below a revision seen (the revision check sees
    nothing), but a key the watcher holds is held by etcd modified before the write the
    watcher saw. The resumed stream's check of its newest keys finds it (JobStateLost)."""
    from elastic_refit.membership import JobStateLost

    client = make_client(etcd_server.endpoints, monotonic=True)
    other = make_client(etcd_server.endpoints)
    other.put("/r/epoch", b"1")
    watcher = RangeWatcher(client, "/r/", "/r0", name="resumed")
    watcher.start()
    backup = etcd_server.copy_data()
    rev = other.put("/r/epoch", b"2")  # written after the copy: the watcher holds it at rev
    watcher.wait_for(lambda s: s.items["/r/epoch"].value == b"2", timeout_s=5)
    watcher.stop()
    etcd_server.restore_data(backup)
    for i in range(2 * rev):  # the restored store's revision passes every one this process saw
        other.put(f"/other/{i}", b"x")
    assert other.revision() > max(rev, client.revisions.highest)
    held = watcher.snapshot().items["/r/epoch"]
    assert held.mod_revision == rev
    with pytest.raises(JobStateLost, match=r"holds /r/epoch at mod revision \d+, where this process saw it written at "
                                           rf"revision {rev}"):
        client.run(watcher._verify_resumed())
    assert client.revisions.went_back is not None  # latched for every later guarded call
