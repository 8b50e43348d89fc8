"""examples/fsdp2_tp_refit.py end to end: FSDP2 x TP trainers refit a TP engine through the
test's etcd, and the engine's logits equal the trainer's bit for bit, per version and dtype."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from .conftest import REPO_ROOT, _pythonpath

pytest.importorskip("transformers", reason="the FSDP2 x TP example needs transformers (pip install -e .[examples])")

pytestmark = pytest.mark.etcd

EXAMPLE = REPO_ROOT / "examples" / "fsdp2_tp_refit.py"
VERSIONS = 2
# version, dtype, loss, max abs diff, equal, publish seconds
ROW = re.compile(r"^\s*(\d+)\s+(float32|bfloat16)\s+(\S+)\s+(\S+)\s+(yes|NO)\s+(\S+)\s*$")


def run_example(*args: str, timeout_s: float) -> tuple[int, str, str]:
    """Run the example in its own session; on a timeout SIGTERM it (it stops its own children
    and etcd), then SIGKILL."""
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), *args], cwd=REPO_ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"example did not finish in {timeout_s} s:\n{out[-3000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_logits_equal_trainer_logits(dtype, etcd_server):
    code, out, err = run_example("--dtype", dtype, "--versions", str(VERSIONS), "--etcd", etcd_server.endpoint,
                                 "--timeout", "100", timeout_s=120)
    assert code == 0, f"exit code {code}\n{out[-3000:]}\n{err[-3000:]}"
    rows = [m.groups() for m in map(ROW.match, out.splitlines()) if m]
    assert [int(r[0]) for r in rows] == list(range(1, VERSIONS + 1)), out
    for version, row_dtype, _loss, diff, equal, _seconds in rows:
        assert row_dtype == dtype, out
        assert float(diff) == 0.0 and equal == "yes", f"version {version}: max abs diff {diff}\n{out}"
    assert re.search(r"^trainer layout fingerprint: [0-9a-f]{32} \(the same on all 4 ranks", out, re.M), out
    assert "OK:" in out, out
