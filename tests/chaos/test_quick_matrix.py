"""The quick chaos matrix against a real etcd and real member processes (CI).

One trial per key cell (victim x fault x phase); the oracle must find nothing torn, lost,
hung or leaked, and no other violation. Cells excluded for known runtime bugs are listed
with their reason in ``chaos.faults.QUICK_EXCLUDED`` and still run in the full matrix."""

from __future__ import annotations

import pytest

from chaos.faults import build_matrix
from chaos.runner import run_matrix

pytestmark = [pytest.mark.chaos, pytest.mark.etcd]


@pytest.mark.timeout(420)
def test_quick_matrix_finds_nothing():
    scenarios = build_matrix("quick", seed=0)
    assert len(scenarios) >= 8
    summary = run_matrix(scenarios, deadline_s=60.0)
    failures = "\n".join(f"{f['name']}: {f['violations']}" for f in summary["failures"])
    assert summary["trials"] == len(scenarios)
    for category in ("torn", "lost", "hung", "leaked"):
        assert summary[category] == 0, f"{category}:\n{failures}"
    assert summary["passed"] == summary["trials"], failures
    assert summary["faults_fired"] >= len(scenarios)
