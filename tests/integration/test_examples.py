"""examples/rl_loop.py runs end to end (its own etcd, trainer and inference processes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import REPO_ROOT

pytestmark = pytest.mark.etcd


def test_rl_loop_commits_every_version():
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "rl_loop.py"), "--versions", "4"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1].removeprefix("RESULT "))
    assert result["ok"] and result["errors"] == []
    assert result["versions"] == [1, 2, 3, 4]
    assert sorted(result["inference"]) == ["actor0", "actor1"]
    assert all(seen[-1] == 4 and seen == sorted(seen) for seen in result["inference"].values())
    assert "acting with version 4" in proc.stdout


def test_preset_example_checks_every_byte_on_every_engine_rank():
    """Megatron-style trainers and a vLLM-style engine, each side described by its own preset."""
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "preset_refit.py"), "--versions", "2"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("4 Megatron ranks (tp=2,pp=2) -> 2 vLLM ranks (tp=2)")
    rows = [line.split() for line in lines[2:-1]]
    assert sorted((int(v), int(r), int(w)) for v, r, w in rows) == [(1, 0, 0), (1, 1, 0), (2, 0, 0), (2, 1, 0)]
    assert lines[-1].startswith("OK: every byte of every version checked on every engine rank")
    assert "Task was destroyed" not in proc.stderr


def test_hf_quickstart_with_bfloat16_engines_fed_by_a_float32_trainer(etcd_server):
    """examples/hf_quickstart.py --engine-dtype bfloat16 (issue 38): the trainer publishes its
    float32 weights as they are, the engines hold bfloat16, and every served version equals
    the trainer's weights ``.to(bfloat16)`` bit for bit (the senders cast as they pack)."""
    pytest.importorskip("transformers")
    import os

    env = {**os.environ, "ELASTIC_REFIT_ETCD": etcd_server.endpoint}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "hf_quickstart.py"), "--steps", "2",
                           "--job", "bf16-engines", "--engine-dtype", "bfloat16"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2 engines in bfloat16" in proc.stdout
    assert "every engine's weights equal the trainer's cast to bfloat16 bit for bit" in proc.stdout
