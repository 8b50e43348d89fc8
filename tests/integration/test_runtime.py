"""ElasticRefit end to end: real etcd, real processes, real gloo communicators.

Every committed version is checked bit-exactly on every live inference rank; a fault
never hangs a member past the test's deadline."""

from __future__ import annotations

import json
import signal
import time

import pytest
from elastic_refit.membership.client import EtcdClient
from elastic_refit.membership.keys import JobKeys

from elastic_refit.testing.job import MemberSpec

from .runtime_job import KillSelf, LocalJob, RaiseOnce

pytestmark = pytest.mark.etcd

# Trainers 0 and 1 are data-parallel replicas; inference ranks [2, 3] and [4, 5] are two
# data-parallel replicas of a 2-way tensor-parallel engine. Tests start with 2 and 3; a
# member joining at 5 (or a restarted 3 next to a live 5) finds its shard on a peer.
SPEC = json.dumps({
    "domains": [0, 0, 1, 1, 2, 2],
    "tensors": [
        {"name": "w", "shape": [96, 64], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["R"]},
         "destination": {"mesh": [[2, 3], [4, 5]], "placements": ["R", "S(0)"]}},
        {"name": "experts", "shape": [4, 32, 16], "dtype": "float32",
         "source": {"mesh": [[0], [1]], "placements": ["R", "S(0)"]},
         "destination": {"mesh": [[2, 3], [4, 5]], "placements": ["R", "S(1)"]}},
        {"name": "norm", "shape": [64], "dtype": "float32",
         "source": {"mesh": [0, 1], "placements": ["R"]},
         "destination": {"mesh": [[2, 3], [4, 5]], "placements": ["R", "R"]}},
    ],
})
VERSIONS = (1, 2, 3)


def member(etcd: str, role: str, member_id: str, layout_rank: int, **kw) -> MemberSpec:
    kw.setdefault("versions", VERSIONS)
    return MemberSpec("job", role, member_id, layout_rank, (etcd,), f"d{0 if role == 'trainer' else 1}",
                      spec_json=SPEC, **kw)


@pytest.fixture
def job():
    j = LocalJob()
    try:
        yield j
    finally:
        j.stop()


def assert_all_verified(report: dict, last_version: int = VERSIONS[-1]) -> None:
    assert "error" not in report, report.get("error")
    assert report["problems"] == []
    assert all(c["verified"] for c in report["committed"]), report["committed"]
    assert report["committed"][-1]["version"] == last_version


def committed_versions(etcd: str) -> dict[int, dict]:
    keys = JobKeys("job")
    with EtcdClient([etcd]) as client:
        out = {}
        for kv in client.get_prefix(keys.versions_prefix).kvs:
            if kv.key.endswith("/committed"):
                data = json.loads(kv.value)
                out[data["version"]] = data
        return out


def wait_for_commit(etcd: str, version: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while version not in committed_versions(etcd):
        assert time.monotonic() < deadline, f"version {version} never committed"
        time.sleep(0.2)


def test_versions_commit_bit_exact(etcd_server, job):
    etcd = etcd_server.endpoint
    for m in (member(etcd, "trainer", "t0", 0), member(etcd, "trainer", "t1", 1),
              member(etcd, "inference", "i0", 2), member(etcd, "inference", "i1", 3)):
        job.start(m)
    reports = job.collect(["t0", "t1", "i0", "i1"], timeout_s=90)
    for m in ("i0", "i1"):
        assert_all_verified(reports[m])
    for m in ("t0", "t1"):
        assert [c["version"] for c in reports[m]["committed"]] == list(VERSIONS)
    assert sorted(committed_versions(etcd)) == list(VERSIONS)


def test_an_attempt_failing_on_one_rank_before_it_plans_fails_fast_everywhere(etcd_server, job):
    """A rank whose attempt fails before it published its plan (a planning bug, bad input)
    marks the agreement failed: its peers retry at once instead of waiting the epoch deadline
    (10 s) for its fingerprint."""
    etcd = etcd_server.endpoint
    for m in (member(etcd, "trainer", "t0", 0), member(etcd, "trainer", "t1", 1),
              member(etcd, "inference", "i0", 2)):
        job.start(m)
    job.start(member(etcd, "inference", "i1", 3), fail_at=RaiseOnce("i1", version=2))
    reports = job.collect(["t0", "t1", "i0", "i1"], timeout_s=90)
    for m in ("i0", "i1"):
        assert_all_verified(reports[m])
    assert reports["i1"]["stats"]["failed_attempts"] >= 1
    version_2 = next(c for c in reports["t0"]["committed"] if c["version"] == 2)
    assert version_2["seconds"] < 5.0, f"version 2 took {version_2['seconds']:.1f} s: peers waited for the plan"


def test_inference_rank_killed_mid_transfer(etcd_server, job):
    etcd = etcd_server.endpoint
    for m in (member(etcd, "trainer", "t0", 0), member(etcd, "trainer", "t1", 1),
              member(etcd, "inference", "i0", 2)):
        job.start(m)
    job.start(member(etcd, "inference", "i1", 3), fail_at=KillSelf("i1", version=2))
    start = time.monotonic()
    reports = job.collect(["t0", "t1", "i0"], timeout_s=120)
    assert job.procs["i1"].exitcode == -signal.SIGKILL
    assert_all_verified(reports["i0"])
    # the version in flight committed on the survivors, once
    committed = committed_versions(etcd)
    assert sorted(committed) == list(VERSIONS)
    assert committed[2]["epoch"] > committed[1]["epoch"]
    assert time.monotonic() - start < 120


def test_trainer_rank_killed_mid_transfer(etcd_server, job):
    etcd = etcd_server.endpoint
    job.start(member(etcd, "trainer", "t0", 0))
    job.start(member(etcd, "trainer", "t1", 1), fail_at=KillSelf("t1", version=2))
    for m in (member(etcd, "inference", "i0", 2), member(etcd, "inference", "i1", 3)):
        job.start(m)
    reports = job.collect(["t0", "i0", "i1"], timeout_s=120)
    assert job.procs["t1"].exitcode == -signal.SIGKILL
    for m in ("i0", "i1"):
        assert_all_verified(reports[m])
    assert [c["version"] for c in reports["t0"]["committed"]] == list(VERSIONS)


def test_rank_joining_mid_run_catches_up(etcd_server, job):
    etcd = etcd_server.endpoint
    for m in (member(etcd, "trainer", "t0", 0, pause_s=1.5), member(etcd, "trainer", "t1", 1, pause_s=1.5),
              member(etcd, "inference", "i0", 2), member(etcd, "inference", "i1", 3)):
        job.start(m)
    wait_for_commit(etcd, 1)
    job.start(member(etcd, "inference", "i2", 5))
    reports = job.collect(["t0", "t1", "i0", "i1", "i2"], timeout_s=120)
    for m in ("i0", "i1", "i2"):
        assert_all_verified(reports[m])
    assert reports["i2"]["committed"][0]["version"] >= 1


def test_restarted_rank_catches_up_from_peers(etcd_server, job):
    etcd = etcd_server.endpoint
    for m in (member(etcd, "trainer", "t0", 0, pause_s=2.0), member(etcd, "trainer", "t1", 1, pause_s=2.0),
              member(etcd, "inference", "i0", 2), member(etcd, "inference", "i2", 5)):
        job.start(m)
    job.start(member(etcd, "inference", "i1", 3, incarnation="first"))
    wait_for_commit(etcd, 1)
    job.signal("i1", signal.SIGKILL)
    job.procs["i1"].join(5)
    job.start(member(etcd, "inference", "i1", 3, incarnation="second"))
    reports = job.collect(["t0", "t1", "i0", "i1", "i2"], timeout_s=120)
    for m in ("i0", "i1", "i2"):
        assert_all_verified(reports[m])


def test_stale_rank_is_fenced(etcd_server, job):
    etcd = etcd_server.endpoint
    for m in (member(etcd, "trainer", "t0", 0, pause_s=1.0), member(etcd, "trainer", "t1", 1, pause_s=1.0),
              member(etcd, "inference", "i0", 2), member(etcd, "inference", "i1", 3)):
        job.start(m)
    wait_for_commit(etcd, 1)
    job.signal("i1", signal.SIGSTOP)
    time.sleep(4.0)  # twice the lease TTL: i1 is dropped from the epoch
    job.signal("i1", signal.SIGCONT)
    reports = job.collect(["t0", "t1", "i0", "i1"], timeout_s=120)
    assert_all_verified(reports["i0"])
    stale = reports["i1"]
    assert stale.get("error_type") == "MembershipLost", stale
    committed = committed_versions(etcd)
    assert sorted(committed) == list(VERSIONS)


def test_staged_mode_swaps_committed_versions(etcd_server, job):
    # Staged inference receives into spare buffers and swaps on commit; with a trainer
    # killed mid-transfer the served weights are never torn.
    etcd = etcd_server.endpoint
    job.start(member(etcd, "trainer", "t0", 0))
    job.start(member(etcd, "trainer", "t1", 1), fail_at=KillSelf("t1", version=2))
    for m in (member(etcd, "inference", "i0", 2, mode="staged"), member(etcd, "inference", "i1", 3, mode="staged")):
        job.start(m)
    reports = job.collect(["t0", "i0", "i1"], timeout_s=120)
    for m in ("i0", "i1"):
        assert_all_verified(reports[m])
    assert sorted(committed_versions(etcd)) == list(VERSIONS)
