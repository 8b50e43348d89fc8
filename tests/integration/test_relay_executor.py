"""Relayed plans on real gloo process groups: regions received by a rank that does not
need them and forwarded over the domain bucket by bucket, bit-exact, padding untouched,
and every rank's bytes (network and intra-domain, each way) equal to the plan's."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest

from elastic_refit.plan import Plan, PlanOptions, SourceSide, TransferKind, make_plan
from elastic_refit.testing.processes import run_local_world
from elastic_refit.testing.world import RefitCase, WorkerOptions, refit_rank

from ..unit.relay_cases import RELAY_SPEC
from .faults import CorruptFirstSend
from .test_executor import TINY_MLA, TINY_MOE, UNEVEN_COLOCATED, assert_bit_exact_with_planned_bytes


@dataclass(frozen=True)
class RelayedCase(RefitCase):
    """A ``RefitCase`` planned with ``PlanOptions(relay="on")``."""

    def plan(self) -> Plan:
        spec = self.build()
        return make_plan(spec.source, spec.destination, spec.topology,
                         PlanOptions(bucket_bytes=self.bucket_bytes, direct_min_bytes=self.direct_min_bytes,
                                     concurrent_rounds=self.concurrent_rounds, relay="on"))


CASES = {
    # a lone needer relieved by three relays; small buckets: forwards span many buckets and gather runs
    "lone-needer-small-buckets": RelayedCase(spec_json=json.dumps(RELAY_SPEC), bucket_bytes=256),
    # the same in one bucket per message; contiguous forwards go straight from staging
    "lone-needer-one-bucket": RelayedCase(spec_json=json.dumps(RELAY_SPEC), bucket_bytes=1 << 20),
    # stacked experts re-sliced from EP to TP, direct chunks in the messages that forward nothing
    "moe-pp2ep2-to-tp2": RelayedCase(model=TINY_MOE, source="tp=1,pp=2,dp=2,ep=2", destination="tp=2,dp=1",
                                     domain_size=2, bucket_bytes=4096, direct_min_bytes=256),
    # colocated MLA with two rounds in flight at once
    "mla-colocated-two-rounds": RelayedCase(model=TINY_MLA, source="tp=1,pp=2,dp=2,ep=2", destination="tp=2,dp=2",
                                            domain_size=2, colocate=True, bucket_bytes=16384, direct_min_bytes=64,
                                            concurrent_rounds=2),
    # uneven shards, odd domain map, tiny buckets
    "spec-uneven-colocated": RelayedCase(spec_json=UNEVEN_COLOCATED, bucket_bytes=64),
}


def relayed_bytes(plan: Plan) -> int:
    """Bytes received over the network by ranks that need none of them."""
    t = plan.transfers
    staged = (t.kind == int(TransferKind.NETWORK)) & (t.dst_piece < 0)
    return int((t.nbytes * t.instances)[staged].sum())


@pytest.mark.parametrize("name", list(CASES))
def test_relayed_refit_is_bit_exact_and_moves_the_planned_bytes(name):
    case = CASES[name]
    plan = case.plan()
    assert np.any(plan.transfers.src_side == int(SourceSide.RELAY)), "the case forwards nothing"
    results = run_local_world(refit_rank, case.build().topology.num_ranks, (case, WorkerOptions(timeout_s=30)),
                              timeout_s=180)
    assert_bit_exact_with_planned_bytes(results, plan)


def test_regions_received_by_a_rank_that_does_not_need_them_are_forwarded():
    case = CASES["lone-needer-small-buckets"]
    plan = case.plan()
    assert relayed_bytes(plan) > 0
    t = plan.transfers
    staged = np.flatnonzero((t.kind == int(TransferKind.NETWORK)) & (t.dst_piece < 0))
    relays = set(t.dst_rank[staged].tolist())
    assert relays and 4 not in relays  # ranks 5-7 receive shards of "big" for rank 4
    results = run_local_world(refit_rank, plan.topology.num_ranks, (case, WorkerOptions(timeout_s=30, verify=True)),
                              timeout_s=180)
    assert_bit_exact_with_planned_bytes(results, plan)
    for r in results:
        report = r.value["report"]
        if r.rank in relays:  # relays send over the domain what they received for others
            assert report["intra_send_bytes"] > 0 and report["network_recv_bytes"] > 0
        assert report["staging_bytes"] <= r.value["staging_limit"]


@pytest.mark.parametrize("verify", [False, True])
def test_relayed_refit_stays_within_a_tight_staging_budget(verify):
    # Buckets of 256 bytes carry at most 128 bytes here: a relay needs its two buffers of the
    # network message and nothing more (it forwards straight from them); rank 4 takes its
    # forwards straight into its parameter, and checks their digests there when verifying
    # (the digest trailers of the network buckets need a little more).
    case = CASES["lone-needer-small-buckets"]
    plan = case.plan()
    budget = 512 if verify else 256
    results = run_local_world(refit_rank, plan.topology.num_ranks,
                              (case, WorkerOptions(timeout_s=30, staging_bytes=budget, verify=verify)),
                              timeout_s=120)
    assert_bit_exact_with_planned_bytes(results, plan)
    assert all(r.value["report"]["staging_bytes"] <= budget for r in results)
    # verified network buckets land in staging with their trailers (two buffers of 128 bytes and
    # one digest each); the forwards, verified or not, take none
    assert results[4].value["report"]["staging_bytes"] == (2 * (128 + 8) if verify else 0)


def test_a_corrupted_forward_fails_the_needers_digest_check():
    # Rank 5 relays shards of "big" that only rank 4 needs (and forwards "rep" to its domain):
    # its first send, a forward, carries one flipped byte. The relay checked the bytes on
    # arrival and passes their digests on; the needer's check names the box and the buffer.
    case = CASES["lone-needer-small-buckets"]
    plan = case.plan()
    t = plan.transfers
    assert np.all(t.src_side[t.src_rank == 5] == int(SourceSide.RELAY)), "rank 5 sends only forwards"
    world = plan.topology.num_ranks
    results = run_local_world(refit_rank, world, (case, WorkerOptions(timeout_s=10, verify=True)),
                              timeout_s=120, per_rank_args=[(CorruptFirstSend(rank=5),)] * world)
    kinds = {r.rank: r.error_type for r in results}
    assert not any(r.ok for r in results), kinds
    caught = [r for r in results if r.error_type == "VerificationFailed"]
    assert caught and set(kinds.values()) <= {"VerificationFailed", "TransportAborted"}, kinds
    for r in caught:
        assert r.rank in set(t.dst_rank[(t.src_rank == 5) & (t.src_side == int(SourceSide.RELAY))].tolist())
        assert "forward from rank 5" in r.error and "of buffer '" in r.error and "arrived with digest" in r.error, \
            r.error
