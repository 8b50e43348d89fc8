"""``Executor.warm``: an epoch's executor made ready before its first refit (staging allocated,
every packing bucket's kernel program bound to its buffers), over real gloo process groups.
The first refit after it binds nothing, moves the same bytes, and buffers it was not warmed
with (or none) still refit bit-exact."""

from __future__ import annotations

import torch.distributed as dist
from elastic_refit.kernels.program import PackProgram

from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces
from elastic_refit.testing.processes import run_local_world
from elastic_refit.testing.world import RefitCase, leave_together, make_transport
from elastic_refit.transport.executor import Executor, ExecutorOptions

from .test_executor import TINY_MOE

CASE = RefitCase(model=TINY_MOE, source="tp=1,pp=2,dp=2,ep=2", destination="tp=2,dp=1", domain_size=2,
                 bucket_bytes=4096)
SENTINEL = 0xA5


def _warm_rank(rank: int, world_size: int, store: dist.Store, case: RefitCase) -> dict:
    plan = case.plan()
    transport = make_transport(dist.PrefixStore("warm", store), rank, world_size, "gloo", 60.0)
    executor = Executor(plan, transport, ExecutorOptions(verify=True))
    src = allocate(plan.source, rank, fill=0)
    dst = allocate(plan.destination, rank, fill=SENTINEL)
    fill_pieces(plan.source, rank, src, 3)
    bound = executor.warm(src, dst)
    staged = executor.staging_allocated
    binds = []
    original = PackProgram.bind

    def counted(self, *args, **kwargs):
        binds.append(1)
        return original(self, *args, **kwargs)

    PackProgram.bind = counted  # this rank's process only
    try:
        first = executor.run(src, dst)
        binds_in_first = len(binds)
        other = allocate(plan.destination, rank, fill=SENTINEL)  # buffers it was not warmed with
        executor.run(src, other)
    finally:
        PackProgram.bind = original
    problems = check_pieces(plan.destination, rank, dst, 3) + check_pieces(plan.destination, rank, other, 3)
    leave_together(store, rank, world_size, 60.0)
    transport.abort()
    return {"bound": bound, "staged": staged, "binds_in_first": binds_in_first, "binds_after": len(binds),
            "buckets": first.num_buckets, "problems": problems}


def test_a_warmed_executor_binds_nothing_in_its_first_refit_and_moves_the_same_bytes():
    results = run_local_world(_warm_rank, CASE.plan().topology.num_ranks, (CASE,), timeout_s=120)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    reports = [r.value for r in results]
    assert all(not r["problems"] for r in reports), [r["problems"] for r in reports]
    assert sum(r["bound"] for r in reports) > 0, "no bucket was bound ahead"
    assert all(r["staged"] > 0 for r in reports if r["bound"]), "warm did not allocate staging"
    # Warmed: the first refit only launches; other buffers bind at their first refit.
    assert [r["binds_in_first"] for r in reports] == [0] * len(reports)
    assert sum(r["binds_after"] for r in reports) > 0
