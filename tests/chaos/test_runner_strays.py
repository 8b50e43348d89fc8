"""A trial's leftover-process check counts what the trial left, not what another run of the
same process holds: a test module's run (its etcd and warm workers, alive until the module
ends) beside a matrix that starts a run of its own, as on the GPU machine, where
``test_chaos_quick_matrix_on_nccl`` ran after the tests sharing the module's run and found
their 7 processes in every trial."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from elastic_refit.chaos.faults import FaultPlan, Scenario
from elastic_refit.chaos.runner import ChaosRun

pytestmark = [pytest.mark.chaos, pytest.mark.etcd]


def _no_fault() -> Scenario:
    return Scenario("none x none x -", "none", "none", "-", FaultPlan(), seed=0, versions=2)


@pytest.mark.timeout(300)
def test_processes_of_another_live_run_are_not_a_trials_leftovers():
    other = ChaosRun()  # what the module's fixture holds while a later test runs its own
    run = ChaosRun()
    stray = None
    try:
        other.etcd(1)
        other.pool.replenish(0)  # its spare workers, idle
        assert other.owned_pids(), "the other run holds no processes: the test shows nothing"
        result = run.run_trial(_no_fault())
        leaked = [v for v in result.verdict.violations if v.category == "leaked"]
        assert not leaked, leaked
        assert result.verdict.passed, result.verdict.violations
        # A child of this process that no run holds is still a leftover.
        stray = subprocess.Popen(["sleep", "60"])
        result = run.run_trial(_no_fault(), 1)
        found = [v for v in result.verdict.violations if v.check == "processes"]
        assert found and str(stray.pid) in found[0].detail, result.verdict.violations
        assert all(str(pid) not in found[0].detail for pid in other.owned_pids())
    finally:
        if stray is not None:
            stray.kill()
            stray.wait(5)
        assert run.close() == []
        assert other.close() == []
    # close() keeps the failed trial's folder (its logs are what a reader of the failure has)
    # and removes the passed one's
    assert result.log_dir and os.path.isdir(result.log_dir), result.log_dir
    assert sorted(os.listdir(run.root)) == [os.path.basename(result.log_dir)]
    shutil.rmtree(run.root)


def test_a_matrix_on_a_given_run_refuses_settings_that_are_the_runs():
    """A matrix handed an open run takes its backend and burners; asking for others is an
    error that names them, and the run stays open for its owner."""
    from elastic_refit.chaos.runner import run_matrix

    run = ChaosRun()
    try:
        with pytest.raises(ValueError, match=r"backend='nccl4py'.*given run's.*backend='gloo'"):
            run_matrix([_no_fault()], run=run, backend="nccl4py")
        with pytest.raises(ValueError, match="cpu_burners=1"):
            run_matrix([_no_fault()], run=run, cpu_burners=1)
        summary = run_matrix([], run=run)
        assert summary["trials"] == 0 and run.owned_pids() == set()
    finally:
        assert run.close() == []
