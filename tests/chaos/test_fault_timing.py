"""The chaos matrix's stall length against the runtime's timeouts (pure: no etcd, no
processes). stall>ttl must stall past the lease TTL and end clearly before the peers'
transport timeout: a stall that ends with that timeout makes the cell's recovery bimodal
(~3.05 s or 3.3-3.44 s at TTL 2 s, against a bound of TTL + 1.5 s)."""

from __future__ import annotations

from elastic_refit.chaos.faults import PEER_TIMEOUT_S, TTL_S, build_matrix

from elastic_refit.runtime.config import RefitConfig

# What the stalled member needs after its stall to post its first message (a plan already
# agreed; the machine loaded): the least margin before its peers give up on it.
MARGIN_S = 0.25


def test_the_peers_timeout_is_the_runtimes():
    config = RefitConfig(job="j", role="trainer", member_id="t0", layout_rank=0, etcd=("127.0.0.1:2379",),
                         ttl_s=int(TTL_S))
    assert config.transport_timeout_s == PEER_TIMEOUT_S


def test_a_stall_outlasts_the_lease_ttl_and_ends_well_before_the_peers_give_up():
    stalls = [f for s in build_matrix("full", trials=200, etcd_nodes=3) for f in s.plan.faults if f.kind == "stall"]
    assert stalls, "the full matrix has no stall cell"
    for fault in stalls:
        assert TTL_S < fault.duration_s <= PEER_TIMEOUT_S - MARGIN_S, fault
