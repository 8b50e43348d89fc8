"""Running a chaos matrix in a test and asserting the oracle found nothing."""

from __future__ import annotations

from elastic_refit.chaos.faults import Scenario
from elastic_refit.chaos.runner import ChaosRun, run_matrix


def assert_matrix_finds_nothing(scenarios: list[Scenario], run: ChaosRun | None = None) -> dict:
    """Run ``scenarios`` (on ``run``, else on a run of their own); every trial must pass with
    nothing torn, lost, hung or leaked and every fault must have fired. Returns the summary."""
    summary = run_matrix(scenarios, run=run)
    failures = "\n".join(f"{f['name']}: {f['violations']}" for f in summary["failures"])
    assert summary["trials"] == len(scenarios)
    for category in ("torn", "lost", "hung", "leaked"):
        assert summary[category] == 0, f"{category}:\n{failures}"
    assert summary["passed"] == summary["trials"], failures
    assert summary["faults_fired"] >= len(scenarios)
    return summary
