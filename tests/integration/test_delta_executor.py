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
