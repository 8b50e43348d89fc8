"""`elastic-refit timeline`: a run's JSON logs as a valid Chrome trace that shows every
fault and the recovery after it (a real demo run: tests/integration/test_demo.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from elastic_refit.cli import main
from elastic_refit.cli.timeline import build_trace, read_run
from elastic_refit.testing.traces import check_chrome_trace

pytest.importorskip("jsonschema")

T0 = 1_800_000_000.0


def _line(t: float, event: str, member: str, incarnation: str, role: str, **fields) -> str:
    stamp = datetime.fromtimestamp(T0 + t, UTC).isoformat().replace("+00:00", "Z")
    return json.dumps({"event": event, "timestamp": stamp, "level": "info", "member_id": member,
                       "incarnation": incarnation, "role": role, "job": "j", **fields})


def _run(tmp_path):
    """A small run: a trainer and an inference rank, two versions, a kill between them,
    the inference rank restarted; one line cut by the kill and an executor event logged
    without the member's context."""
    trial = tmp_path / "trial"
    trial.mkdir()
    (trial / "t0-a.log").write_text("\n".join([
        _line(0.0, "refit.member.started", "t0", "t0-a", "trainer"),
        _line(0.1, "membership.epoch.changed", "t0", "t0-a", "trainer", epoch=1, num_members=2),
        _line(0.2, "refit.version.published", "t0", "t0-a", "trainer", version=1),
        _line(0.5, "refit.transfer.done", "t0", "t0-a", "trainer", version=1, epoch=1, seq=1, seconds=0.2),
        _line(0.6, "refit.version.committed", "t0", "t0-a", "trainer", version=1, epoch=1, seq=1, digest="ab"),
        _line(1.0, "refit.version.published", "t0", "t0-a", "trainer", version=2),
        _line(1.4, "refit.attempt.failed", "t0", "t0-a", "trainer", version=2, epoch=1, seq=2, error="peer died"),
        _line(2.0, "membership.epoch.changed", "t0", "t0-a", "trainer", epoch=2, num_members=2),
        _line(2.6, "refit.version.committed", "t0", "t0-a", "trainer", version=2, epoch=2, seq=1, digest="cd"),
        "W1205 a C++ warning", ""]))
    (trial / "i0-a.log").write_text("\n".join([
        _line(0.0, "refit.member.started", "i0", "i0-a", "inference"),
        _line(0.5, "refit.transfer.done", "i0", "i0-a", "inference", version=1, epoch=1, seq=1, seconds=0.2),
        json.dumps({"event": "transport.executor.done", "timestamp": datetime.fromtimestamp(T0 + 0.5, UTC).isoformat(),
                    "level": "info", "rank": 1, "seconds": 0.2}),
        _line(0.7, "refit.version.serving", "i0", "i0-a", "inference", version=1),
        _line(0.71, "refit.serving.paused", "i0", "i0-a", "inference", version=1, seconds=0.004, deferred_s=0.0,
              mode="staged"),
        '{"event": "refit.transfer.do']))
    (trial / "i0-b.log").write_text("\n".join([
        _line(1.6, "refit.member.started", "i0", "i0-b", "inference"),
        _line(2.7, "refit.version.serving", "i0", "i0-b", "inference", version=2)]))
    (trial / "faults.jsonl").write_text(json.dumps({"index": 0, "kind": "kill", "member_id": "i0", "life": 0,
                                                    "role": "inference", "phase": "transfer[1]", "version": 2,
                                                    "epoch": 1, "pid": 1, "t": T0 + 1.3}) + "\n")
    return trial


def test_the_trace_is_valid_and_shows_every_fault_and_its_recovery(tmp_path):
    events, faults = read_run([_run(tmp_path)])
    assert len(faults) == 1 and len(events) == 16
    trace = build_trace(events, faults)
    check_chrome_trace(trace)
    by_name = {e["name"]: e for e in trace["traceEvents"] if e["ph"] != "M"}
    fault = [e for e in trace["traceEvents"] if e["name"] == "fault: kill i0 (transfer[1] v2)"]
    assert {(e["ph"], e["s"], e["pid"]) for e in fault} == {("i", "g", 1), ("i", "p", _pid(trace, "inference i0"))}
    recovery = by_name["recovery after kill i0"]
    assert recovery["dur"] == pytest.approx(1.3e6, rel=1e-3)  # kill (1.3 s) -> the next commit (2.6 s)
    assert by_name["refit.serving.paused v1"]["dur"] == pytest.approx(4000, rel=1e-3)
    # A slice ends where its event was logged; the run starts at the first slice's start.
    transfer = next(e for e in trace["traceEvents"] if e["name"] == "refit.transfer.done v1" and e["ph"] == "X")
    assert transfer["ts"] + transfer["dur"] == pytest.approx(0.5e6, abs=1)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"].endswith("_name")}
    assert {"trainer t0", "inference i0", "incarnation i0-a", "incarnation i0-b"} <= names
    # The executor's event, logged without the member's context, is on the member's row.
    executor = next(e for e in trace["traceEvents"] if e["name"] == "transport.executor.done")
    assert executor["pid"] == _pid(trace, "inference i0")
    attempts = [e["name"] for e in trace["traceEvents"] if e.get("cat") == "attempt"]
    assert "attempt e1#2 v2 (failed)" in attempts
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "b"} == {"v1 committed", "v2 committed"}


def _pid(trace, name: str) -> int:
    return next(e["pid"] for e in trace["traceEvents"] if e["ph"] == "M" and e["args"].get("name") == name)


def test_the_command_writes_the_trace(tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert main(["timeline", str(_run(tmp_path)), "-o", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_faults"] == 1 and summary["num_versions_committed"] == 2
    assert summary["max_pause_s"] == pytest.approx(0.004)
    check_chrome_trace(json.loads(out.read_text()))


def test_no_logs_is_one_error_line(tmp_path, capsys):
    assert main(["timeline", str(tmp_path), "-o", str(tmp_path / "t.json")]) == 2
    assert "no JSON log events" in capsys.readouterr().err
    assert main(["timeline", str(tmp_path / "missing"), "-o", str(tmp_path / "t.json")]) == 2
