"""A second run that reuses a job's name with other data is refused at once.

Before issue 34 its ``publish(1)`` and ``publish(2)`` returned the first run's commits
("committed in 0.00s", the old digest): only the newest version's source records were left
to compare against (the coordinator prunes older versions' sources after each commit). The
commit now keeps its sources' data digests.
"""

from __future__ import annotations

import time

import pytest

from elastic_refit.runtime import ElasticRefit, RefitConfig
from elastic_refit.testing.pattern import allocate, fill_pieces

from .test_causes import SOURCE
from .test_rejoin import TTL_S, small_job

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


def _tensors(version: int, seed: int | None = None):
    tensors = allocate(SOURCE, 0, fill=0)
    fill_pieces(SOURCE, 0, tensors, seed=version if seed is None else seed)
    return tensors
