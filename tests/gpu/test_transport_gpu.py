"""The data path on one GPU: the single-device transport with the Triton pack kernels, and
the executor over a one-rank NCCL communicator (NCCL refuses two ranks on one GPU, so this
is the NCCL path one device allows: group creation, local copies, the completion vote)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from elastic_refit.layout.models import ModelConfig
from elastic_refit.testing.local_transport import GatherBroadcastLocal, LocalTransport
from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces
from elastic_refit.testing.world import SENTINEL, RefitCase, padding_problems
from elastic_refit.transport import C10dTransport, Executor, ExecutorOptions

pytestmark = pytest.mark.gpu

TINY_MOE = ModelConfig(name="tiny-moe", hidden_size=256, num_layers=2, vocab_size=1000, num_heads=8,
                       num_kv_heads=4, head_dim=32, intermediate_size=0, num_experts=8,
                       moe_intermediate_size=128, qk_norm=True)


def _buffers(plan, device):
    out = {}
    for r in sorted(set(plan.source.ranks) | set(plan.destination.ranks)):
        src = allocate(plan.source, r, fill=0, device=device)
        fill_pieces(plan.source, r, src, seed=3)
        out[r] = (src, allocate(plan.destination, r, fill=SENTINEL, device=device))
    return out


@pytest.mark.parametrize("direct_min_bytes", [1 << 30, 4096])
@pytest.mark.parametrize("method", [LocalTransport, GatherBroadcastLocal])
def test_single_gpu_refit_is_bit_exact(method, direct_min_bytes):
    case = RefitCase(model=TINY_MOE, source="tp=2,pp=2,ep=2", destination="tp=2,dp=2", domain_size=2,
                     bucket_bytes=1 << 20, direct_min_bytes=direct_min_bytes)
    plan = case.plan()
    buffers = _buffers(plan, "cuda")
    method(plan, torch.device("cuda")).run(buffers)
    torch.cuda.synchronize()
    for r, (_, dst) in buffers.items():
        assert check_pieces(plan.destination, r, dst, seed=3) == []
        assert padding_problems(plan.destination, r, dst, SENTINEL) == []


@pytest.mark.parametrize("verify", [False, True])
def test_executor_over_one_rank_nccl(verify):
    spec = json.dumps({"domain_size": 1, "tensors": [
        {"name": "w", "shape": [512, 256], "dtype": "bfloat16",
         "source": {"mesh": [0], "placements": ["R"]}, "destination": {"mesh": [0], "placements": ["R"]}},
        {"name": "e", "shape": [8, 64, 32], "dtype": "float32",
         "source": {"mesh": [0], "placements": ["R"]}, "destination": {"mesh": [0], "placements": ["R"]}}]})
    plan = RefitCase(spec_json=spec).plan()
    store = dist.HashStore()
    transport = C10dTransport.create(store, 0, 1, backend="nccl", timeout_s=30)
    try:
        src = allocate(plan.source, 0, fill=0, device="cuda")
        fill_pieces(plan.source, 0, src, seed=5)
        dst = allocate(plan.destination, 0, fill=SENTINEL, device="cuda")
        report = Executor(plan, transport, ExecutorOptions(verify=verify)).run(src, dst)
        assert report.local_bytes == plan.stats.local_bytes == plan.stats.dst_bytes
        assert check_pieces(plan.destination, 0, dst, seed=5) == []
    finally:
        transport.abort()
