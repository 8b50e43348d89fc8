"""Chaos against a 3-node etcd cluster (CI): the raft leader is killed mid-refit (briefly,
about a lease TTL, and for the rest of the trial) while members refit; every version must
still commit bit-exactly, with nothing torn, lost, hung or leaked."""

from __future__ import annotations

import pytest

from chaos.faults import build_matrix
from chaos.runner import run_matrix

pytestmark = [pytest.mark.chaos, pytest.mark.etcd]


@pytest.mark.timeout(420)
def test_etcd_member_killed_mid_refit_refits_continue():
    scenarios = build_matrix("quick", seed=0, etcd_nodes=3)
    assert any(s.fault == "etcd_member_down" for s in scenarios)
    summary = run_matrix(scenarios, deadline_s=60.0)
    failures = "\n".join(f"{f['name']}: {f['violations']}" for f in summary["failures"])
    assert summary["trials"] == len(scenarios)
    for category in ("torn", "lost", "hung", "leaked"):
        assert summary[category] == 0, f"{category}:\n{failures}"
    assert summary["passed"] == summary["trials"], failures
    assert summary["faults_fired"] >= len(scenarios)
