"""Suspicion, refutation and fencing against a real etcd (membership/liveness.py).

A refuted suspicion changes nothing; an unrefuted one fences the suspect (member key and
lease gone) and the epoch moves on without waiting for the TTL; a suspected leader is
fenced by the reporter, which frees the leader key; a SIGKILLed member is confirmed by its
ring neighbour long before its lease could expire. Members run in this process (cheap),
except the one that is killed. TTLs are long where a test tells a fencing from an expiry.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
from elastic_refit.membership.client import Compare, Put
from elastic_refit.membership.config import MembershipConfig
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.service import Membership
from elastic_refit.membership.view import MemberRecord

from tests.integration.test_membership_etcd import LONG_TTL, epoch_of, wait_epoch

pytestmark = pytest.mark.etcd

# An expiry of a LONG_TTL lease cannot come before TTL minus one keepalive interval: a
# member gone sooner was fenced.
BEFORE_EXPIRY_S = LONG_TTL - LONG_TTL / 3


def record(member_id: str, role: str = "inference") -> MemberRecord:
    # The agents' host: a loopback probe is only reachable from the same host.
    return MemberRecord(role, member_id, f"{member_id}-{time.monotonic_ns()}", socket.gethostname(), "d0", "cpu")


@pytest.fixture
def members(make_client):
    started: list[Membership] = []

    def start(endpoints, job, member_id, *, role="inference", **config) -> Membership:
        m = Membership(make_client(endpoints), job, record(member_id, role),
                       MembershipConfig(**{"ttl_s": LONG_TTL, **config})).start()
        started.append(m)
        return m

    yield start
    for m in started:
        m.close()


def register_mute(client, job: str, member_id: str, *, leader: bool = False) -> int:
    """A member key on a lease of its own, with no agent behind it: it cannot refute (a
    live process whose agent is wedged would look the same to etcd). ``leader``: it holds
    the leader key too. Returns the lease."""
    keys = JobKeys(job)
    lease, _ = client.grant_lease(LONG_TTL)
    ops = [Put(keys.member("inference", member_id), record(member_id).encode(), lease)]
    if leader:
        ops.append(Put(keys.leader, json.dumps({"member_id": member_id, "incarnation": "x"}).encode(), lease))
    assert client.txn([Compare(keys.leader, "create", "==", 0)] if leader else [], ops).succeeded
    return lease


def test_a_refuted_suspicion_leaves_the_member_unchanged(etcd_server, make_client, members, job):
    client = make_client(etcd_server.endpoints)
    keys = JobKeys(job)
    a = members(etcd_server.endpoints, job, "i0")
    # No liveness listener: the reporter cannot check its evidence and reports it as is.
    b = members(etcd_server.endpoints, job, "i1", liveness_host=None)
    before = wait_epoch(client, job, lambda v: v.num_ranks == 2, what="2 members")
    lease = client.get(keys.member("inference", "i1")).lease
    assert a.client.run(a.asuspect("i1", "closed", "test: a false suspicion"), timeout_s=10)
    # b refutes from its membership loop: the suspicion vanishes and nothing else changes.
    time.sleep(3 * b.config.refute_window_s)
    assert client.get(keys.suspect("i1")) is None
    assert b.suspicions_refuted == 1 and not b.lost.is_set()
    assert a.suspicions_confirmed == b.suspicions_confirmed == 0
    # With a listener, the evidence is checked first: a live member is not even suspected.
    c = members(etcd_server.endpoints, job, "i2")
    wait_epoch(client, job, lambda v: v.num_ranks == 3, what="3 members")
    assert not a.client.run(a.asuspect("i2", "closed", "test: a live member"), timeout_s=10)
    assert c.suspicions_refuted == 0 and client.get(keys.suspect("i2")) is None
    kv = client.get(keys.member("inference", "i1"))
    assert kv.lease == lease and MemberRecord.decode(kv.value).incarnation == b.record.incarnation
    after = epoch_of(client, job)
    assert after.member("i1").incarnation == before.member("i1").incarnation
    assert after.epoch == before.epoch + 1  # only i2's arrival


def test_an_unrefuted_suspicion_fences_the_suspect_without_waiting_for_its_lease(
        etcd_server, make_client, members, job):
    client = make_client(etcd_server.endpoints)
    keys = JobKeys(job)
    leader = members(etcd_server.endpoints, job, "i0")
    wait_epoch(client, job, lambda v: v.num_ranks == 1, what="i0 leads")
    lease = register_mute(client, job, "i1")
    before = wait_epoch(client, job, lambda v: v.num_ranks == 2, what="the mute member in an epoch")
    t0 = time.monotonic()
    assert leader.client.run(leader.asuspect("i1", "refused", "test"), timeout_s=10)
    after = wait_epoch(client, job, lambda v: "i1" not in v, timeout_s=LONG_TTL, what="i1 fenced")
    assert time.monotonic() - t0 < BEFORE_EXPIRY_S, "the suspect's lease expired: nobody fenced it"
    assert after.epoch == before.epoch + 1
    assert client.lease_ttl(lease) == -1, "the fenced suspect's lease must be revoked"
    assert client.get(keys.member("inference", "i1")) is None and client.get(keys.suspect("i1")) is None
    assert leader.suspicions_confirmed == 1


def test_a_suspected_leader_is_fenced_by_the_reporter_and_the_leader_key_freed(
        etcd_server, make_client, members, job):
    client = make_client(etcd_server.endpoints)
    keys = JobKeys(job)
    lease = register_mute(client, job, "i9", leader=True)  # leads, but publishes nothing
    reporter = members(etcd_server.endpoints, job, "i0")
    t0 = time.monotonic()
    assert reporter.client.run(reporter.asuspect("i9", "closed", "test"), timeout_s=10)
    view = wait_epoch(client, job, lambda v: v.member_ids == ("i0",), timeout_s=LONG_TTL,
                      what="the reporter leads without the fenced leader")
    assert time.monotonic() - t0 < BEFORE_EXPIRY_S, "the leader key waited for the lease to expire"
    assert view.epoch == 1 and client.lease_ttl(lease) == -1
    assert json.loads(client.get(keys.leader).value)["member_id"] == "i0"
    assert reporter.suspicions_confirmed == 1


def test_a_killed_member_is_confirmed_by_its_ring_neighbour_well_under_the_ttl(
        etcd_server, make_client, members, agents, job):
    client = make_client(etcd_server.endpoints)
    members(etcd_server.endpoints, job, "t0", role="trainer")
    wait_epoch(client, job, lambda v: v.num_ranks == 1, what="t0 leads")
    victim = agents(etcd_server.endpoints, job, "t1", ttl=LONG_TTL, candidate=False)
    before = wait_epoch(client, job, lambda v: v.num_ranks == 2, what="2 members")
    assert before.member("t1").probe, "the agent's record must name its liveness listener"
    lease = client.get(JobKeys(job).member("trainer", "t1")).lease
    t0 = time.monotonic()
    victim.kill()  # idle: no transfer touches it, only the ring can tell
    after = wait_epoch(client, job, lambda v: "t1" not in v, timeout_s=LONG_TTL, what="t1 removed")
    assert time.monotonic() - t0 < BEFORE_EXPIRY_S, "removed by lease expiry, not by a confirmed suspicion"
    assert after.epoch == before.epoch + 1 and client.lease_ttl(lease) == -1
