"""An explicit run id (issue 34, "Job identity"): a member of another run than the one that
holds the job's name is refused at start, before it registers; members of one run, and
members with no run id, join. Real etcd; the members run in this process."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
from elastic_refit.membership import JobKeys, MemberRecord, Membership, MembershipConfig, RunClash

pytestmark = pytest.mark.etcd


@contextlib.contextmanager
def members(client, job: str, *run_ids: str | None):
    """One started trainer member per run id (t0, t1, ...), closed at the end."""
    with contextlib.ExitStack() as stack:
        started = []
        for i, run_id in enumerate(run_ids):
            record = MemberRecord("trainer", f"t{i}", "inc1", "h", "d0", "cpu", layout_rank=i)
            m = Membership(client, job, record, MembershipConfig(run_id=run_id)).start()
            stack.callback(m.close)
            started.append(m)
        yield started


def test_members_of_one_explicit_run_and_members_without_one_join_it(etcd_server, make_client, job):
    client = make_client(etcd_server.endpoints)
    with members(client, job, "exp-7", "exp-7", None) as (a, b, c):
        assert a.run_id == b.run_id == c.run_id == "exp-7"
        assert a.run_instance == b.run_instance == c.run_instance and a.run_instance
        assert a.run_started and a.run_started == c.run_started
        stored = json.loads(client.get(JobKeys(job).run).value)
        assert stored == {"run_id": "exp-7", "instance": a.run_instance, "started": a.run_started}
    # No explicit id: the first member creates a random one, and a later one joins it.
    with members(client, job + "-r", None, None) as (d, e):
        assert d.run_id == e.run_id and d.run_id != "exp-7" and d.run_instance == e.run_instance


def test_a_member_of_another_run_is_refused_at_once_and_leaves_nothing(etcd_server, make_client, job):
    client = make_client(etcd_server.endpoints)
    with members(client, job, "a") as (first,):
        leases = set(client.leases())
        record = MemberRecord("trainer", "t9", "inc1", "h", "d0", "cpu", layout_rank=9)
        t0 = time.monotonic()
        with pytest.raises(RunClash) as refused:
            Membership(client, job, record, MembershipConfig(run_id="b")).start()
        refused_s = time.monotonic() - t0
        message = str(refused.value)
        assert f"job {job!r} is held by run 'a' (started {first.run_started})" in message
        assert "this member's run 'b'" in message
        assert f"`elastic-refit job reset --job {job}` once run 'a' has ended" in message
        assert refused_s < 1.0, refused_s
        # Not registered, and its lease was revoked with the refusal.
        members_now = [kv.key for kv in client.get_prefix(JobKeys(job).members_prefix).kvs]
        assert members_now == [JobKeys(job).member("trainer", "t0")]
        assert set(client.leases()) == leases
        assert not first.lost.is_set()
        print(f"run 'b' refused in {refused_s * 1000:.1f} ms")


def test_keys_of_older_versions_hold_only_a_run_id(etcd_server, make_client, job):
    """A job whose run key was written before the instance was kept: its instance is its id,
    an explicit run id of another run is still refused, and the same one joins."""
    client = make_client(etcd_server.endpoints)
    client.put(JobKeys(job).run, json.dumps({"run_id": "old1"}).encode())
    with members(client, job, None, "old1") as (a, b):
        assert a.run_id == b.run_id == "old1" and a.run_instance == b.run_instance == "old1"
        assert a.run_started == ""
    with pytest.raises(RunClash, match="held by run 'old1', not by this member's run 'new'"), \
            members(client, job, "new"):
        pass


def test_membership_config_checks_the_run_id():
    with pytest.raises(ValueError, match=r"run_id must match .*got 'a b'"):
        MembershipConfig(run_id="a b")


def test_a_wiped_etcd_recreates_an_explicit_run_id_under_another_instance(etcd_server, make_client, job):
    """What a member that registers again compares (``runtime.rejoin``): after a wipe, the
    first member of run "a" creates the run key afresh, with run "a"'s id and a new instance."""
    client = make_client(etcd_server.endpoints)
    with members(client, job, "a") as (before,):
        joined = before.run_instance
    etcd_server.wipe()
    with members(make_client(etcd_server.endpoints), job, "a") as (after,):
        assert after.run_id == "a" and after.run_instance != joined
