"""``build_matrix(..., faults=...)``: the chaos matrix narrowed to some fault names
(``elastic-refit chaos --faults kill``), still seeded and reproducible."""

from __future__ import annotations

import pytest
from elastic_refit.chaos.faults import build_matrix, matrix_fault_names


def test_faults_filter_keeps_only_those_cells_and_fills_the_trials():
    kills = build_matrix("full", trials=30, faults=["kill"])
    assert len(kills) == 30 and {s.fault for s in kills} == {"kill"}
    assert {s.victim for s in kills} == {"trainer", "inference", "coordinator"}
    double = build_matrix("full", trials=30, faults=["kill+kill"])
    assert len(double) == 30 and {s.fault for s in double} == {"kill+kill"}
    assert all(len(s.plan) == 2 for s in double)
    assert build_matrix("full", trials=30, faults=["kill"]) == kills  # reproducible
    quick = build_matrix("quick", faults=["kill", "kill+kill"])
    assert quick and {s.fault for s in quick} == {"kill", "kill+kill"}


def test_faults_filter_rejects_unknown_names():
    assert "kill" in matrix_fault_names() and "etcd_member_down" in matrix_fault_names(3)
    with pytest.raises(ValueError, match="faults must be"):
        build_matrix("full", trials=3, faults=["kil"])
    with pytest.raises(ValueError, match="faults must be"):
        build_matrix("full", trials=3, faults=[])


def test_the_no_fault_matrix_kills_nothing():
    scenarios = build_matrix("none", trials=9, seed=3)
    assert len(scenarios) == 9 and scenarios == build_matrix("none", trials=9, seed=3)
    kinds = {f.kind for s in scenarios for f in s.plan.faults}
    assert kinds == {"slow"}, kinds  # nothing that kills, stops or stalls
    assert sum(1 for s in scenarios if not s.plan.faults) == 5  # every other trial: no fault at all
    assert all(f.duration_s == 0.2 for s in scenarios for f in s.plan.faults)
    with pytest.raises(ValueError, match="no fault cells"):
        build_matrix("none", trials=3, faults=["kill"])
