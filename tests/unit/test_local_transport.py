"""The single-device transport and the gather-and-broadcast emulation, on CPU tensors:
both reproduce every destination piece bit-exactly and leave padding untouched."""

from __future__ import annotations

import json

import pytest
import torch

from elastic_refit.layout.models import ModelConfig
from elastic_refit.testing.local_transport import GatherBroadcastLocal, LocalTransport
from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces
from elastic_refit.testing.world import SENTINEL, RefitCase, padding_problems

TINY_MOE = ModelConfig(name="tiny-moe", hidden_size=32, num_layers=2, vocab_size=70, num_heads=4,
                       num_kv_heads=2, head_dim=8, intermediate_size=0, num_experts=4,
                       moe_intermediate_size=16, qk_norm=True)
COLOCATED = json.dumps({"domain_size": 2, "tensors": [
    {"name": "w", "shape": [9, 5], "dtype": "float32",
     "source": {"mesh": [0, 1, 2], "placements": ["S(0)"]},
     "destination": {"mesh": [[0, 1], [2, 3]], "placements": ["R", "S(1)"]}}]})

CASES = [
    RefitCase(model=TINY_MOE, source="tp=2,pp=2,ep=2", destination="tp=2,dp=2", domain_size=2, bucket_bytes=2048),
    RefitCase(spec_json=COLOCATED, bucket_bytes=32),
    RefitCase(model=TINY_MOE, source="tp=2,pp=2,ep=2", destination="tp=2,dp=2", domain_size=2, bucket_bytes=4096,
              direct_min_bytes=64),
]


def _buffers(plan, seed):
    ranks = sorted(set(plan.source.ranks) | set(plan.destination.ranks))
    out = {}
    for r in ranks:
        src = allocate(plan.source, r, fill=0)
        fill_pieces(plan.source, r, src, seed)
        out[r] = (src, allocate(plan.destination, r, fill=SENTINEL))
    return out


@pytest.mark.parametrize("case", CASES, ids=["moe", "colocated", "moe-direct"])
@pytest.mark.parametrize("method", [LocalTransport, GatherBroadcastLocal])
def test_single_device_methods_are_bit_exact(case, method):
    plan = case.plan()
    buffers = _buffers(plan, seed=7)
    runner = method(plan, torch.device("cpu"))
    runner.run(buffers)
    for rank, (_, dst) in buffers.items():
        assert check_pieces(plan.destination, rank, dst, seed=7) == []
        assert padding_problems(plan.destination, rank, dst, SENTINEL) == []
    assert runner.bytes_moved >= plan.stats.dst_bytes - plan.stats.local_bytes


def test_local_transport_moves_the_planned_bytes():
    plan = CASES[0].plan()
    runner = LocalTransport(plan, torch.device("cpu"))
    s = plan.stats
    assert runner.bytes_moved == s.cross_domain_bytes + s.intra_domain_bytes + s.local_bytes
