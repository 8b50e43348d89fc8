"""A second run that reuses a job's name with other data is refused at once.

Before issue 34 its ``publish(1)`` and ``publish(2)`` returned the first run's commits
("committed in 0.00s", the old digest): only the newest version's source records were left
to compare against (the coordinator prunes older versions' sources after each commit). The
commit now keeps its sources' data digests.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest
from elastic_refit.membership import EtcdClient, JobKeys, JobStateLost, RunClash
from elastic_refit.membership.run import JobRun

from elastic_refit.cli.job_cmd import reset_job
from elastic_refit.runtime import ElasticRefit, RefitConfig
from elastic_refit.testing.pattern import allocate, fill_pieces

from .test_causes import SOURCE
from .test_rejoin import TTL_S, assert_serving, publish, small_job

pytestmark = pytest.mark.etcd


def test_a_second_run_reusing_the_job_name_with_other_data_is_refused_at_once(etcd_server, job):
    with small_job(etcd_server.endpoint, job) as (trainer, _engines, _params):
        first = {v: trainer.publish(_tensors(v), v) for v in (1, 2, 3)}
    config = RefitConfig(job=job, role="trainer", member_id="t0", layout_rank=0, etcd=(etcd_server.endpoint,),
                         ttl_s=TTL_S, version_timeout_s=30.0)
    with ElasticRefit(config, SOURCE) as again:
        for version in (1, 2, 3):  # 1 and 2: their sources' records were pruned after later commits
            t0 = time.monotonic()
            with pytest.raises(ValueError, match=f"version {version} is already committed, and t0 published other "
                                                 "data for it then") as refused:
                again.publish(_tensors(version, seed=100 + version), version)
            assert time.monotonic() - t0 < 1.0, "refused at once"
            assert "another run reusing the job's name" in str(refused.value)
        # The same data again (a restarted trainer of the same run) still gets its commit back.
        assert again.publish(_tensors(2), 2) == first[2]


def test_a_second_run_with_another_run_id_is_refused_at_start_naming_both_runs(etcd_server, job):
    """Run "a" holds the job's name: a member of run "b" is refused when it starts (before it
    registers, in well under a second), not at its first publish; run "a" goes on. Once
    run "a" has ended and the job was reset, run "b" starts under the name."""
    etcd = etcd_server.endpoint
    with small_job(etcd, job, run_id="a") as (trainer, engines, params):
        publish(trainer, 1)
        assert {m.membership.run_id for m in (trainer, *engines)} == {"a"}
        config = RefitConfig(job=job, role="trainer", member_id="t1", layout_rank=0, etcd=(etcd,), ttl_s=TTL_S,
                             run_id="b")
        t0 = time.monotonic()
        with pytest.raises(RunClash) as refused:
            ElasticRefit(config, SOURCE).start()
        refused_s = time.monotonic() - t0
        message = str(refused.value)
        assert f"job {job!r} is held by run 'a' (started " in message and "this member's run 'b'" in message
        assert "give this run its own job name" in message.lower() and "job reset" in message
        assert refused_s < 1.0, refused_s
        with EtcdClient([etcd]) as client:
            assert client.get(JobKeys(job).member("trainer", "t1")) is None
        publish(trainer, 2)  # run "a" keeps working
        assert_serving(engines, params, 2)
    assert reset_job([etcd], job, confirm=True) > 0
    with small_job(etcd, job, run_id="b") as (trainer, engines, params):
        assert trainer.membership.run_id == "b"
        publish(trainer, 1)
        assert_serving(engines, params, 1)
    print(f"run 'b' refused at start in {refused_s * 1000:.0f} ms")


def test_a_member_that_registers_again_into_another_run_stops(etcd_server, job):
    """The job's run key names another run when i0 registers again (etcd restored from
    another run's state): i0's new registration is refused (``RunClash``) and i0 stops with
    ``JobStateLost`` naming both runs, instead of retrying as if etcd were unreachable."""
    etcd = etcd_server.endpoint
    with small_job(etcd, job, run_id="a") as (trainer, engines, _params):
        publish(trainer, 1)
        i0 = engines[0]
        with EtcdClient([etcd]) as client:
            client.put(JobKeys(job).run, JobRun.new("b", datetime.now(UTC)).encode())
            client.revoke_lease(i0.membership.lease_id)
        t0 = time.monotonic()
        with pytest.raises(JobStateLost, match=r"not the one it joined \(run a instance \w+; job .* is held by "
                                               r"run 'b' .*not by this member's run 'a'"):
            i0.wait_for_version(2, timeout_s=30)
        print(f"i0 stopped {time.monotonic() - t0:.2f} s after its lease was revoked")


def _tensors(version: int, seed: int | None = None):
    tensors = allocate(SOURCE, 0, fill=0)
    fill_pieces(SOURCE, 0, tensors, seed=version if seed is None else seed)
    return tensors
