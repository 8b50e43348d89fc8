"""The gather-and-broadcast baseline over real gloo processes: bit-exact, the bytes of
the classic refit, failures surface as TransportAborted; and `elastic-refit bench` end
to end on a tiny spec.

Byte accounting, precisely: for every destination tensor T with root r (the source rank
holding most bytes of T, lowest rank on ties), the gather moves |T| - held(r) bytes into r
and the chain moves |T| into every other destination rank holding part of T. Summed over
ranks, bytes received == bytes sent == ``plan.stats.gather_broadcast_bytes``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from elastic_refit.errors import TransportAborted
from elastic_refit.layout.models import ModelConfig
from elastic_refit.testing.pattern import allocate, byte_view, check_pieces, fill_pieces
from elastic_refit.testing.processes import run_local_world
from elastic_refit.testing.world import SENTINEL, RefitCase, padding_problems
from elastic_refit.transport import C10dTransport
from elastic_refit.transport.baseline import BaselineOptions, GatherBroadcast

REPO = Path(__file__).resolve().parents[2]

TINY_DENSE = ModelConfig(name="tiny-llama", hidden_size=64, num_layers=3, vocab_size=250, num_heads=4,
                         num_kv_heads=2, head_dim=16, intermediate_size=96)
TINY_MOE = ModelConfig(name="tiny-qwen3-moe", hidden_size=64, num_layers=2, vocab_size=130, num_heads=4,
                       num_kv_heads=2, head_dim=16, intermediate_size=0, num_experts=4,
                       moe_intermediate_size=32, qk_norm=True)

REPLICATED = json.dumps({
    "domain_size": 2,
    "tensors": [
        # replicated source (2 replicas of 2 row shards): one holder per region
        {"name": "w", "shape": [10, 7], "dtype": "float32",
         "source": {"mesh": [[0, 1], [2, 3]], "placements": ["R", "S(0)"]},
         "destination": {"mesh": [4, 5], "placements": ["S(1)"]}},
        # fully replicated source, column shards of uneven size, the root is a destination too
        {"name": "b", "shape": [3, 5], "dtype": "bfloat16",
         "source": {"mesh": [1, 2], "placements": ["R"]},
         "destination": {"mesh": [[1, 4], [5, 0]], "placements": ["R", "S(1)"]}},
        {"name": "stacked", "shape": [3, 4, 10], "dtype": "int8",
         "source": {"mesh": [[0], [3]], "placements": ["R", "S(2)"]},
         "destination": {"mesh": [2, 4, 5], "placements": ["S(0)"]}},
    ],
})

CASES = {
    "spec-replicated-source": RefitCase(spec_json=REPLICATED),
    # fused QKV, PP stages, vocab padding: 4 source + 4 destination ranks
    "dense-tp2pp2-to-tp2dp2": RefitCase(model=TINY_DENSE, source="tp=2,pp=2", destination="tp=2,dp=2",
                                        domain_size=4),
    # stacked experts re-sliced from EP to TP
    "moe-pp2ep2-to-tp2": RefitCase(model=TINY_MOE, source="tp=1,pp=2,dp=2,ep=2", destination="tp=2,dp=1",
                                   domain_size=2),
}
WORLD = max(c.build().topology.num_ranks for c in CASES.values())


def _baseline_cases(rank: int, world_size: int, store: dist.Store, cases: dict[str, RefitCase],
                    chunk_bytes: int) -> dict:
    """Every case in one world (spawning processes dominates the cost), each in its own group."""
    out = {}
    for name, case in cases.items():
        plan = case.plan()
        transport = C10dTransport.create(dist.PrefixStore(name, store), rank, world_size, backend="gloo",
                                         timeout_s=30)
        baseline = GatherBroadcast(plan, transport, BaselineOptions(chunk_bytes=chunk_bytes, window=2))
        src = allocate(plan.source, rank)
        fill_pieces(plan.source, rank, src, seed=7)
        dst = allocate(plan.destination, rank, fill=SENTINEL)
        reports = []
        problems = []
        for _ in range(2):  # a second run on sentinel buffers: the schedule is reusable
            for t in dst.values():
                byte_view(t).fill_(SENTINEL)
            reports.append(asdict(baseline.run(src, dst)))
            problems += check_pieces(plan.destination, rank, dst, seed=7)
            problems += padding_problems(plan.destination, rank, dst, SENTINEL)
        transport.abort()
        out[name] = {"reports": reports, "problems": problems}
    # A rank that fails mid-refit (here: a missing buffer) fails every rank.
    plan = CASES["dense-tp2pp2-to-tp2dp2"].plan()
    transport = C10dTransport.create(dist.PrefixStore("fault", store), rank, world_size, backend="gloo",
                                     timeout_s=5)
    baseline = GatherBroadcast(plan, transport)
    src = allocate(plan.source, rank)
    dst = allocate(plan.destination, rank)
    try:
        baseline.run({} if rank == 0 else src, dst)
        out["fault"] = "no error"
    except TransportAborted as exc:
        out["fault"] = f"TransportAborted: {exc}"
    except ValueError as exc:
        out["fault"] = f"ValueError: {exc}"
    return out


def _expected_bytes(case: RefitCase) -> tuple[dict[int, int], dict[int, int]]:
    """Per rank (gather bytes received, broadcast bytes received), derived independently
    from the layouts: the root holds most bytes, every other destination holder receives
    the whole tensor once."""
    spec = case.build()
    src, dst = spec.source, spec.destination
    gather: dict[int, int] = {}
    bcast: dict[int, int] = {}
    nbytes = src.piece_nbytes()
    for t in dst.tensors:
        si = src.tensor_index(t.name)
        held: dict[int, int] = {}
        for p in np.flatnonzero(src.piece_tensor == si):
            held[int(src.piece_rank[p])] = held.get(int(src.piece_rank[p]), 0) + int(nbytes[p])
        root = sorted(held, key=lambda r: (-held[r], r))[0]
        gather[root] = gather.get(root, 0) + t.nbytes - held[root]
        for r in {int(r) for r in dst.piece_rank[dst.piece_tensor == dst.tensor_index(t.name)]} - {root}:
            bcast[r] = bcast.get(r, 0) + t.nbytes
    return gather, bcast


@pytest.fixture(scope="module")
def world_results():
    # 48-byte chunks: most tensors travel in many chunks and non-contiguous sub-boxes.
    results = run_local_world(_baseline_cases, WORLD, (CASES, 48), timeout_s=150)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}"
    return [r.value for r in results]


@pytest.mark.parametrize("name", list(CASES))
def test_baseline_is_bit_exact_and_moves_the_classic_bytes(world_results, name):
    plan = CASES[name].plan()
    gather, bcast = _expected_bytes(CASES[name])
    for rank, value in enumerate(world_results):
        assert value[name]["problems"] == [], value[name]["problems"]
        for report in value[name]["reports"]:
            assert report["gather_recv_bytes"] == gather.get(rank, 0), (rank, report)
            assert report["broadcast_recv_bytes"] == bcast.get(rank, 0), (rank, report)
    reports = [v[name]["reports"][-1] for v in world_results]
    assert sum(r["recv_bytes"] for r in reports) == plan.stats.gather_broadcast_bytes
    assert sum(r["send_bytes"] for r in reports) == plan.stats.gather_broadcast_bytes
    # Chunked: more messages than tensors, and staging never above one tensor + two chunks.
    assert sum(r["num_messages"] for r in reports) > len(plan.destination.tensors)
    largest = max(t.nbytes for t in plan.destination.tensors)
    assert max(r["staging_bytes"] for r in reports) <= largest + 2 * 48


def test_a_failing_rank_aborts_every_rank(world_results):
    assert world_results[0]["fault"].startswith("ValueError: rank 0: source buffer"), world_results[0]["fault"]
    for rank, value in enumerate(world_results[1:], start=1):
        assert value["fault"].startswith("TransportAborted"), (rank, value["fault"])


def test_bench_cli_json_on_a_tiny_spec(tmp_path):
    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps({"domain_size": 8, "tensors": [
        {"name": "w", "shape": [64, 48], "dtype": "bfloat16",
         "source": {"mesh": [0, 1], "placements": ["S(0)"]},
         "destination": {"mesh": [2, 3], "placements": ["S(1)"]}},
        {"name": "b", "shape": [48], "dtype": "float32",
         "source": {"mesh": [0, 1], "placements": ["R"]},
         "destination": {"mesh": [2, 3], "placements": ["R"]}}]}))
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "elastic-refit"), "bench", "--spec", str(spec), "--repeat", "1", "--json",
         "--p2p-mib", "1", "--timeout", "20", "--snapshot-digests"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["verified"] is True and out["snapshot_digests"] is True
    assert out["num_ranks"] == 4
    # the digests and checks alone, timed inside the ranks: part of the checked reshard's time
    assert 0 < out["checks_digest_seconds"] <= out["reshard_checked"]["seconds"]
    for method in ("reshard", "gather_broadcast"):
        assert out[method]["seconds"] > 0
    # reshard: each destination receives its half of w and all of b; baseline: plus the gather.
    w, b = 64 * 48 * 2, 48 * 4
    assert out["reshard"]["bytes"] == 2 * (w // 2 + b)
    assert out["gather_broadcast"]["bytes"] == out["plan_gather_broadcast_bytes"] == (w // 2) + 2 * w + 2 * b
    assert out["p2p_GBps"] > 0
    assert out["speedup"] == pytest.approx(out["gather_broadcast"]["seconds"] / out["reshard"]["seconds"])
    assert out["reshard_fraction_of_p2p"] == pytest.approx(out["reshard"]["GBps"] / out["p2p_GBps"])
    assert "progress" not in proc.stdout and "warm-up" in proc.stderr
