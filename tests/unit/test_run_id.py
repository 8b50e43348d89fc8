"""The explicit run id (issue 34, "Job identity"): its configuration, the run key's content,
and the decisions made on it (pure; the etcd side is tests/integration/test_run_id.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from elastic_refit.membership import JobStateLost
from elastic_refit.membership.run import JobRun, run_clash

from elastic_refit.runtime.config import RefitConfig
from elastic_refit.runtime.rejoin import _check_same_run

IDENTITY = {"job": "job", "role": "inference", "member_id": "i0", "layout_rank": 1, "etcd": "127.0.0.1:2379"}
ENV = {"ELASTIC_REFIT_JOB": "j", "ELASTIC_REFIT_ROLE": "trainer", "ELASTIC_REFIT_MEMBER_ID": "t0",
       "ELASTIC_REFIT_LAYOUT_RANK": "0", "ELASTIC_REFIT_ETCD": "a:1"}


def test_run_id_is_optional_and_reaches_the_membership_config():
    assert RefitConfig(**IDENTITY).run_id is None
    assert RefitConfig(**IDENTITY).membership_config().run_id is None
    c = RefitConfig(**IDENTITY, run_id="exp-42.b", ttl_s=3)
    assert c.run_id == "exp-42.b"
    assert c.membership_config().run_id == "exp-42.b" and c.membership_config().ttl_s == 3
    assert "run_id" in RefitConfig.setting_names()


@pytest.mark.parametrize("bad", ["", "a b", "-lead", "x/y", 7])
def test_a_bad_run_id_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match=rf"run_id must match .*got {bad!r}"):
        RefitConfig(**IDENTITY, run_id=bad)


def test_run_id_from_the_environment_strictly_and_never_from_a_launcher():
    assert RefitConfig.from_env({**ENV, "ELASTIC_REFIT_RUN_ID": "exp-7"}).run_id == "exp-7"
    assert RefitConfig.from_env({**ENV, "ELASTIC_REFIT_RUN_ID": "x"}, run_id="y").run_id == "y"
    with pytest.raises(ValueError, match=r"run_id must match .*got 'a b' \(from ELASTIC_REFIT_RUN_ID='a b'\)"):
        RefitConfig.from_env({**ENV, "ELASTIC_REFIT_RUN_ID": "a b"})
    with pytest.raises(ValueError, match=r"unknown variable ELASTIC_REFIT_RUNID=.*did you mean ELASTIC_REFIT_RUN_ID"):
        RefitConfig.from_env({**ENV, "ELASTIC_REFIT_RUNID": "a"})
    # A launcher's job id is not the run's: trainers and engines often have different launchers.
    launched = {**ENV, "TORCHELASTIC_RUN_ID": "tr-1", "SLURM_JOB_ID": "991", "RANK": "0"}
    assert RefitConfig.from_env(launched).run_id is None


def test_the_run_key_round_trips_and_reads_keys_of_older_versions():
    now = datetime(2026, 12, 5, 14, 0, 1, 500, tzinfo=UTC)
    run = JobRun.new("exp-7", now)
    assert run.run_id == "exp-7" and run.started == "2026-12-05T14:00:01+00:00" and run.instance
    assert JobRun.decode(run.encode()) == run
    assert JobRun.new("exp-7", now).instance != run.instance  # a new instance each time
    assert JobRun.new(None, now).run_id != JobRun.new(None, now).run_id  # random ids
    assert JobRun.decode(json.dumps({"run_id": "abc123"})) == JobRun("abc123", "abc123", "")
    for bad in (b"", b"[]", b'{"id": 1}', b"{"):
        with pytest.raises(ValueError, match="holds no run"):
            JobRun.decode(bad)


def test_run_clash_names_the_job_both_runs_and_the_fix():
    found = JobRun("a", "i1", "2026-12-05T14:00:01+00:00")
    assert run_clash("j", found, None) is None and run_clash("j", found, "a") is None
    assert run_clash("j", found, "b") == (
        "job 'j' is held by run 'a' (started 2026-12-05T14:00:01+00:00), not by this member's run 'b': another "
        "run reuses the job's name. Give this run its own job name, or `elastic-refit job reset --job j` once "
        "run 'a' has ended")
    assert "held by run 'a', not" in run_clash("j", JobRun("a", "a"), "b")


def _member(run_id: str, instance: str, started: str = "") -> SimpleNamespace:
    return SimpleNamespace(run_id=run_id, run_instance=instance, run_started=started,
                           record=SimpleNamespace(member_id="i0"))


def test_registering_again_compares_the_run_instance_not_only_its_id():
    _check_same_run(_member("a", "n1"), _member("a", "n1"))
    with pytest.raises(JobStateLost, match=r"not the one it joined \(run a instance n1; now run a instance n2, "
                                           r"started 2026"):
        _check_same_run(_member("a", "n2", "2026-12-05T14:00:01+00:00"), _member("a", "n1"))
    with pytest.raises(JobStateLost, match=r"\(run r1 instance r1; now run r2 instance r2\)"):
        _check_same_run(_member("r2", "r2"), _member("r1", "r1"))
