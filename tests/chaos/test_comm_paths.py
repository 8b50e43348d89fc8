"""The communicator path each rank logs through a fault, on gloo with a real etcd and real
member processes: the CPU guard of the GPU runtime tests, which read the same logs.

A rank's first communicator is a "build"; every later one is a "rebuild" (or a fast path)
that names the epoch it came from, even when the old communicator was torn down before
the new epoch came (a transfer broke on gloo, a formation failed)."""

from __future__ import annotations

import pytest
from elastic_refit.chaos.faults import FaultPlan, Scenario
from elastic_refit.chaos.runner import ChaosRun

from tests.chaos.paths import assert_paths_name_their_epochs, path_into

pytestmark = [pytest.mark.chaos, pytest.mark.etcd]


@pytest.mark.timeout(180)
def test_a_restart_inside_the_lease_is_rebuilt_from_the_epoch_each_survivor_was_in():
    """The victim restarts inside its lease as a new incarnation of its slot, with a transfer
    in flight: the survivors' gloo transport breaks and is dropped at once. Every epoch a
    survivor enters after its first is a rebuild from the epoch before it; only the new
    incarnation builds (tests/gpu/test_runtime_nccl.py::test_a_restart_inside_the_lease_is_a_rebuild
    found no reconfiguration naming its epoch after the restart)."""
    run = ChaosRun(backend="gloo")
    try:
        result = run.run_trial(Scenario(
            name="inference-restart", victim="inference-restart", fault="kill", phase="transfer",
            plan=FaultPlan().restart(role="inference", rank=0, at="plan.agreed", version=2),
            seed=0, versions=3, num_inference=2))
    finally:
        assert run.close() == [], "processes outlived the run"
    assert result.verdict.passed, [f"{v.category}: {v.detail}" for v in result.verdict.violations]
    assert result.verdict.faults_fired == 1
    paths = assert_paths_name_their_epochs(result)
    survivors = [inc for inc in paths if "-L0-" in inc and not inc.startswith("i0-")]
    assert len(survivors) == 3 and all(len(paths[inc]) >= 2 for inc in survivors), paths
    assert path_into(paths, "i0-L1-") == {"rebuild"}
