"""The RL bench's stall dump (``testing.rl_run._StallDump``): only step and refit records
count as progress (engines' CPU samples keep arriving while a refit hangs); after
``stall_s`` without them every live member's stacks are dumped, once. py-spy itself is
stood in for by a script here (``dump_stacks`` runs the real one in
tests/integration/test_gil_sampler_live.py)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from elastic_refit.testing.rl_run import _StallDump


@pytest.fixture
def member():
    p = mp.get_context("spawn").Process(target=time.sleep, args=(30,), daemon=True)
    p.start()
    yield p
    p.kill()
    p.join(10)


@pytest.fixture
def pyspy(tmp_path):
    script = tmp_path / "py-spy"
    script.write_text('#!/bin/sh\necho "Thread 1 (idle): MainThread\n    sleep (time)  pid $3"\n')
    script.chmod(0o755)
    return str(script)


def test_a_stall_dumps_every_member_once_and_cpu_samples_are_no_progress(tmp_path, member, pyspy):
    said: list[str] = []
    stall = _StallDump(pyspy, {"t0": member}, str(tmp_path), 0.3, said.append, time.time())
    stall.saw({"kind": "step"})
    stall.check()
    assert not (tmp_path / "stacks-t0.txt").exists()  # not stalled yet
    time.sleep(0.2)
    stall.saw({"kind": "cpu"})  # engines report CPU samples through a hang
    time.sleep(0.2)
    stall.check()
    dumped = (tmp_path / "stacks-t0.txt").read_text()
    assert f"pid {member.pid}" in dumped and any("dumping the members' stacks" in s for s in said)
    (tmp_path / "stacks-t0.txt").unlink()
    time.sleep(0.4)
    stall.check()
    assert not (tmp_path / "stacks-t0.txt").exists()  # once


def test_progress_keeps_it_quiet_and_no_py_spy_means_no_dump(tmp_path, member, pyspy):
    stall = _StallDump(pyspy, {"t0": member}, str(tmp_path), 0.3, lambda _m: None, time.time())
    for _ in range(4):
        time.sleep(0.1)
        stall.saw({"kind": "refit.event"})
        stall.check()
    assert not (tmp_path / "stacks-t0.txt").exists()
    quiet = _StallDump(None, {"t0": member}, str(tmp_path), 0.01, lambda _m: None, time.time())
    time.sleep(0.05)
    quiet.check()
    assert not (tmp_path / "stacks-t0.txt").exists()
    with pytest.raises(ValueError, match="stall_s must be > 0"):
        _StallDump(pyspy, {}, str(tmp_path), 0, lambda _m: None, time.time())
