"""A local world's ranks leave together: no rank tears its transport down (or exits) before
every rank is past the world's last collective.

On the H200 (ranks sharing one GPU over NCCL's socket transport, eight test workers side by
side) a rank whose closing vote had returned aborted its communicator and exited while its
proxy thread still owed a peer the vote's last message: that peer's vote failed ("NCCL
error 6: remote process exited", nccl4py) or timed out after 60 s (torch NCCL), in
test_nccl_world's 8-rank cells. gloo delivers what it wrote before a close, so these tests
check the order itself: a rank that is slow to finish holds every other rank's teardown.
"""

from __future__ import annotations

import time

from elastic_refit.testing.processes import run_local_world
from elastic_refit.testing.world import WorkerOptions, leave_together, left_before, refit_rank
from tests.integration.test_executor import CASES, _world_size

SLOW = 2  # the rank that is last past the world's last collective
LATE_S = 1.0


def _leave(rank, world_size, store):
    if rank == SLOW:
        time.sleep(LATE_S)  # still receiving the last collective's bytes
    done = time.time()
    late = leave_together(store, rank, world_size, timeout_s=10.0)
    return {"done": done, "left": time.time(), "late": late}


def test_no_rank_leaves_before_every_rank_is_done():
    results = run_local_world(_leave, 4, timeout_s=60.0)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    slow_done = results[SLOW].value["done"]
    for r in results:
        assert r.value["late"] == []
        assert r.value["left"] >= slow_done, f"rank {r.rank} left {slow_done - r.value['left']:.3f} s early"


def _fail_or_wait(rank, world_size, store):
    if rank == 1:
        return leave_together(store, rank, world_size, timeout_s=10.0, outcome="failed: TransportAborted")
    if rank == 2:
        return "gone"  # died without a word (a killed process)
    t0 = time.monotonic()
    late = leave_together(store, rank, world_size, timeout_s=0.5)
    return {"late": late, "waited": time.monotonic() - t0, "left": left_before(store, world_size)}


def test_a_failed_rank_does_not_wait_and_one_that_never_came_is_named():
    results = run_local_world(_fail_or_wait, 3, timeout_s=60.0)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert results[1].value == []  # a failed rank only says so
    zero = results[0].value
    assert zero["late"] == [2] and zero["waited"] < 5.0
    assert zero["left"] == {0: "done", 1: "failed: TransportAborted"}


def test_refit_ranks_leave_together_on_gloo():
    """The refit worker of the multi-process tests and the bench: every rank reports no
    late rank after a refit that passed (its transport is aborted only after that)."""
    name, case = next(iter(CASES.items()))  # the executor's own table of refits
    results = run_local_world(refit_rank, _world_size(case), (case, WorkerOptions(timeout_s=30)),
                              timeout_s=120.0)
    assert all(r.ok for r in results), [(r.rank, r.error[:300]) for r in results if not r.ok]
    assert all(r.value["problems"] == [] for r in results), (name, [r.value["problems"] for r in results])
