"""``publish(..., wait=False)``: the trainer goes on with its next step while the version
moves, and what commits is what it published, byte for byte (real etcd, real gloo)."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from elastic_refit.runtime import PublishHandle
from elastic_refit.runtime.phases import PhaseHooks
from tests.integration.test_refit_failures import assert_no_errors, run_job, trainer_tensors

pytestmark = pytest.mark.etcd

VERSIONS = (1, 2, 3)


def overwrite_right_after_publish(refit, member_id: str, layout_rank: int) -> list[dict]:
    """Each version: publish without waiting, then at once scribble over every published
    tensor (the next optimizer step), then wait for the commit."""
    out = []
    for version in VERSIONS:
        tensors = trainer_tensors(layout_rank, version)
        handle = refit.publish(tensors, version, wait=False)
        assert isinstance(handle, PublishHandle)
        for t in tensors.values():
            t.view(torch.uint8).fill_(0xA5)  # nothing of the pattern survives
        commit = handle.wait()
        out.append({"version": version, "committed": commit.version, "done": handle.done()})
    return out


@pytest.mark.parametrize("snapshot_bytes", [1 << 20, 0], ids=["copy", "hold-until-sent"])
def test_weights_changed_right_after_publish_returns_commit_as_published(etcd_server, snapshot_bytes):
    etcd, job = etcd_server.endpoint, "job-" + uuid.uuid4().hex[:8]
    reports = run_job(etcd, job, overwrite_right_after_publish, inference_versions=VERSIONS,
                      snapshot_bytes=snapshot_bytes)
    assert_no_errors(reports)
    for trainer in ("t0", "t1"):
        assert [(s["version"], s["committed"], s["done"]) for s in reports[trainer]["steps"]] == [
            (v, v, True) for v in VERSIONS], reports[trainer]["steps"]
    # every inference rank served each version and every byte is the published pattern of
    # that version, not the scribble that followed publish
    for rank in ("i0", "i1"):
        steps = reports[rank]["steps"]
        assert [(s["version"], s["served"]) for s in steps] == [(v, v) for v in VERSIONS], steps
        assert all(not s["problems"] for s in steps), [s["problems"] for s in steps]


def test_a_snapshot_larger_than_the_budget_is_refused_in_publish(etcd_server):
    etcd, job = etcd_server.endpoint, "job-" + uuid.uuid4().hex[:8]

    def too_big(refit, member_id: str, layout_rank: int) -> list[dict]:
        tensors = trainer_tensors(layout_rank, 1)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with pytest.raises(ValueError, match=f"a snapshot needs {nbytes} bytes, more than snapshot_bytes \\(16\\)"):
            refit.publish(tensors, 1, wait=False)
        return [{"version": 1, "committed": refit.publish(tensors, 1).version}]  # waiting needs no copy

    reports = run_job(etcd, job, too_big, inference_versions=(1,), snapshot_bytes=16)
    assert_no_errors(reports)
    assert [s["committed"] for s in reports["t0"]["steps"]] == [1]


STEP_S = 0.2  # the trainer's step: long enough for the version it published to be in its attempt
TRANSFER_S = 0.8  # every inference rank's transfer takes at least this long (a slow refit)


def slow_transfers(phase: str, context: dict) -> None:
    """Phase hook: each inference rank's transfer starts ``TRANSFER_S`` late (a refit slower
    than a training step, as on a GPU shared with generation)."""
    if phase == "transfer.before" and context["role"] == "inference":
        time.sleep(TRANSFER_S)


def one_step_ahead(refit, member_id: str, layout_rank: int) -> list[dict]:
    """The asynchronous RL pattern (docs/integrating.md) with staleness 1: publish k without
    waiting, then wait for k - 1's handle before the next step. Version k is published while
    k - 1 still moves (the refit is slower than the step)."""
    out, handles = [], {}
    # Version 1 moves only once the epoch of all four members is formed: a trainer that
    # published 2 before then (a loaded machine: the epoch's gloo build alone took 1 s in a
    # clean suite run) had 1 superseded before it moved, rightly, and this test is about a
    # version overtaken while it moves.
    deadline = time.monotonic() + 30
    while (refit.membership.view is None or len(refit.membership.view.members) < 4) and time.monotonic() < deadline:
        time.sleep(0.02)
    for version in (*VERSIONS, 4):
        handles[version] = refit.publish(trainer_tensors(layout_rank, version), version, wait=False)
        if version - 1 in handles:
            start = time.monotonic()
            commit = handles.pop(version - 1).wait()
            out.append({"version": version - 1, "committed": commit.version, "waited_s": time.monotonic() - start})
        time.sleep(STEP_S if version > 1 else 5 * STEP_S)  # the first attempt also builds its plan
    out.append({"version": 4, "committed": handles.pop(4).wait().version, "waited_s": None})
    return out


def test_a_version_overtaken_while_it_moves_commits_and_is_not_thrown_away(etcd_server):
    """A trainer one step ahead publishes k + 1 while k moves. k, held verified by every
    inference rank once its attempt is over, commits (then k + 1 moves): the handle of k
    resolves to k's own commit. Before, the coordinator only ever committed the newest
    published version: k's transfer was thrown away, and the handle of k waited for k + 1's
    whole refit (an H100 run: the trainer held 12 s instead of 5 s, and the engines never
    served k)."""
    etcd, job = etcd_server.endpoint, "job-" + uuid.uuid4().hex[:8]
    reports = run_job(etcd, job, one_step_ahead, inference_versions=(*VERSIONS, 4), snapshot_bytes=1 << 20,
                      hooks=PhaseHooks(hooks=(slow_transfers,)))
    assert_no_errors(reports)
    for trainer in ("t0", "t1"):
        steps = reports[trainer]["steps"]
        print(trainer, [(s["version"], s["committed"], None if s["waited_s"] is None else round(s["waited_s"], 2))
                        for s in steps])
        assert [(s["version"], s["committed"]) for s in steps] == [(v, v) for v in (*VERSIONS, 4)], steps
    for rank in ("i0", "i1"):
        steps = reports[rank]["steps"]
        assert [s["served"] for s in steps] == [*VERSIONS, 4], steps
        assert all(not s["problems"] for s in steps), [s["problems"] for s in steps]
