"""The executor over real gloo process groups: bit-exact refits, bytes per rank equal to
the plan, the staging budget, and failures that surface as TransportAborted everywhere."""

from __future__ import annotations

import json
import time

import pytest
from elastic_refit.kernels import _triton_backend

from elastic_refit.layout.models import ModelConfig
from elastic_refit.plan import TransferKind
from elastic_refit.testing.processes import run_local_world
from elastic_refit.testing.world import RefitCase, WorkerOptions, refit_rank

from .faults import CorruptFirstSend, FailAfterSends

TINY_DENSE = ModelConfig(name="tiny-llama", hidden_size=64, num_layers=3, vocab_size=250, num_heads=4,
                         num_kv_heads=2, head_dim=16, intermediate_size=96)
TINY_MOE = ModelConfig(name="tiny-qwen3-moe", hidden_size=64, num_layers=2, vocab_size=130, num_heads=4,
                       num_kv_heads=2, head_dim=16, intermediate_size=0, num_experts=4,
                       moe_intermediate_size=32, qk_norm=True)
TINY_MLA = ModelConfig(name="tiny-deepseek", hidden_size=64, num_layers=3, vocab_size=128, num_heads=4,
                       num_kv_heads=4, head_dim=16, intermediate_size=96, num_experts=4,
                       moe_intermediate_size=16, num_shared_experts=1, first_k_dense=1, router_bias=True,
                       q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)

UNEVEN_COLOCATED = json.dumps({
    "domains": [0, 0, 1, 1, 2],
    "tensors": [
        {"name": "uneven", "shape": [11, 7], "dtype": "float32",
         "source": {"mesh": [0, 1, 2], "placements": ["S(0)"]},
         "destination": {"mesh": [[1, 2], [3, 4]], "placements": ["S(1)", "S(0)"]}},
        {"name": "fanout", "shape": [6, 5], "dtype": "bfloat16",
         "source": {"mesh": [4], "placements": ["R"]},
         "destination": {"mesh": [0, 1], "placements": ["R"]}},
        {"name": "stacked", "shape": [3, 4, 10], "dtype": "int8",
         "source": {"mesh": [[0], [1]], "placements": ["R", "S(2)"]},
         "destination": {"mesh": [2, 3, 4], "placements": ["S(0)"]}},
    ],
})

CASES = {
    # fused QKV (GQA interleave on the source), PP stages, vocab padding, fan-out in a domain
    "dense-tp2pp2-to-tp2dp2": RefitCase(model=TINY_DENSE, source="tp=2,pp=2", destination="tp=2,dp=2",
                                        domain_size=4, bucket_bytes=8192),
    # stacked experts re-sliced from EP to TP
    "moe-pp2ep2-to-tp2": RefitCase(model=TINY_MOE, source="tp=1,pp=2,dp=2,ep=2", destination="tp=2,dp=1",
                                   domain_size=2, bucket_bytes=4096, direct_min_bytes=256),
    # MLA, shared experts, colocated training and inference on the same ranks
    "mla-colocated": RefitCase(model=TINY_MLA, source="tp=1,pp=2,dp=2,ep=2", destination="tp=2,dp=2",
                               domain_size=2, colocate=True, bucket_bytes=16384, direct_min_bytes=64),
    # uneven torch.chunk shards, colocated ranks, odd domain map, int8
    "spec-uneven-colocated": RefitCase(spec_json=UNEVEN_COLOCATED, bucket_bytes=64),
}
# The same layouts with several rounds of a phase in flight at once (PlanOptions.concurrent_rounds).
CONCURRENT_CASES = {
    # every round of a phase in flight at once (windows of rounds), with packing and fan-out
    "dense-all-rounds-at-once": RefitCase(model=TINY_DENSE, source="tp=2,pp=2", destination="tp=2,dp=2",
                                          domain_size=4, bucket_bytes=8192, concurrent_rounds=8),
    # windows of two rounds, uneven shards, colocated ranks, tiny buckets
    "spec-uneven-two-rounds-at-once": RefitCase(spec_json=UNEVEN_COLOCATED, bucket_bytes=64, concurrent_rounds=2),
}
ALL_CASES = {**CASES, **CONCURRENT_CASES}


def _world_size(case: RefitCase) -> int:
    return case.build().topology.num_ranks


@pytest.mark.parametrize("name", list(ALL_CASES))
def test_refit_is_bit_exact_and_moves_the_planned_bytes(name):
    case = ALL_CASES[name]
    plan = case.plan()
    results = run_local_world(refit_rank, _world_size(case), (case, WorkerOptions(timeout_s=30)), timeout_s=180)
    assert_bit_exact_with_planned_bytes(results, plan)


def assert_bit_exact_with_planned_bytes(results, plan) -> None:
    """Every rank verified its destination bytes and moved exactly its share of the plan."""
    failed = [r for r in results if not r.ok]
    # Every failed rank, the earliest first (its peers' failures follow from it): the
    # first by rank order alone was often a bystander.
    assert not failed, "\n".join(f"rank {r.rank} after {r.seconds:.1f} s: {r.error_type}: {r.error}"
                                  for r in sorted(failed, key=lambda r: r.seconds))
    for r in results:
        assert r.value["problems"] == [], r.value["problems"]
        assert r.value["fingerprint"] == plan.fingerprint
        report = r.value["report"]
        assert report["network_send_bytes"] == plan.network_send_bytes[r.rank]
        assert report["network_recv_bytes"] == plan.network_recv_bytes[r.rank]
        assert report["intra_send_bytes"] == plan.intra_send_bytes[r.rank]
        assert report["intra_recv_bytes"] == plan.intra_recv_bytes[r.rank]
    t = plan.transfers
    local = t.kind == int(TransferKind.LOCAL)
    assert sum(r.value["report"]["local_bytes"] for r in results) == int((t.nbytes * t.instances)[local].sum())


def _fused_digests_rank(rank: int, world_size: int, store, *args) -> dict:
    """``refit_rank`` with every bucket's digests taken by the GPU's one-launch kernel
    (``kernels.digests``), run by Triton's interpreter on the CPU."""
    from elastic_refit.kernels import digests

    digests._interpret_cpu = True  # this process only (a forked rank)
    return refit_rank(rank, world_size, store, *args)


DIGEST_FORMS = [pytest.param(refit_rank, id="per-box"),
                pytest.param(_fused_digests_rank, id="fused", marks=pytest.mark.skipif(
                    not _triton_backend.HAVE_TRITON, reason="Triton is not installed"))]


@pytest.mark.parametrize("rank_fn", DIGEST_FORMS)
def test_verify_mode_checks_every_box(rank_fn):
    case = CASES["spec-uneven-colocated"]
    results = run_local_world(rank_fn, _world_size(case), (case, WorkerOptions(verify=True)), timeout_s=120)
    assert all(r.ok and not r.value["problems"] for r in results), [r.error for r in results if not r.ok]
    plan = case.plan()
    received = sum(r.value["report"]["num_verified_boxes"] for r in results)
    nonlocal_copies = int(plan.transfers.instances[plan.transfers.kind != int(TransferKind.LOCAL)].sum())
    assert received == nonlocal_copies


def test_staging_stays_within_budget():
    case = RefitCase(model=TINY_DENSE, source="tp=2,pp=2", destination="tp=2,dp=2", domain_size=4,
                     bucket_bytes=4096)
    budget = 4 * 4096
    results = run_local_world(refit_rank, 8, (case, WorkerOptions(staging_bytes=budget)), timeout_s=120)
    for r in results:
        assert r.ok, r.error
        assert not r.value["problems"]
        assert r.value["report"]["staging_bytes"] <= budget
    assert any(r.value["report"]["staging_bytes"] > 0 for r in results)  # some rank packed
    assert sum(r.value["report"]["num_buckets"] for r in results) > 50  # the budget forced many buckets


def test_budget_too_small_for_the_plan_is_a_clear_error():
    case = RefitCase(model=TINY_DENSE, source="tp=2,pp=2", destination="tp=2,dp=2", domain_size=4,
                     bucket_bytes=1 << 20)
    results = run_local_world(refit_rank, 8, (case, WorkerOptions(staging_bytes=4096, timeout_s=5)), timeout_s=60)
    errors = [r for r in results if not r.ok and r.error_type == "ValueError"]
    assert errors and "staging" in errors[0].error and "bucket_bytes" in errors[0].error


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_a_failing_rank_aborts_every_other_rank(mode):
    case = CASES["dense-tp2pp2-to-tp2dp2"]
    timeout = 8.0
    victim = 1
    start = time.monotonic()
    results = run_local_world(refit_rank, 8, (case, WorkerOptions(timeout_s=timeout)),
                              timeout_s=90, per_rank_args=[(FailAfterSends(victim, after=3, mode=mode),)] * 8)
    elapsed = time.monotonic() - start
    victim_result = results[victim]
    assert not victim_result.ok
    if mode == "kill":
        assert victim_result.exitcode == -9
    else:
        assert "injected: failure on rank" in victim_result.error
    for r in results:
        if r.rank == victim:
            continue
        assert not r.ok, f"rank {r.rank} finished a refit that another rank failed"
        assert r.error_type == "TransportAborted", f"rank {r.rank}: {r.error_type}: {r.error}"
    # every survivor failed within the collective timeout (plus process start-up)
    assert max(r.seconds for r in results if r.rank != victim) < timeout + 30
    assert elapsed < 90


@pytest.mark.parametrize("rank_fn", DIGEST_FORMS)
def test_corrupted_bytes_are_detected_never_silent(rank_fn):
    case = CASES["spec-uneven-colocated"]
    results = run_local_world(rank_fn, _world_size(case), (case, WorkerOptions(verify=True, timeout_s=10)),
                              timeout_s=120, per_rank_args=[(CorruptFirstSend(rank=0),)] * _world_size(case))
    kinds = {r.rank: r.error_type for r in results}
    assert not any(r.ok for r in results), kinds
    assert "VerificationFailed" in kinds.values(), kinds
    assert set(kinds.values()) <= {"VerificationFailed", "TransportAborted"}, kinds


def _refuse_then_refit(rank: int, world_size: int, store, case: RefitCase, refuser: int) -> dict:
    """Two refits on one transport: in the first, ``refuser``'s check before the closing vote
    fails; the second has no check and must come through bit-exact."""
    import torch.distributed as dist

    from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces
    from elastic_refit.testing.world import SENTINEL, make_transport
    from elastic_refit.transport.buffers import byte_view
    from elastic_refit.transport.executor import Executor, ExecutorOptions

    plan = case.plan()
    transport = make_transport(dist.PrefixStore("refuse", store), rank, world_size, "gloo", 20.0)
    executor = Executor(plan, transport, ExecutorOptions(staging_bytes=1 << 20, verify=True))
    src = allocate(plan.source, rank, fill=0)
    dst = allocate(plan.destination, rank, fill=SENTINEL)
    fill_pieces(plan.source, rank, src, seed=7)
    checked = []

    def check() -> None:
        checked.append(rank)
        if rank == refuser:
            raise ValueError(f"rank {rank}: refused")

    try:
        executor.run(src, dst, before_vote=check)
        first = "ok"
    except Exception as exc:
        first = f"{type(exc).__name__}: {exc}"
    for tensor in dst.values():
        byte_view(tensor).fill_(SENTINEL)
    executor.run(src, dst)  # the communicator is intact: the next refit needs no rebuild
    problems = check_pieces(plan.destination, rank, dst, seed=7)
    transport.abort()
    return {"first": first, "checked": checked, "problems": problems}


def test_a_check_that_fails_before_the_closing_vote_fails_every_rank_and_keeps_the_communicator():
    """The runtime checks its sources there (SourceChanged): the refusing rank raises its own
    error, every other rank ``TransferRefused`` (a clean vote, not an abort), and the same
    transport then moves the next refit bit-exact."""
    case = CASES["spec-uneven-colocated"]
    world = _world_size(case)
    results = run_local_world(_refuse_then_refit, world, (case, 0), timeout_s=120)
    assert all(r.ok for r in results), [(r.rank, r.error) for r in results if not r.ok]
    by_rank = {r.rank: r.value for r in results}
    assert by_rank[0]["first"] == "ValueError: rank 0: refused", by_rank[0]
    for rank, value in by_rank.items():
        assert value["checked"] == [rank] and not value["problems"], (rank, value)
        if rank:
            assert value["first"] == (f"TransferRefused: rank {rank}: another rank voted the refit down at "
                                      "its close"), (rank, value)


FP8_SPEC = json.dumps({
    "domains": [0, 0, 1, 1, 2],
    "tensors": [
        # rows cut at 14 and 28 (torch.chunk of 40 in 3) split 16-row blocks across source
        # ranks of two domains: the partial-amax exchange; columns cut at 12 mid-block
        {"name": "layers.0.proj.weight", "shape": [40, 24], "dtype": "bfloat16",
         "source": {"mesh": [0, 1, 2], "placements": ["S(0)"]},
         "destination": {"mesh": [3, 4], "placements": ["S(1)"], "format": "fp8-block16"}},
        # replicated source, stacked experts, MX blocks along the last dim
        {"name": "layers.0.experts.weight", "shape": [2, 8, 70], "dtype": "bfloat16",
         "source": {"mesh": [1, 2], "placements": ["R"]},
         "destination": {"mesh": [3, 4], "placements": ["S(0)"], "format": "mxfp8"}},
        {"name": "norm.weight", "shape": [6], "dtype": "bfloat16",
         "source": {"mesh": [0], "placements": ["R"]},
         "destination": {"mesh": [3, 4], "placements": ["R"]}},
    ],
})


def _finite_bf16(name: str, shape):
    import zlib

    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 8, shape, generator=g).float())
    if "zero" in name:  # all-zero blocks (their scale is 1.0) beside ordinary ones
        x[..., : shape[-2] // 2, :] = 0
    return x.to(torch.bfloat16)


def _fp8_refit(rank: int, world_size: int, store, spec_json: str, verify: bool, backend: str = "gloo",
               pack_backend: str = "auto", poison: tuple[str, tuple[int, ...]] | None = None) -> dict:
    """One rank of a quantized refit: BF16 sources in, FP8 weights and scales out, compared
    byte for byte with the CPU reference quantizer of every whole tensor. On an NCCL
    ``backend`` the buffers live on the rank's GPU (the senders quantize there).
    ``poison``: (tensor, element) made NaN in the sources. ``fused``: the pieces this rank
    quantized with the fused kernel."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from elastic_refit.layout import parse_spec
    from elastic_refit.plan import make_plan
    from elastic_refit.testing.inprocess import piece_slices, reference_destination
    from elastic_refit.testing.pattern import allocate
    from elastic_refit.testing.world import SENTINEL, leave_together, make_transport
    from elastic_refit.transport.buffers import byte_view
    from elastic_refit.transport.executor import Executor, ExecutorOptions

    spec = parse_spec(json.loads(spec_json))
    plan = make_plan(spec.source, spec.destination, spec.topology, formats=spec.destination_formats)
    q = plan.quantization
    tensors = {t.name: _finite_bf16(t.name, t.shape) for t in q.logical_source.tensors}
    if poison is not None:
        tensors[poison[0]][poison[1]] = float("nan")
    transport = make_transport(dist.PrefixStore("fp8", store), rank, world_size, backend, 20.0)
    src = allocate(q.logical_source, rank, fill=0, device=transport.device)
    for p in np.flatnonzero(q.logical_source.piece_rank == rank).tolist():
        (_, buffer), global_slices, local_slices = piece_slices(q.logical_source, p)
        name = q.logical_source.tensors[int(q.logical_source.piece_tensor[p])].name
        region = src[buffer][local_slices]
        region.copy_(tensors[name][global_slices].reshape(region.shape))
    dst = allocate(plan.destination, rank, fill=SENTINEL, device=transport.device)
    outcome = "failed"
    try:
        options = ExecutorOptions(staging_bytes=1 << 20, verify=verify, pack_backend=pack_backend)
        executor = Executor(plan, transport, options)
        report = executor.run(src, dst)
        outcome = "done"
    finally:
        # the closing vote may still be in flight to a slower peer (NCCL's socket proxy)
        leave_together(store, rank, world_size, 60.0, outcome=outcome)
        transport.abort()
    want = reference_destination(plan, {n: t.view(torch.int16).numpy().view(np.uint16) for n, t in tensors.items()})
    problems = []
    for p in np.flatnonzero(plan.destination.piece_rank == rank).tolist():
        (_, buffer), global_slices, local_slices = piece_slices(plan.destination, p)
        name = plan.destination.tensors[int(plan.destination.piece_tensor[p])].name
        got = byte_view(dst[buffer][local_slices].contiguous()).cpu().numpy()
        expected = np.ascontiguousarray(want[name][global_slices]).view(np.uint8).reshape(got.shape)
        if not np.array_equal(got, expected):
            problems.append(f"rank {rank} {name} {plan.destination.piece(p).box}: {int((got != expected).sum())} bytes")
    return {"problems": problems, "fused": executor._quantizer.num_fused_regions, "report": report.__dict__
            if hasattr(report, "__dict__") else {f: getattr(report, f) for f in report.__dataclass_fields__}}


@pytest.mark.parametrize("verify", [False, True])
def test_fp8_refit_over_gloo_is_bit_exact_with_the_reference_quantizer(verify):
    from elastic_refit.layout import parse_spec
    from elastic_refit.plan import make_plan

    spec = parse_spec(json.loads(FP8_SPEC))
    plan = make_plan(spec.source, spec.destination, spec.topology, formats=spec.destination_formats)
    assert len(plan.quantization.amax) and plan.quantization.amax.bytes_of(int(TransferKind.NETWORK)) > 0
    results = run_local_world(_fp8_refit, 5, (FP8_SPEC, verify), timeout_s=120)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}"
        assert r.value["problems"] == [], r.value["problems"]
        report = r.value["report"]
        # the executor's figures are the plan's, FP8 bytes and scales (the exchange aside)
        amax = plan.quantization.amax
        net = int(TransferKind.NETWORK)
        sent = int(amax.nbytes[(amax.provider == r.rank) & (amax.kind == net)].sum())
        got = int(amax.nbytes[(amax.consumer == r.rank) & (amax.kind == net)].sum())
        assert report["network_send_bytes"] == plan.network_send_bytes[r.rank] - sent
        assert report["network_recv_bytes"] == plan.network_recv_bytes[r.rank] - got
    if verify:
        nonlocal_copies = int(plan.transfers.instances[plan.transfers.kind != int(TransferKind.LOCAL)].sum())
        assert sum(r.value["report"]["num_verified_boxes"] for r in results) == nonlocal_copies


# Whole-block pieces (the fused kernel's) beside pieces whose blocks the shards cut: 48 rows
# in 3 shards of 16, all-zero blocks in the first half; 56 rows cut at 19 and 38 and 40
# columns cut at 14 and 28 (split blocks at a shard's top, bottom, left edge: the torch
# path's, after the exchange; the whole blocks inside a shard: the kernel's).
FP8_MIXED_SPEC = json.dumps({
    "domains": [0, 0, 1, 1, 2],
    "tensors": [
        {"name": "layers.0.zero_proj.weight", "shape": [48, 40], "dtype": "bfloat16",
         "source": {"mesh": [0, 1, 2], "placements": ["S(0)"]},
         "destination": {"mesh": [3, 4], "placements": ["S(1)"], "format": "fp8-block16"}},
        {"name": "layers.0.proj.weight", "shape": [56, 24], "dtype": "bfloat16",
         "source": {"mesh": [0, 1, 2], "placements": ["S(0)"]},
         "destination": {"mesh": [3, 4], "placements": ["S(0)"], "format": "fp8-block16"}},
        {"name": "layers.0.cols_proj.weight", "shape": [32, 40], "dtype": "bfloat16",
         "source": {"mesh": [0, 1, 2], "placements": ["S(1)"]},
         "destination": {"mesh": [3, 4], "placements": ["S(0)"], "format": "fp8-block16"}},
        {"name": "layers.0.experts.weight", "shape": [2, 8, 70], "dtype": "bfloat16",
         "source": {"mesh": [1, 2], "placements": ["S(0)"]},
         "destination": {"mesh": [3, 4], "placements": ["R"], "format": "mxfp8"}},
    ],
})

needs_triton = pytest.mark.skipif(not _triton_backend.HAVE_TRITON, reason="triton not installed")


@needs_triton
def test_fp8_refit_with_the_fused_kernel_is_bit_exact():
    """``pack_backend="triton"`` (the interpreter here): whole-block pieces quantize in the
    fused kernel, split ones on the torch path; every FP8 byte and scale is the reference
    quantizer's (which the torch backend's are, above)."""
    results = run_local_world(_fp8_refit, 5, (FP8_MIXED_SPEC, True, "gloo", "triton"), timeout_s=240)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}"
        assert r.value["problems"] == [], r.value["problems"]
    # ranks 0-2: a shard of zero_proj; ranks 1-2: an expert; ranks 0 and 2: the whole blocks
    # of their proj shard; rank 2: those of its cols_proj shard
    assert [r.value["fused"] for r in results] == [2, 2, 4, 0, 0]


@needs_triton
@pytest.mark.parametrize(("tensor", "element"), [("layers.0.zero_proj.weight", (40, 33)),
                                                  ("layers.0.proj.weight", (17, 3))])
def test_fp8_refit_refuses_a_nan_block_on_its_sender_alike_on_both_paths(tensor, element):
    """A NaN in a fused block or a split one: its sender raises ``NonFiniteBlockError``
    naming the tensor and block, with the torch backend's very message."""
    errors = {}
    for pack_backend in ("torch", "triton"):
        results = run_local_world(_fp8_refit, 5, (FP8_MIXED_SPEC, False, "gloo", pack_backend, (tensor, element)),
                                  timeout_s=240)
        errors[pack_backend] = {r.rank: r.error.strip().splitlines()[-1] for r in results
                                if r.error_type == "NonFiniteBlockError"}  # the message, not the traceback
        assert errors[pack_backend] and not any(r.ok for r in results), [(r.rank, r.error_type) for r in results]
        assert all(tensor in e for e in errors[pack_backend].values()), errors
    assert errors["triton"] == errors["torch"]


@pytest.mark.parametrize("pack_backend", ["auto", pytest.param("triton", marks=needs_triton)])
def test_fp8_bench_of_a_fused_moe_preset_is_verified(pack_backend):
    """``elastic-refit bench --destination-format`` on a Megatron -> vLLM MoE preset (q, k
    and v fused in one buffer, gate and up too, so their scale buffers are shared): every
    FP8 byte and scale each destination rank holds is the reference quantizer's, with the
    torch path and with the fused kernel (interpreted)."""
    import dataclasses

    from elastic_refit.layout.presets import checkpoint_formats
    from elastic_refit.testing.world import BenchOptions, bench_rank

    case = RefitCase(model=TINY_MOE, source="tp=2,pp=2,ep=2", destination="tp=2,dp=2", domain_size=8,
                     bucket_bytes=8192)
    case = dataclasses.replace(case, formats_json=checkpoint_formats(TINY_MOE, "fp8-block16").to_json())
    options = BenchOptions(backend="gloo", timeout_s=60, repeat=1, warmup=0, p2p_bytes=1 << 16,
                           pack_backend=pack_backend)
    results = run_local_world(bench_rank, _world_size(case), (case, options), timeout_s=240)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}"
        assert r.value["reshard_fp8"]["problems"] == [], r.value["reshard_fp8"]["problems"]
        assert r.value["reshard"]["problems"] == [], r.value["reshard"]["problems"]
