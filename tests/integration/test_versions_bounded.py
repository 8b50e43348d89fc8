"""Bounded version state on a real etcd: after each commit the coordinator prunes (fenced)
what no one needs any more, so the keys under ``versions/`` stay O(ranks), not O(steps)."""

from __future__ import annotations

import json

import pytest
from elastic_refit.membership import EtcdClient, Membership, MembershipConfig
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.versions import HISTORY_VERSIONS, VersionStore
from elastic_refit.membership.view import MemberRecord

pytestmark = pytest.mark.etcd

TRAINERS = ("t0", "t1")
INFERENCE = ("i0", "i1", "i2")


@pytest.fixture
def coordinator(etcd_server, job):
    """The only member of ``job``: leader, and so coordinator, of epoch 1."""
    client = EtcdClient([etcd_server.endpoint])
    record = MemberRecord("trainer", "t0", "a", "h", "d0", "cpu", layout_rank=0)
    membership = Membership(client, job, record, MembershipConfig(ttl_s=2)).start()
    try:
        view = membership.wait_for_view(timeout_s=10)
        yield client, membership, view.epoch
    finally:
        membership.close()
        client.close()


def _publish_and_commit(client: EtcdClient, store: VersionStore, membership, epoch: int, version: int) -> None:
    """Every trainer's source and every inference rank's ack of ``version``, then its commit
    (members' keys written directly: one process plays them all)."""
    keys = store.keys
    for t in TRAINERS:
        client.put(keys.source(version, t), json.dumps({"incarnation": "a", "digest": f"d{version}"}).encode())
    for i in INFERENCE:
        client.put(keys.ack(version, i), json.dumps({"incarnation": "a", "epoch": epoch,
                                                     "digest": f"d{version}"}).encode())
    assert store.commit(membership, version, epoch, f"c{version}")


def test_each_commit_prunes_older_versions_so_keys_stay_bounded(coordinator, job):
    client, membership, epoch = coordinator
    store = VersionStore(client, job)
    prefix = JobKeys(job).versions_prefix
    counts = []
    for version in range(1, 31):
        _publish_and_commit(client, store, membership, epoch, version)
        store.prune(membership, epoch, store.snapshot(), version)
        counts.append(client.count_prefix(prefix))
    state = store.snapshot()
    # the latest version whole (catch-up serves it from its holders) ...
    assert set(state.sources[30]) == set(TRAINERS) and set(state.acks[30]) == set(INFERENCE)
    # ... and only the committed records of the versions before it, for HISTORY_VERSIONS
    assert sorted(state.committed) == list(range(30 - HISTORY_VERSIONS, 31))
    assert set(state.sources) == {30} and set(state.acks) == {30}
    bound = len(TRAINERS) + len(INFERENCE) + 1 + HISTORY_VERSIONS
    assert max(counts) <= bound and counts[-1] == bound, counts


def test_a_stale_coordinator_prunes_nothing(coordinator, job):
    client, membership, epoch = coordinator
    store = VersionStore(client, job)
    for version in (1, 2):
        _publish_and_commit(client, store, membership, epoch, version)
    before = client.count_prefix(JobKeys(job).versions_prefix)
    # epoch + 1 is not the current epoch: the fenced delete is refused
    assert store.prune(membership, epoch + 1, store.snapshot(), 2) == 0
    assert client.count_prefix(JobKeys(job).versions_prefix) == before
    assert store.prune(membership, epoch, store.snapshot(), 2) == 1
    assert client.count_prefix(JobKeys(job).versions_prefix) == before - len(TRAINERS) - len(INFERENCE)


def test_prune_refuses_a_negative_history(coordinator, job):
    client, membership, epoch = coordinator
    with pytest.raises(ValueError, match="history must be an integer >= 0, got -1"):
        VersionStore(client, job).prune(membership, epoch, VersionStore(client, job).snapshot(), 1, history=-1)


def test_pruned_attempts_are_skipped_and_their_participants_keys_deleted(coordinator, job):
    from elastic_refit.membership.attempts import REFIT, AttemptLedger, AttemptSpec
    from elastic_refit.membership.keys import AttemptKeys
    from elastic_refit.membership.store import EtcdStore

    def spec(version: int) -> AttemptSpec:
        return AttemptSpec(version, REFIT, ("t0",), (), ())

    client, membership, epoch = coordinator
    store = AttemptLedger(VersionStore(client, job))
    rendezvous = EtcdStore(client, job, epoch, namespace="comm-gloo")
    for seq in range(6):
        assert store.propose(membership, epoch, seq, spec(seq))
        rendezvous.set(AttemptKeys(seq).done("t0"), "ok")
    for seq in range(4):
        store.prune(epoch, seq, rendezvous)
    # a member at seq 1 (it took no part in 1..3) goes on with attempt 4
    assert store.next_attempt(epoch, 1) == (4, spec(4))
    assert store.next_attempt(epoch, 5) == (5, spec(5)) and store.next_attempt(epoch, 6) is None
    assert store.attempt(epoch, 3) is None and store.attempt(epoch, 4) == spec(4)
    assert not rendezvous.check([AttemptKeys(3).done("t0")]) and rendezvous.check([AttemptKeys(4).done("t0")])
    # seq 10 sorts after seq 9 (zero-padded keys)
    for seq in (9, 10):
        store.propose(membership, epoch, seq, spec(seq))
    assert store.next_attempt(epoch, 6) == (9, spec(9))
