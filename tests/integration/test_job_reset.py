"""`elastic-refit job reset`: a finished job's name can start afresh; never under a live job."""

from __future__ import annotations

import pytest

from elastic_refit.cli import main
from elastic_refit.runtime import ElasticRefit, RefitConfig

from .test_causes import SOURCE
from .test_job_identity import _tensors
from .test_rejoin import TTL_S, small_job

pytestmark = pytest.mark.etcd


def test_reset_is_refused_while_members_run_and_without_yes_then_clears_the_job(etcd_server, job, capsys):
    etcd = etcd_server.endpoint
    with small_job(etcd, job) as (trainer, _engines, _params):
        trainer.publish(_tensors(1), 1)
        assert main(["job", "reset", "--etcd", etcd, "--job", job, "--yes"]) == 2
        assert "registered member(s)" in capsys.readouterr().err
    assert main(["job", "reset", "--etcd", etcd, "--job", job]) == 2
    assert "pass --yes" in capsys.readouterr().err
    assert main(["job", "reset", "--etcd", etcd, "--job", job, "--yes"]) == 0
    assert f"job {job!r} reset" in capsys.readouterr().out
    assert main(["job", "reset", "--etcd", etcd, "--job", job, "--yes"]) == 2  # nothing left
    # A new run under the name: version 1 with other data commits (it was refused before the reset).
    with small_job(etcd, job) as (trainer, engines, _params):
        assert trainer.publish(_tensors(1, seed=101), 1).version == 1
        assert engines[0].wait_for_version(1) == 1


def test_a_trainer_alone_is_not_a_member_after_it_left(etcd_server, job):
    config = RefitConfig(job=job, role="trainer", member_id="t0", layout_rank=0, etcd=(etcd_server.endpoint,),
                         ttl_s=TTL_S)
    with ElasticRefit(config, SOURCE):
        pass
    assert main(["job", "reset", "--etcd", etcd_server.endpoint, "--job", job, "--yes"]) == 0
