"""The no-fault chaos mode against a real etcd and real member processes: nothing dies
(no fault, or a slow rank) while CPU burners load the machine, and no member is fenced."""

from __future__ import annotations

import pytest
from elastic_refit.chaos.faults import build_matrix
from elastic_refit.chaos.runner import run_matrix

pytestmark = [pytest.mark.chaos, pytest.mark.etcd]


@pytest.mark.timeout(300)
def test_a_loaded_run_without_faults_fences_no_member():
    scenarios = build_matrix("none", trials=2, seed=1)
    summary = run_matrix(scenarios, cpu_burners=1)
    failures = "\n".join(f"{f['name']}: {f['violations']}" for f in summary["failures"])
    assert summary["trials"] == 2 and summary["passed"] == 2, failures
    assert summary["fenced"] == summary["fenced_live"] == 0
