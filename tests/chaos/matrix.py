"""Running a chaos matrix in a test and asserting the oracle found nothing."""

from __future__ import annotations

from elastic_refit.chaos.faults import Scenario
from elastic_refit.chaos.runner import run_matrix


def assert_matrix_finds_nothing(scenarios: list[Scenario], deadline_s: float = 60.0) -> dict:
    """Run ``scenarios``; every trial must pass with nothing torn, lost, hung or leaked and
    every fault must have fired. Returns the summary."""
    summary = run_matrix(scenarios, deadline_s=deadline_s)
    failures = "\n".join(f"{f['name']}: {f['violations']}" for f in summary["failures"])
    assert summary["trials"] == len(scenarios)
    for category in ("torn", "lost", "hung", "leaked"):
        assert summary[category] == 0, f"{category}:\n{failures}"
    assert summary["passed"] == summary["trials"], failures
    assert summary["faults_fired"] >= len(scenarios)
    return summary
