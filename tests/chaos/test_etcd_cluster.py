"""Chaos against a 3-node etcd cluster (CI): the raft leader is killed mid-refit (briefly,
about a lease TTL, and for the rest of the trial) while members refit; every version must
still commit bit-exactly, with nothing torn, lost, hung or leaked."""

from __future__ import annotations

import pytest
from elastic_refit.chaos.faults import build_matrix

from tests.chaos.matrix import assert_matrix_finds_nothing

pytestmark = [pytest.mark.chaos, pytest.mark.etcd]


@pytest.mark.timeout(420)
def test_etcd_member_killed_mid_refit_refits_continue():
    scenarios = build_matrix("quick", seed=0, etcd_nodes=3)
    assert any(s.fault == "etcd_member_down" for s in scenarios)
    assert_matrix_finds_nothing(scenarios)
