"""`elastic-refit demo --json`: the main job commits every version through two faults,
recovers, verifies bit-exactly, and leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO_ROOT, _pythonpath

pytestmark = pytest.mark.etcd


def test_demo_json_summary(tmp_path):
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    proc = subprocess.run([sys.executable, "-m", "elastic_refit.cli", "demo", "--json", "--log-dir", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(proc.stdout)  # stdout is the JSON only; progress went to stderr
    assert data["versions_committed"] == 6
    assert data["faults_injected"] == 2
    assert {f["role"] for f in data["faults"]} == {"inference", "trainer"}
    assert data["recovered"] is True and data["verified"] is True
    assert 0 < data["recovery_p50_s"] < 15
    assert data["errors"] == [] and data["problems"] == []
    assert [c["version"] for c in data["committed"]] == [1, 2, 3, 4, 5, 6]
    assert data["plan"]["cross_domain_bytes"] == data["plan"]["lower_bound_bytes"]
    assert data["plan"]["gather_broadcast_bytes"] > data["plan"]["cross_domain_bytes"]
    assert "FAULT" in proc.stderr and "caught up" in proc.stderr
    # no member process of this demo survives it
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in ps
