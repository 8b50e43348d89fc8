"""The executor and the baseline over several NCCL ranks: both backends (torch's
ProcessGroupNCCL and nccl4py communicators), on the layout table of the data-path tests.

With one GPU every rank shares it as a host of its own (``NCCL_HOSTID``), so every byte
between ranks crosses NCCL's socket transport; with several GPUs each rank has its own.
Every destination byte is checked against the pattern, padding against the sentinel, and
each rank's bytes against the plan."""

from __future__ import annotations

import importlib.util

import pytest

from elastic_refit.testing.processes import nccl_rank_env, run_local_world
from elastic_refit.testing.world import RefitCase, WorkerOptions, refit_rank
from tests.integration.test_executor import (
    ALL_CASES,
    FP8_MIXED_SPEC,
    FP8_SPEC,
    TINY_DENSE,
    _fp8_refit,
    _world_size,
    assert_bit_exact_with_planned_bytes,
)

pytestmark = pytest.mark.gpu

BACKENDS = ["nccl", pytest.param("nccl4py", marks=pytest.mark.skipif(
    importlib.util.find_spec("nccl") is None, reason="nccl4py is not installed (the [nccl] extra)"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(ALL_CASES))
def test_nccl_refit_is_bit_exact_and_moves_the_planned_bytes(name, backend):
    case = ALL_CASES[name]
    plan = case.plan()
    results = run_local_world(refit_rank, _world_size(case), (case, WorkerOptions(backend=backend, timeout_s=60)),
                              timeout_s=240, rank_env=nccl_rank_env)
    assert_bit_exact_with_planned_bytes(results, plan)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_ranks", [4, 8])
def test_nccl_refit_at_4_and_8_ranks_with_digests(backend, num_ranks):
    half = num_ranks // 2
    source = "tp=2,pp=2" if half == 4 else "tp=2,pp=1"
    case = RefitCase(model=TINY_DENSE, source=source, destination=f"tp=2,dp={half // 2}", domain_size=2,
                     bucket_bytes=8192)
    assert _world_size(case) == num_ranks
    results = run_local_world(refit_rank, num_ranks,
                              (case, WorkerOptions(backend=backend, timeout_s=60, verify=True, repeat=2)),
                              timeout_s=240, rank_env=nccl_rank_env)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}"
        assert r.value["problems"] == [], r.value["problems"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_nccl_fp8_refit_is_bit_exact_with_the_cpu_reference_quantizer(backend):
    """Senders quantize on the GPU (split blocks through the partial-amax exchange, MX blocks,
    a plain tensor beside), receivers hold the CPU reference's FP8 bytes and scales."""
    results = run_local_world(_fp8_refit, 5, (FP8_SPEC, True, backend), timeout_s=240, rank_env=nccl_rank_env)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}"
        assert r.value["problems"] == [], r.value["problems"]


@pytest.mark.parametrize("pack_backend", ["torch", "auto"])
def test_nccl_fp8_refit_with_the_fused_kernel_is_bit_exact(pack_backend):
    """``auto`` on CUDA: whole blocks through the compiled fused kernel straight into the
    staging, split blocks on the torch path; ``torch``: all on the torch path. Both hold
    the CPU reference's bytes; the fused kernel ran where it should."""
    results = run_local_world(_fp8_refit, 5, (FP8_MIXED_SPEC, True, "nccl", pack_backend), timeout_s=240,
                              rank_env=nccl_rank_env)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}"
        assert r.value["problems"] == [], r.value["problems"]
    assert [r.value["fused"] for r in results] == ([2, 2, 4, 0, 0] if pack_backend == "auto" else [0] * 5)
