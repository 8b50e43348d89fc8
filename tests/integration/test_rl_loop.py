"""The RL loop on the CPU (gloo): a trainer process trains a tiny Hugging Face Qwen3 with a
GRPO-style loss on synthetic rewards, two engine processes sample with `generate`, and the
weights are refit after every step, synchronously (in place) and then asynchronously one
step ahead (staged). Every version an engine served is checked against the trainer's bits;
the asynchronous engines never stop generating for a refit (benchmarks/bench_rl_step.py is
the same loop on the GPU)."""

from __future__ import annotations

import json
import socket

import pytest

from elastic_refit.cli.timeline import build_trace, read_run
from elastic_refit.testing.rl_run import run_rl
from elastic_refit.testing.rl_step import RLStepConfig

pytest.importorskip("transformers")
pytestmark = pytest.mark.etcd

STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(150)
def test_rl_loop_refits_every_step_and_serves_only_verified_versions(etcd_server, job, tmp_path):
    config = RLStepConfig(job=job, etcd=etcd_server.endpoint, log_dir=str(tmp_path / "logs"),
                          run_dir=str(tmp_path / "run"), port=_free_port(), modes=("sync-reshard", "async-staged"),
                          num_trainers=1, num_inference=2, steps=STEPS, cpu_interval_s=0.1,  # a short run
                          # Three busy processes on two shared cores: leases and timeouts are generous.
                          refit=(("ttl_s", 6), ("collective_timeout_s", 5.0), ("epoch_deadline_s", 30.0)))
    out = run_rl(config, timeout_s=130)
    assert out["errors"] == [], out["errors"]
    for mode, figures in out["modes"].items():
        verified = figures["verified"]
        # Version 0 (the initial weights) and one per step published; whatever an engine served
        # equals the trainer's (sync: both engines serve versions 0 .. STEPS - 1; async engines
        # may skip a version that a newer one overtook).
        assert verified["num_versions_published"] == STEPS + 1, (mode, verified)
        assert verified["ok"] and verified["mismatches"] == [], (mode, verified)
        assert verified["num_served"] >= (2 * STEPS if mode == "sync-reshard" else 2), (mode, verified)
        assert [row["step"] for row in figures["steps"]] == list(range(1, STEPS + 1)), mode
    sync, async_ = out["modes"]["sync-reshard"], out["modes"]["async-staged"]
    # Synchronous: the trainer trains on samples of the previous version only; asynchronous: at
    # most one version older than that (staleness 1).
    records = [json.loads(line) for p in (tmp_path / "run").glob("*.jsonl") for line in p.read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    for r in steps:
        low = r["step"] - 1 - (1 if r["mode"] == "async-staged" else 0)
        assert all(low <= v <= r["step"] - 1 for v in r["sample_versions"]), r
    # Asynchronous: the engines never wait for a refit; the staged switch is all that holds a
    # reader back (a copy of a tiny model), in place the whole transfer does.
    paused = [row["paused_s"] for row in async_["steps"] if row["paused_s"] is not None]
    assert paused and max(paused) < 0.05, async_["steps"]
    assert all(row["paused_s"] is not None and row["paused_s"] > 0 for row in sync["steps"]), sync["steps"]
    # The engines sampled their CPU beside the refit windows (where a refit's cost goes).
    cpu = async_["cpu"]
    assert cpu["refit"]["samples"] + cpu["idle"]["samples"] >= 5, cpu
    assert cpu["idle"]["threads"].get("MainThread", 0.0) > 0.0, cpu  # the thread that generates
    # The run's logs make a trace with every member's row.
    events, faults = read_run([tmp_path / "logs"])
    trace = build_trace(events, faults)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"trainer t0", "inference i0", "inference i1"} <= names
    assert any(e["name"].startswith("rl.generate") for e in trace["traceEvents"])
