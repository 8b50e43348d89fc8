"""Relayed plans over NCCL ranks (several ranks share one GPU as hosts of their own, so every
byte crosses NCCL's socket transport): regions received by a rank that does not need them
and forwarded bucket by bucket, bit-exact, with each rank's bytes equal to the plan's; with
verification on, forwards carry the digests their boxes arrived with, and a corrupted
forward fails the needer's check."""

from __future__ import annotations

import time

import numpy as np
import pytest

from elastic_refit.plan import TransferKind
from elastic_refit.testing.processes import nccl_rank_env, run_local_world
from elastic_refit.testing.world import WorkerOptions, refit_rank
from tests.gpu.test_nccl_world import BACKENDS
from tests.integration.faults import CorruptFirstSend
from tests.integration.test_executor import assert_bit_exact_with_planned_bytes
from tests.integration.test_relay_executor import CASES

pytestmark = pytest.mark.gpu

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_nccl_relayed_refit_is_bit_exact_and_moves_the_planned_bytes(name, backend):
    case = CASES[name]
    plan = case.plan()
    results = run_local_world(refit_rank, plan.topology.num_ranks,
                              (case, WorkerOptions(backend=backend, timeout_s=60, verify=name.startswith("lone"))),
                              timeout_s=240, rank_env=nccl_rank_env)
    assert_bit_exact_with_planned_bytes(results, plan)
    t = plan.transfers
    if name.startswith("lone"):  # ranks 5-7 receive shards of "big" that only rank 4 needs
        assert np.any((t.kind == int(TransferKind.NETWORK)) & (t.dst_piece < 0))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", BACKENDS)
def test_nccl_corrupted_forward_fails_the_needers_digest_check(backend):
    # Every rank fails within the transfer timeout (plus start-up), none hangs: the needer
    # aborts on the digest, and its peers' next groups with it (new pairs connect inside
    # ncclGroupEnd on torch's communicator) and their waits fail within timeout_s.
    timeout_s = 20
    case = CASES["lone-needer-small-buckets"]
    world = case.plan().topology.num_ranks
    t0 = time.monotonic()
    results = run_local_world(refit_rank, world, (case, WorkerOptions(backend=backend, timeout_s=timeout_s, verify=True)),
                              timeout_s=120, rank_env=nccl_rank_env, per_rank_args=[(CorruptFirstSend(rank=5),)] * world)
    elapsed = time.monotonic() - t0
    kinds = {r.rank: r.error_type for r in results}
    assert not any(r.ok for r in results), kinds
    caught = [r for r in results if r.error_type == "VerificationFailed"]
    assert caught and all("forward from rank 5" in r.error for r in caught), kinds
    # start-up (CUDA, the communicator) then at most two bounded waits (a group's end, a wait)
    assert elapsed < 2 * timeout_s + 60, (elapsed, kinds, {r.rank: round(r.seconds, 1) for r in results})
