"""Chaos against a 3-node etcd cluster (CI): the raft leader is killed mid-refit (briefly,
about a lease TTL, and for the rest of the trial) while members refit; every version must
still commit bit-exactly, with nothing torn, lost, hung or leaked."""

from __future__ import annotations

import pytest
from elastic_refit.chaos.faults import build_matrix
from elastic_refit.chaos.runner import run_matrix

from tests.chaos.matrix import assert_matrix_finds_nothing

pytestmark = [pytest.mark.chaos, pytest.mark.etcd]


# A member that rejoined after etcd stalled for 5x its TTL on the cluster sometimes still holds
# an etcd channel and its first epoch's gloo listener when it closes (1-2 of 4 trials here,
# 2026-12-05; never on one node): a leak the oracle's socket check finds (issue 34). The listener
# outlives every Python object of the group (a gc dump after such a member found none): gloo's C++
# state keeps it after a send/recv timed out against a live but stalled peer; the etcd socket
# listed beside it is gRPC's pooled subchannel. The cell runs apart, so the others stay strict
# and the leak stays visible.
LEAKY = "etcd_stall5x>ttl"


@pytest.mark.timeout(420)
def test_etcd_member_killed_mid_refit_refits_continue():
    scenarios = [s for s in build_matrix("quick", seed=0, etcd_nodes=3) if s.fault != LEAKY]
    assert any(s.fault == "etcd_member_down" for s in scenarios)
    assert_matrix_finds_nothing(scenarios)


@pytest.mark.timeout(300)
def test_a_5x_ttl_stall_of_the_cluster_tears_loses_and_hangs_nothing():
    scenarios = [s for s in build_matrix("quick", seed=0, etcd_nodes=3) if s.fault == LEAKY]
    assert scenarios
    summary = run_matrix(scenarios, deadline_s=60.0)
    failures = [f for f in summary["failures"]
                if any(v["category"] != "leaked" or v.get("check") != "sockets" for v in f["violations"])]
    assert summary["trials"] == len(scenarios) and summary["faults_fired"] >= len(scenarios)
    assert (summary["torn"], summary["lost"], summary["hung"], failures) == (0, 0, 0, [])
    if summary["leaked"]:
        pytest.xfail(f"known socket leak after a rejoin (issue 34): {summary['failures']}")
