"""benchmarks/gpu_all_table.py: the table of ``gpu_session.sh all``, read from a real pytest
run's JUnit report (passed, failed, skipped, a pytest-timeout hang, a test that never
reported) and benchmark outputs in the shapes the benchmarks print."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("gpu_all_table", ROOT / "benchmarks" / "gpu_all_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SUITE = '''
import time
import pytest

def test_ok():
    pass

def test_broken():
    assert 1 == 2

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

@pytest.mark.timeout(1)
def test_idle():
    time.sleep(30)
'''


def _lane(tmp_path: Path, name: str, collected: int) -> Path:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (tmp_path / "test_fake_suite.py").write_text(SUITE)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={out / (name + '.xml')}", str(tmp_path / "test_fake_suite.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    (out / f"{name}.rc").write_text(f"{proc.returncode} 12.5\n")
    (out / f"{name}.collected").write_text(f"{collected} tests collected in 0.1s\n")
    return out


def test_a_lane_counts_passed_failed_skipped_and_hung(table, tmp_path):
    out = _lane(tmp_path, "rest", collected=5)  # one collected test never reported (a cut lane)
    row = table.lane_row(out, "rest")
    assert (row["collected"], row["passed"], row["failed"], row["errors"], row["skipped"]) == (5, 1, 1, 0, 1)
    assert row["hung"] == 2, row  # the pytest-timeout failure and the one that never reported
    assert row["rc"] == 1 and row["wall_s"] == 12.5
    assert any("test_idle" in b and b.startswith("hung") for b in row["bad"]), row["bad"]
    assert any("test_broken" in b and b.startswith("failed") for b in row["bad"]), row["bad"]


def test_a_lane_without_a_report_counts_every_collected_test_as_hung(table, tmp_path):
    out = tmp_path
    (out / "runtime.rc").write_text("124 300\n")
    (out / "runtime.collected").write_text("21 tests collected in 2.4s\n")
    row = table.lane_row(out, "runtime")
    assert row["hung"] == 21 and row["passed"] == 0 and "did not finish" in row["note"]


def test_benchmarks_and_the_whole_table(table, tmp_path):
    out = _lane(tmp_path, "rest", collected=4)
    (out / "kernels.json").write_text(json.dumps({
        "goal": {"met": True, "min_pack": 0.93, "min_unpack": 0.88, "worst_pack": "c 512x[4096] bfloat16",
                 "worst_unpack": "c 256x[4096] bfloat16", "bit_exact": True},
        "meta": {"launches": {"direct": 900, "dispatch": 30, "enabled": 1}}}))
    (out / "kernels.rc").write_text("0 61\n")
    (out / "lifecycle.json").write_text(json.dumps([
        {"ranks": 4, "backend": "nccl4py", "shrink_p50_s": 0.01, "grow_p50_s": 0.42, "rebuild_p50_s": 0.9},
        {"ranks": 8, "backend": "nccl4py", "error": "TransportAborted: no"}]))
    (out / "lifecycle.rc").write_text("1 50\n")
    (out / "churn.json").write_text("NCCL INFO a banner on stdout\n" + json.dumps({
        "shrink": {"epoch": 2, "first_s": 0.5, "steady_p50_s": 0.47, "ratio": 1.06},
        "grow": {"epoch": 3, "first_s": 0.48, "steady_p50_s": 0.47, "ratio": 1.02}, "passed": True}))
    (out / "churn.rc").write_text("0 88\n")
    benches = table.bench_rows(out)
    assert [b["step"] for b in benches] == ["bench kernels", "bench lifecycle", "bench churn"]
    assert "yes" in benches[0]["key"] and "0.88" in benches[0]["key"] and "direct 900" in benches[0]["key"]
    assert "shrink 0.010" in benches[1]["key"] and "x8: error" in benches[1]["key"]
    assert "shrink: first 0.500" in benches[2]["key"] and "1.02x" in benches[2]["key"]
    text = table.render([table.lane_row(out, "rest")], benches, total_s=480.0)
    assert "| **GPU suite** | 4 | 1 | 1 | 0 | 1 | 1 |" in text and "| **all** |" in text and "480" in text
    assert table.main([str(out), "--lanes", "rest"]) == 1  # a failure anywhere: not clean
