"""The executor's deltas over real gloo process groups: several versions, each sent as its
change against the previous one to the ranks that hold it, every destination bit-exact
against the version (digests checked on arrival); a rank left out of the receivers gets
full bytes; a receiver that does not hold the base fails the refit everywhere, nothing
wrong unpacked."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
import torch.distributed as dist

from elastic_refit.errors import TransportAborted, VerificationFailed
from elastic_refit.layout.models import ModelConfig
from elastic_refit.testing.pattern import allocate
from elastic_refit.testing.processes import run_local_world
from elastic_refit.testing.versions import version_buffers, version_problems
from elastic_refit.testing.world import RefitCase, make_transport
from elastic_refit.transport.buffers import byte_view
from elastic_refit.transport.executor import DeltaInputs, Executor, ExecutorOptions

TINY_MOE = ModelConfig(name="tiny-qwen3-moe", hidden_size=64, num_layers=2, vocab_size=130, num_heads=4,
                       num_kv_heads=2, head_dim=16, intermediate_size=0, num_experts=4,
                       moe_intermediate_size=32, qk_norm=True)
# 8 ranks, two domains of four: network messages between the domains, fan-out inside them
# (not relayed: a relay forwards bytes as they arrived, so relayed messages go in full).
CASE = RefitCase(model=TINY_MOE, source="tp=1,pp=2,dp=2,ep=2", destination="tp=2,dp=2", domain_size=4,
                 bucket_bytes=4096, direct_min_bytes=256, relay="off")
SENTINEL = 0xA5
DENSITY = 0.02


def _delta_rank(rank: int, world_size: int, store: dist.Store, case: RefitCase, left_out: int,
                torn: int) -> dict:
    plan = case.plan()
    transport = make_transport(dist.PrefixStore("delta", store), rank, world_size, "gloo", 30.0)
    executor = Executor(plan, transport, ExecutorOptions(verify=True, delta=True, staging_bytes=4 << 20))
    destinations = frozenset(plan.destination.ranks)
    dst = allocate(plan.destination, rank, fill=SENTINEL)
    base: dict = {}
    out = {"reports": [], "problems": [], "error": None}
    for version in range(4):
        src = version_buffers(plan.source, rank, version, density=DENSITY)
        receivers = destinations - {left_out} if version == 2 else destinations
        if version == 3 and rank == torn:
            for t in dst.values():  # this rank does not hold the base any more (where it changes)
                byte_view(t).reshape(-1).add_(1)
        inputs = DeltaInputs(base, receivers) if version else None
        try:
            report = executor.run(src, dst, delta=inputs)
        except (TransportAborted, VerificationFailed) as exc:
            out["error"] = (version, type(exc).__name__, str(exc).splitlines()[0])
            break
        out["reports"].append(asdict(report))
        out["problems"] += version_problems(plan.destination, rank, dst, version, density=DENSITY, fill=SENTINEL)
        base = src
    transport.abort()
    return out


@pytest.fixture(scope="module")
def results():
    plan = CASE.plan()
    torn = max(plan.destination.ranks)
    left_out = min(plan.destination.ranks)
    world = plan.topology.num_ranks
    return plan, left_out, torn, run_local_world(_delta_rank, world, (CASE, left_out, torn), timeout_s=240)


def test_every_version_is_bit_exact_and_deltas_are_smaller(results):
    _plan, left_out, _torn, ranks = results
    by_rank = {r.rank: r.value for r in ranks}
    for rank, out in by_rank.items():
        assert out["problems"] == [], (rank, out["problems"])
        assert len(out["reports"]) == 3, (rank, out["error"])
    # Version 0 in full; versions 1 and 2 as deltas from every source rank that sends.
    full = sum(out["reports"][0]["network_send_bytes"] for out in by_rank.values())
    assert sum(out["reports"][0]["num_delta_buckets"] for out in by_rank.values()) == 0
    for version in (1, 2):
        saved = sum(out["reports"][version]["network_saved_bytes"] for out in by_rank.values())
        assert sum(out["reports"][version]["num_delta_buckets"] for out in by_rank.values()) > 0
        # ~2% of elements changed: most bytes saved (version 2: one of four destinations in full)
        assert saved > (0.8 if version == 1 else 0.55) * full, (version, saved, full)
    # The fan-out inside each domain (from the destination ranks that received the bytes) too.
    fan_out = sum(out["reports"][1]["intra_send_bytes"] for out in by_rank.values())
    assert fan_out and sum(out["reports"][1]["intra_saved_bytes"] for out in by_rank.values()) > 0.8 * fan_out
    # Version 2 leaves one destination out of the receivers: it gets full bytes, and is exact.
    assert by_rank[left_out]["problems"] == []


def test_a_receiver_without_the_base_fails_the_refit_everywhere(results):
    _plan, _left_out, torn, ranks = results
    errors = {r.rank: r.value["error"] for r in ranks}
    assert all(e is not None and e[0] == 3 for e in errors.values()), errors
    assert "digest" in errors[torn][2] and "base differs" in errors[torn][2], errors[torn]


# The same refit relayed: each destination domain's network bytes reach one relay, which
# forwards its needers their boxes over the domain (the deltas' segments, as they arrived).
RELAYED = replace(CASE, relay="on")


@pytest.fixture(scope="module")
def relayed():
    plan = RELAYED.plan()
    world = plan.topology.num_ranks
    return plan, run_local_world(_delta_rank, world, (RELAYED, -1, max(plan.destination.ranks)), timeout_s=240)


def test_a_domain_with_a_rank_in_full_takes_its_relayed_bytes_in_full():
    """Version 2 leaves one destination rank out of the receivers: its domain's relayed
    messages go in full (the sender cannot tell its boxes from the relay's; here every
    destination rank is in that domain); version 3 goes as deltas again; every rank
    bit-exact."""
    plan = RELAYED.plan()
    left_out = min(plan.destination.ranks)
    ranks = run_local_world(_delta_rank, plan.topology.num_ranks, (RELAYED, left_out, -1), timeout_s=240)
    by_rank = {r.rank: r.value for r in ranks}
    for rank, out in by_rank.items():
        assert out["problems"] == [], (rank, out["problems"])
        assert len(out["reports"]) == 4, (rank, out["error"])
    saved = [sum(o["reports"][v]["network_saved_bytes"] for o in by_rank.values()) for v in (1, 2, 3)]
    assert saved[0] > 0 and saved[1] == 0 and saved[2] > 0, saved


def test_relayed_versions_go_as_deltas_through_the_relay_bit_exact(relayed):
    plan, ranks = relayed
    assert plan.relayed, "the plan relays"
    by_rank = {r.rank: r.value for r in ranks}
    for rank, out in by_rank.items():
        assert out["problems"] == [], (rank, out["problems"])
        assert len(out["reports"]) == 3, (rank, out["error"])
    full = sum(o["reports"][0]["network_send_bytes"] + o["reports"][0]["intra_send_bytes"] for o in by_rank.values())
    for version in (1, 2):
        saved = sum(o["reports"][version]["network_saved_bytes"] + o["reports"][version]["intra_saved_bytes"]
                    for o in by_rank.values())
        assert saved > 0.8 * full, (version, saved, full)  # network bytes and the relays' forwards alike
    errors = {r.rank: r.value["error"] for r in ranks}
    assert all(e is not None and e[0] == 3 for e in errors.values()), errors  # the torn needer fails everywhere


def _fp8_delta_rank(rank: int, world_size: int, store, spec_json: str) -> dict:
    """Versions of a quantized refit (BF16 sources, FP8 weights and scales at the
    destinations), each changing ~2% of the elements of the one before and, in version 2,
    one element large enough to move its block's scale: the senders compare what they
    quantize with what they quantized for the version before."""
    import json

    import numpy as np
    import torch

    from elastic_refit.layout import parse_spec
    from elastic_refit.plan import make_plan
    from elastic_refit.testing.inprocess import piece_slices, reference_destination
    from elastic_refit.testing.world import SENTINEL as FILL
    from tests.integration.test_executor import _finite_bf16

    spec = parse_spec(json.loads(spec_json))
    plan = make_plan(spec.source, spec.destination, spec.topology, formats=spec.destination_formats)
    q = plan.quantization
    tensors = {t.name: _finite_bf16(t.name, t.shape) for t in q.logical_source.tensors}
    transport = make_transport(dist.PrefixStore("fp8delta", store), rank, world_size, "gloo", 20.0)
    executor = Executor(plan, transport, ExecutorOptions(staging_bytes=1 << 20, verify=True, delta=True))
    dst = allocate(plan.destination, rank, fill=FILL)
    g = torch.Generator().manual_seed(5)
    out = {"problems": [], "saved": []}
    for version in range(4):
        if version:
            for t in tensors.values():
                flat = t.view(-1)
                picked = torch.rand(flat.numel(), generator=g) < 0.02
                flat[picked] = (flat[picked].float() * 1.01).to(torch.bfloat16)
                if version == 2:
                    flat[0] = 1000.0  # its block's scale moves: every byte of the block changes
        src = allocate(q.logical_source, rank, fill=0)
        for p in np.flatnonzero(q.logical_source.piece_rank == rank).tolist():
            (_, buffer), global_slices, local_slices = piece_slices(q.logical_source, p)
            name = q.logical_source.tensors[int(q.logical_source.piece_tensor[p])].name
            src[buffer][local_slices].copy_(tensors[name][global_slices].reshape(src[buffer][local_slices].shape))
        inputs = DeltaInputs({}, frozenset(plan.destination.ranks) if version else frozenset(), version=version,
                             base_version=version - 1 if version else None)
        report = executor.run(src, dst, delta=inputs)
        out["saved"].append(report.network_saved_bytes + report.intra_saved_bytes)
        want = reference_destination(plan, {n: t.view(torch.int16).numpy().view(np.uint16) for n, t in tensors.items()})
        for p in np.flatnonzero(plan.destination.piece_rank == rank).tolist():
            (_, buffer), global_slices, local_slices = piece_slices(plan.destination, p)
            name = plan.destination.tensors[int(plan.destination.piece_tensor[p])].name
            got = byte_view(dst[buffer][local_slices].contiguous()).numpy()
            expected = np.ascontiguousarray(want[name][global_slices]).view(np.uint8).reshape(got.shape)
            if not np.array_equal(got, expected):
                out["problems"].append(f"version {version} rank {rank} {name}: {int((got != expected).sum())} bytes")
    transport.abort()
    return out


def test_quantized_versions_go_as_deltas_of_what_the_senders_quantized():
    from tests.integration.test_executor import FP8_SPEC

    results = run_local_world(_fp8_delta_rank, 5, (FP8_SPEC,), timeout_s=180)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.error}"
        assert r.value["problems"] == [], r.value["problems"]
    saved = [sum(r.value["saved"][v] for r in results) for v in range(4)]
    assert saved[0] == 0 and all(s > 0 for s in saved[1:]), saved
