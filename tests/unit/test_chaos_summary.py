"""The chaos summary counts lost leases and rejoins (issue 34): on a loaded host where
nothing is killed, every lease that ran out under a live member must come back on its own,
and the summary says how many did."""

from __future__ import annotations

import pytest
from elastic_refit.chaos.faults import FaultPlan, Scenario
from elastic_refit.chaos.oracle import TrialEvidence, TrialVerdict
from elastic_refit.chaos.runner import TrialResult, summarize

from elastic_refit.cli.chaos_cmd import render_summary


def _trial(events: dict[str, list[str]]) -> TrialResult:
    logs = {inc: [{"event": e} for e in names] for inc, names in events.items()}
    evidence = TrialEvidence(logs=logs, committed={1: {"epoch": 1}}, reports={}, last_version=1)
    scenario = Scenario("none x none x -", "none", "none", "-", FaultPlan(), seed=0)
    return TrialResult(scenario, TrialVerdict(()), 1.0, "job", None, evidence)


def test_lost_leases_rejoins_and_late_keepalives_are_counted_and_shown():
    results = [
        _trial({"i0-a": ["membership.keepalive.unreachable", "membership.member.lost", "refit.member.rejoin_failed",
                         "refit.member.rejoined"], "t0-a": ["refit.version.committed", "refit.version.failed"]}),
        _trial({"i1-a": ["membership.member.lost", "refit.member.rejoined"]}),
    ]
    for silence, trial in zip((0.7, 1.9), results, strict=True):
        trial.evidence.logs["x-a"] = [{"event": "membership.member.left", "max_keepalive_silence_s": silence}]
    summary = summarize(results, 10.0)
    assert (summary["leases_lost"], summary["rejoined"], summary["rejoin_failed"], summary["keepalive_late"],
            summary["versions_failed"]) == (2, 2, 1, 1, 1)
    assert summary["keepalive_silence_max_s"] == 1.9 and summary["keepalive_silence_p50_s"] == pytest.approx(1.3)
    table = render_summary({**summary, "failures": []})
    assert "leases lost / rejoined / rejoin retries" in table and "2 / 2 / 1" in table
