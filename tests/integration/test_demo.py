"""`elastic-refit demo --json`: the main job commits every version through two faults,
recovers, verifies bit-exactly, and leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from .conftest import REPO_ROOT, _pythonpath

pytestmark = pytest.mark.etcd


def _session_members(sid: int) -> list[str]:
    """Live processes of session ``sid`` (the demo runs as a session leader: every process
    it starts, etcd aside, stays in its session unless it escapes on purpose)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(entry)
    return out


def test_demo_json_summary(tmp_path):
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    trace_path = tmp_path / "trace.json"
    logs = tmp_path / "logs"
    proc = subprocess.Popen([sys.executable, "-m", "elastic_refit.cli", "demo", "--json", "--log-dir", str(logs),
                             "--trace", str(trace_path)],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    data = json.loads(stdout)  # stdout is the JSON only; progress went to stderr
    assert data["num_versions_committed"] == 6
    assert data["num_faults"] == 2
    assert {f["role"] for f in data["faults"]} == {"inference", "trainer"}
    assert data["recovered"] is True and data["verified"] is True
    assert 0 < data["recovery_p50_s"] < 15
    assert data["errors"] == [] and data["problems"] == [] and data["violations"] == []
    assert data["leaked_pids"] == []
    assert [c["version"] for c in data["committed"]] == [1, 2, 3, 4, 5, 6]
    # Every check an inference rank made was bit-exact, and every live rank reached the last
    # version (the oracle: no violation); a rank that sees two commits at once checks the newer.
    assert data["num_checks"] >= 6
    assert data["plan"]["cross_domain_bytes"] == data["plan"]["lower_bound_bytes"]
    assert data["plan"]["gather_broadcast_bytes"] > data["plan"]["cross_domain_bytes"]
    assert "FAULT" in stderr and "caught up" in stderr
    _check_trace(json.loads(trace_path.read_text()), data)
    # The logs are where the demo says they are, after it exited: --log-dir itself.
    assert data["log_dir"] == str(logs) and f"member logs in {logs}" in stderr
    assert len(list(logs.glob("*.log"))) >= 7  # 6 members and the restarted incarnation
    _check_one_clock(stderr, data)
    _check_rendered(data)
    # No process the demo started survives it. A killed process may still be on its way
    # out for a moment on a loaded machine (the demo's own check above found none alive).
    deadline = time.monotonic() + 5.0
    while _session_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session_members(proc.pid) == []


def _check_trace(trace: dict, data: dict) -> None:
    """`demo --trace`: valid Chrome trace JSON, with every fault (a marker on the job's row
    and on the killed member's) and the recovery after it, every commit, every member."""
    pytest.importorskip("jsonschema")
    from elastic_refit.testing.traces import check_chrome_trace

    check_chrome_trace(trace)
    events = trace["traceEvents"]
    assert data["trace"]["num_faults"] == 2
    for fault in data["faults"]:
        label = f"fault: kill {fault['member_id']} ({fault['phase']} v{fault['version']})"
        assert sum(1 for e in events if e["name"] == label and e["ph"] == "i") == 2, label
        recovery = [e for e in events if e["name"] == f"recovery after kill {fault['member_id']}"]
        assert len(recovery) == 1 and recovery[0]["dur"] / 1e6 == pytest.approx(fault["recovery_s"], abs=0.05)
    assert {e["args"]["version"] for e in events if e["ph"] == "b"} == {1, 2, 3, 4, 5, 6}
    members = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"trainer t0", "trainer t1", "inference i0", "inference i1", "inference i2", "inference i3"} <= members
    # The restarted inference rank is a second row of its member.
    assert sum(1 for e in events if e["ph"] == "M" and e["args"].get("name", "").startswith("incarnation i1-")) == 2


def _check_one_clock(stderr: str, data: dict) -> None:
    """The live narration and the summary share one clock (seconds since the job started):
    each version's narrated commit comes at most a poll after its logged commit; start-up
    comes before the first refit."""
    import re

    narrated = {int(v): float(t) for t, v in re.findall(r"\[\s*([\d.]+)s\] version (\d+) committed", stderr)}
    assert set(narrated) == {c["version"] for c in data["committed"]}
    for c in data["committed"]:
        assert -0.2 <= narrated[c["version"]] - c["at_s"] < 3.0, (c, narrated)
    assert 0 < data["startup_s"] <= data["first_proposal_s"] <= data["committed"][0]["at_s"]
    assert data["last_commit_s"] == pytest.approx(data["committed"][-1]["at_s"], abs=0.01)
    assert data["last_commit_s"] < data["wall_s"]
    restarted = [f for f in data["faults"] if f["restarted"]]
    assert restarted and all(f["killed_at_s"] < f["restarted_at_s"] < f["caught_up_at_s"] for f in restarted)
    assert all(f["serving_again_s"] == pytest.approx(f["caught_up_at_s"] - f["killed_at_s"]) for f in restarted)


def _check_rendered(data: dict) -> None:
    """The readable summary states the model's size and defines each term it uses, once."""
    from elastic_refit.cli.demo_cmd import TERMS, render_summary

    text = render_summary(data)
    assert text.startswith(f"model: {data['plan']['num_tensors']} tensors, ")
    assert f"member logs: {data['log_dir']}" in text
    for term, _ in TERMS:
        assert text.count(f"\n  {term}: ") == 1, term
    for used in ("epoch", "attempt", "domain", "lower bound", "recovery", "reshard", "gather-and-broadcast"):
        assert used in text.split("terms:")[0], used  # every defined term is one the summary uses
