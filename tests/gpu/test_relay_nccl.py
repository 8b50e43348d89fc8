"""Relayed plans over NCCL ranks (several ranks share one GPU as hosts of their own, so every
byte crosses NCCL's socket transport): regions received by a rank that does not need them
and forwarded bucket by bucket, bit-exact, with each rank's bytes equal to the plan's."""

from __future__ import annotations

import numpy as np
import pytest

from elastic_refit.plan import TransferKind
from elastic_refit.testing.processes import nccl_rank_env, run_local_world
from elastic_refit.testing.world import WorkerOptions, refit_rank
from tests.gpu.test_nccl_world import BACKENDS
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
