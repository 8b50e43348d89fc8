"""`elastic-refit bench` with an FP8 destination, end to end on 4 gloo ranks: the timeout it
picks from the work (no --timeout) lets every method finish verified, and no rank's peak
memory passes what the estimate gave it (the estimate counts every method, FP8 included)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_fp8_bench_picks_its_timeout_and_stays_within_its_memory_estimate(tmp_path):
    spec = tmp_path / "fp8.json"
    spec.write_text(json.dumps({"domain_size": 2, "tensors": [
        {"name": "a.weight", "shape": [1024, 2048], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["S(0)"]},
         "destination": {"mesh": [2, 3], "placements": ["S(1)"], "format": "fp8-block128"}},
        {"name": "b.weight", "shape": [2048, 1024], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["S(1)"]},
         "destination": {"mesh": [2, 3], "placements": ["S(0)"], "format": "fp8-block128"}},
        {"name": "n.weight", "shape": [2048], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["R"]}, "destination": {"mesh": [2, 3], "placements": ["R"]}}]}))
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "elastic-refit"), "bench", "--spec", str(spec), "--repeat", "1",
         "--warmup", "0", "--p2p-mib", "4", "--bucket-mib", "2", "--torch-threads", "1", "--json"],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["verified"] is True
    estimate = out["estimate"]
    assert set(estimate["run_seconds"]) == {"reshard", "reshard_fp8", "gather_broadcast"}
    assert out["timeout_s"] == estimate["timeout_s"] >= 60
    assert "memory: about" in proc.stderr and "per operation" in proc.stderr
    for rank, (peak, budget) in enumerate(zip(out["max_rss_bytes"], estimate["rank_bytes"], strict=True)):
        assert peak <= budget, (rank, peak, budget)
    assert estimate["memory_bytes"] == sum(estimate["rank_bytes"])
