"""py-spy's GIL samples read back per thread (``testing.gil_sampler``) and the RL bench's
summary of them (``testing.rl_run._gil``); tests/integration/test_gil_sampler_live.py samples
a real process."""

from __future__ import annotations

import os
import textwrap

import pytest

from elastic_refit.testing.gil_sampler import GilSampler, gil_seconds
from elastic_refit.testing.rl_run import _gil

RAW = textwrap.dedent("""\
    thread (101): MainThread;<module> (x.py:1);generate (y.py:2) 300
    thread (101): MainThread;<module> (x.py:1);step (y.py:9) 100
    thread (202): refit-agent-i0;run (agent.py:5) 40
    thread (303): etcd-client-loop;_run_once (asyncio.py:1) 20
    not a sample line
""")


def test_raw_samples_are_seconds_per_thread_name():
    assert gil_seconds(RAW, rate=200) == {"MainThread": 2.0, "refit-agent-i0": 0.2, "etcd-client-loop": 0.1}
    assert gil_seconds("", rate=200) == {}


def test_bad_rates_and_durations_are_refused():
    with pytest.raises(ValueError, match="rate"):
        GilSampler("py-spy", os.getpid(), "/dev/null", rate=0)


def test_the_summary_bounds_the_runtime_threads_share_of_refit_time():
    recs = [{"kind": "refit.event", "event": "refit.transfer.done", "member": "i0", "at": 12.0, "seconds": 1.0, "t": 12.0},
            {"kind": "refit.event", "event": "refit.transfer.done", "member": "i1", "at": 15.0, "seconds": 2.0, "t": 15.0},
            {"kind": "generated", "member": "i0", "t": 20.0},
            {"kind": "gil", "member": "i0", "mode": "async-staged", "started": 10.0, "error": None,
             "seconds_by_thread": {"MainThread": 5.0, "refit-agent-i0": 0.3, "etcd-client-loop": 0.2, "cpu-sampler": 0.1}}]
    out = _gil("async-staged", recs)
    # i0's own window only (11-12 s), sampled from 10 s to its last record at 20 s
    assert out["sampled_s"] == pytest.approx(10.0) and out["refit_s"] == pytest.approx(1.0)
    assert out["runtime_over_refit"] == pytest.approx(0.5)  # agent + etcd loop, not generation or the sampler
    failed = [{"kind": "gil", "member": "i0", "mode": "async-staged", "started": 0.0, "error": "ptrace refused",
               "seconds_by_thread": {}}]
    assert _gil("async-staged", failed) == {"error": "ptrace refused"}
    assert _gil("async-staged", recs[:3]) == {}
