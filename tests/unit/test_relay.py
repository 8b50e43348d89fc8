"""Relayed plans (``PlanOptions.relay``): ingress balance over every NIC of a destination
domain, forwards that travel with their network bucket, the cost model and its bound.

Checked as data, independently of the planner's machinery: every destination byte (a
forward reads what its network row read), each element written once, padding untouched,
cross-domain bytes at the brute-force lower bound, and no NIC of a domain above the
balanced share plus one region; per-rank schedules move exactly the plan's bytes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from elastic_refit.layout import parse_spec
from elastic_refit.plan import Plan, PlanOptions, SourceSide, TransferKind, cost, make_plan
from elastic_refit.plan.cost import bound_seconds, get_cluster, predict
from elastic_refit.testing.inprocess import (
    allocate_buffers,
    check_pieces,
    piece_slices,
    scatter_tensors,
)
from elastic_refit.transport.schedule import build_rank_schedule

from .plan_oracle import (
    SENTINEL,
    assert_network_rows_cross_domains,
    assert_written_once,
    brute_force_lower_bound,
    random_tensors,
)
from .relay_cases import RELAY_SPEC
from .test_planner import _assert_replan_is_cold, refit_cases, repeated_refit_cases


def relay_spec():
    return parse_spec(json.loads(json.dumps(RELAY_SPEC)))


# ---- an independent reading of a relayed plan ------------------------------------------------


def resolved_copies(plan: Plan):
    """Every copy of ``plan`` with the source it finally reads: a forward reads what its
    network row read (checked to be the same tensor and box, arriving at the forwarding
    rank). Returns (expanded copies, source side, source piece) per copy."""
    t = plan.transfers
    x = plan.expand()
    side = t.src_side[x.row].copy()
    src_piece = x.src_piece.copy()
    forward = np.flatnonzero(side == int(SourceSide.RELAY))
    if forward.size:
        num_tensors = len(plan.destination.tensors)
        key = x.row * num_tensors + x.tensor
        order = np.argsort(key, kind="stable")
        wanted = x.src_piece[forward] * num_tensors + x.tensor[forward]
        parent = order[np.searchsorted(key[order], wanted)]
        assert np.array_equal(key[parent], wanted), "a forward's network copy is missing"
        rows, parent_rows = x.row[forward], x.row[parent]
        assert np.all(t.kind[parent_rows] == int(TransferKind.NETWORK))
        assert np.all(t.kind[rows] == int(TransferKind.INTRA))
        assert np.all(t.dst_rank[parent_rows] == t.src_rank[rows]), "forwarded by a rank that did not receive it"
        assert np.array_equal(t.offsets[parent_rows], t.offsets[rows])
        assert np.array_equal(t.lengths[parent_rows], t.lengths[rows])
        assert np.array_equal(t.round[parent_rows], t.round[rows])
        assert np.array_equal(x.message_offset[parent], x.message_offset[forward])
        side[forward] = t.src_side[parent_rows]
        src_piece[forward] = x.src_piece[parent]
    return x, side, src_piece


def execute_relayed(plan: Plan, source_buffers, destination_buffers) -> np.ndarray:
    """Write every destination copy from the source it finally reads; returns the number of
    writes per destination element, per buffer (a dict like the buffers)."""
    x, side, src_piece = resolved_copies(plan)
    t = plan.transfers
    counts = {key: np.zeros(buf.shape, dtype=np.int64) for key, buf in destination_buffers.items()}
    k = max(plan.source.ndim, plan.destination.ndim)
    # fan-outs (without relay) read what the deliver phase wrote: run them last
    for i in np.argsort(side == int(SourceSide.DESTINATION), kind="stable").tolist():
        if x.dst_piece[i] < 0:
            continue  # staged by a relay only
        layout = plan.destination if side[i] == int(SourceSide.DESTINATION) else plan.source
        buffers = destination_buffers if side[i] == int(SourceSide.DESTINATION) else source_buffers
        off, ln = t.offsets[x.row[i]][:k], t.lengths[x.row[i]][:k]
        s_off, s_len = layout.local_regions(np.array([src_piece[i]]), off[None, : layout.ndim], ln[None, : layout.ndim])
        d_off, d_len = plan.destination.local_regions(np.array([x.dst_piece[i]]), off[None, : plan.destination.ndim],
                                                      ln[None, : plan.destination.ndim])
        s_key, _, _ = piece_slices(layout, int(src_piece[i]))
        d_key, _, _ = piece_slices(plan.destination, int(x.dst_piece[i]))
        src_nd, dst_nd = buffers[s_key].ndim, destination_buffers[d_key].ndim
        s_sl = tuple(slice(int(o), int(o + n)) for o, n in zip(s_off[0, :src_nd], s_len[0, :src_nd], strict=True))
        d_sl = tuple(slice(int(o), int(o + n)) for o, n in zip(d_off[0, :dst_nd], d_len[0, :dst_nd], strict=True))
        region = destination_buffers[d_key][d_sl]
        region[...] = buffers[s_key][s_sl].reshape(region.shape)
        counts[d_key][d_sl] += 1
    return counts


def assert_relayed_plan_correct(plan: Plan, seed: int = 0) -> None:
    src, dst, topo = plan.source, plan.destination, plan.topology
    tensors = random_tensors(src, seed)
    src_buffers = allocate_buffers(src)
    scatter_tensors(src, tensors, src_buffers)
    dst_buffers = allocate_buffers(dst, fill=SENTINEL)
    counts = execute_relayed(plan, src_buffers, dst_buffers)
    problems = check_pieces(dst, tensors, dst_buffers)
    assert not problems, f"wrong destination pieces: {problems[:3]}"
    assert_written_once(dst, counts, dst_buffers)

    bound = brute_force_lower_bound(src, dst, topo)
    assert plan.stats.lower_bound_bytes == bound == plan.stats.cross_domain_bytes

    t = plan.transfers
    assert_network_rows_cross_domains(plan)
    net = t.kind == int(TransferKind.NETWORK)
    remote = t.kind != int(TransferKind.LOCAL)
    assert np.all(t.src_rank[remote] != t.dst_rank[remote])
    assert not np.any(t.src_side == int(SourceSide.DESTINATION)), "relayed plans forward instead of fanning out"
    forward = t.src_side == int(SourceSide.RELAY)
    if forward.any():
        assert np.all(forward[np.argmax(forward):]), "forwards are the table's last rows"
    # Only network rows may leave a copy without a destination piece (a relay's staging).
    assert np.all(net[t.dst_piece < 0])
    assert_ingress_balanced(plan)
    assert_schedules_move_the_plan(plan)


def assert_ingress_balanced(plan: Plan) -> None:
    """No NIC of a domain receives more than the domain's balanced share (its network bytes
    over its participating ranks) plus one region (one network row, all its copies)."""
    t = plan.transfers
    domains = plan.topology.domain_array()
    participants = np.union1d(plan.source.buffer_rank, plan.destination.buffer_rank)
    net = np.flatnonzero(t.kind == int(TransferKind.NETWORK))
    weight = t.nbytes[net] * t.instances[net]
    recv = plan.network_recv_bytes
    outside = np.setdiff1d(np.arange(plan.topology.num_ranks), participants)
    assert not recv[outside].any(), "a rank outside the refit receives"
    for domain in np.unique(domains[t.dst_rank[net]]).tolist():
        ranks = participants[domains[participants] == domain]
        into = domains[t.dst_rank[net]] == domain
        total, largest = int(weight[into].sum()), int(weight[into].max())
        assert int(recv[ranks].sum()) == total
        busiest = int(recv[ranks].max())
        assert busiest * ranks.size <= total + largest * ranks.size, (domain, busiest, total / ranks.size, largest)


def assert_schedules_move_the_plan(plan: Plan) -> None:
    """Every rank's schedule (what the executor runs) moves exactly its bytes of the plan."""
    for rank in sorted(set(plan.source.ranks) | set(plan.destination.ranks)):
        by_kind = build_rank_schedule(plan, rank).bytes_by_kind()
        assert by_kind["network_send"] == plan.network_send_bytes[rank]
        assert by_kind["network_recv"] == plan.network_recv_bytes[rank]
        assert by_kind["intra_send"] == plan.intra_send_bytes[rank]
        assert by_kind["intra_recv"] == plan.intra_recv_bytes[rank]


def relayed(options: PlanOptions) -> PlanOptions:
    return PlanOptions(bucket_bytes=options.bucket_bytes, direct_min_bytes=options.direct_min_bytes,
                       concurrent_rounds=options.concurrent_rounds, relay=True)


def num_relayed(plan: Plan) -> int:
    t = plan.transfers
    return int(np.count_nonzero((t.kind == int(TransferKind.NETWORK)) & (t.dst_piece < 0)))


# ---- properties ------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(refit_cases())
def test_random_relayed_plans_are_exact_minimal_and_balanced(case):
    src, dst, topo, options = case
    plan = make_plan(src, dst, topo, relayed(options))
    event(f"relayed regions: {'some' if num_relayed(plan) else 'none'}")
    assert_relayed_plan_correct(plan)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(repeated_refit_cases(), st.data())
def test_relayed_plans_of_repeated_layouts_are_exact_and_replan_like_cold(case, data):
    src, dst, topo, options = case
    plan = make_plan(src, dst, topo, relayed(options))
    event(f"relayed regions: {'some' if num_relayed(plan) else 'none'}")
    assert_relayed_plan_correct(plan)
    drop = data.draw(st.lists(st.sampled_from(dst.ranks), min_size=1, max_size=2))
    replan = _assert_replan_is_cold(src, dst.without_ranks(drop), topo, relayed(options), check_oracle=False)
    if replan is not None:
        assert_relayed_plan_correct(replan)


@settings(max_examples=30, deadline=None)
@given(refit_cases())
def test_relay_off_is_the_plan_of_before_and_relay_is_deterministic(case):
    src, dst, topo, options = case
    assert make_plan(src, dst, topo, options).fingerprint == make_plan(
        src, dst, topo, PlanOptions(bucket_bytes=options.bucket_bytes, relay=False)).fingerprint
    a, b = make_plan(src, dst, topo, relayed(options)), make_plan(src, dst, topo, relayed(options))
    assert a.fingerprint == b.fingerprint
    for name, col in a.transfers.columns().items():
        assert np.array_equal(col, getattr(b.transfers, name)), name


# ---- the hand-made case ---------------------------------------------------------------------


@pytest.mark.parametrize("bucket_bytes", [256, 1024, 1 << 20])
def test_a_lone_needer_is_relieved_by_relays(bucket_bytes):
    spec = relay_spec()
    plain = make_plan(spec.source, spec.destination, spec.topology, PlanOptions(bucket_bytes=bucket_bytes))
    plan = make_plan(spec.source, spec.destination, spec.topology, PlanOptions(bucket_bytes=bucket_bytes, relay=True))
    assert_relayed_plan_correct(plan)
    assert num_relayed(plan) > 0
    # Without relay rank 4 receives all of "big" and its share of "rep"; with relay less.
    assert plan.network_recv_bytes[4] < plain.network_recv_bytes[4]
    assert plan.stats.max_recv_bytes < plain.stats.max_recv_bytes
    assert plan.stats.cross_domain_bytes == plain.stats.cross_domain_bytes == plan.stats.lower_bound_bytes
    # Relays forward over NVLink what they received for rank 4: intra-domain bytes grow.
    assert plan.stats.intra_domain_bytes > plain.stats.intra_domain_bytes
    assert plan.fingerprint != plain.fingerprint


def test_relay_option_is_validated():
    with pytest.raises(ValueError, match="relay must be a bool"):
        PlanOptions(relay=1)  # type: ignore[arg-type]


# ---- cost model ----------------------------------------------------------------------------


def test_cost_model_overlaps_nic_and_nvlink_for_relayed_plans():
    spec = relay_spec()
    cluster = get_cluster("gb200-nvl72")
    plain = make_plan(spec.source, spec.destination, spec.topology, PlanOptions(bucket_bytes=1024))
    plan = make_plan(spec.source, spec.destination, spec.topology, PlanOptions(bucket_bytes=1024, relay=True))
    p, q = predict(plan, cluster), predict(plain, cluster)
    assert p.seconds >= p.bound_seconds > 0
    assert p.bound_seconds == q.bound_seconds == bound_seconds(plan, cluster)  # the bound is the layouts'
    # Relayed: the slowest rank's max(NIC, NVLink) plus its pipeline fill, plus latency.
    nic = np.maximum(plan.network_send_bytes, plan.network_recv_bytes) / (cluster.nic_gbps * 1e9)
    nvlink = np.maximum(plan.intra_send_bytes, plan.intra_recv_bytes) / (cluster.nvlink_gbps * 1e9)
    assert p.seconds <= float(np.maximum(nic, nvlink).max()) + p.fill_seconds + p.latency_seconds + 1e-12
    assert p.seconds >= float(np.maximum(nic, nvlink).max()) + p.latency_seconds - 1e-12
    assert 0 < p.fill_seconds <= plan.options.max_transfer_bytes / (cluster.nic_gbps * 1e9)
    # Without relay: the network phase, then the fan-out.
    assert q.seconds == pytest.approx(q.network_seconds + q.intra_seconds + q.latency_seconds)
    assert "max(NIC bytes / NIC rate, NVLink bytes / NVLink rate)" in cost.__doc__  # the model says so


def test_egress_bound_counts_only_the_nics_of_the_domains_that_hold_the_bytes():
    # Everything lives on rank 0 (domain 0, two ranks); four domains of destination ranks
    # need it: it leaves through domain 0's two NICs at best, not through all source NICs.
    spec = parse_spec({
        "domains": [0, 0, 1, 2, 3, 4],
        "tensors": [{"name": "w", "shape": [100, 10], "dtype": "float32",
                     "source": {"mesh": [0], "placements": ["R"]},
                     "destination": {"mesh": [2, 3, 4, 5], "placements": ["R"]}},
                    {"name": "b", "shape": [10], "dtype": "float32",
                     "source": {"mesh": [1], "placements": ["R"]},
                     "destination": {"mesh": [2], "placements": ["R"]}}],
    })
    plan = make_plan(spec.source, spec.destination, spec.topology, PlanOptions(relay=True))
    assert plan.egress_group_bytes == 4 * 4000 + 40  # domain 0 holds both tensors
    assert plan.egress_group_ranks == 2
    cluster = get_cluster("h100-dgx")
    assert bound_seconds(plan, cluster) == pytest.approx(plan.egress_group_bytes / 2 / (cluster.nic_gbps * 1e9))
    assert predict(plan, cluster).seconds >= bound_seconds(plan, cluster)


# ---- the table: both clusters, three models ----------------------------------------

TABLE = {
    "deepseek-v3": ("deepseek-v3", "pp=16,ep=16,dp=16", "tp=32,dp=8"),
    "qwen3-235b": ("qwen3-235b-a22b", "tp=4,pp=8,ep=16,dp=4", "tp=8,dp=16"),
    "kimi-k2": ("kimi-k2", "pp=16,ep=16,dp=16", "tp=16,dp=8"),
}


@pytest.mark.parametrize("cluster_name", ["h100-dgx", "gb200-nvl72"])
@pytest.mark.parametrize("model", list(TABLE))
def test_relayed_plans_of_the_table_are_at_the_physical_bound(cluster_name, model):
    from elastic_refit.layout.refit import model_refit_spec

    cluster = get_cluster(cluster_name)
    name, train, infer = TABLE[model]
    spec = model_refit_spec(name, train, infer, domain_size=cluster.domain_size)
    plan = make_plan(spec.source, spec.destination, spec.topology, PlanOptions(relay=True))
    p = predict(plan, cluster)
    print(f"{cluster_name} {model}: predicted {p.seconds:.3f} s, bound {p.bound_seconds:.3f} s, "
          f"ratio {p.seconds / p.bound_seconds:.3f}")
    assert plan.stats.cross_domain_bytes == plan.stats.lower_bound_bytes
    assert p.bound_seconds <= p.seconds <= 1.05 * p.bound_seconds
    assert_ingress_balanced(plan)
    # Egress: the busiest sender is within 3% of what the busiest holder domains must send per NIC.
    egress_share = plan.egress_group_bytes / plan.egress_group_ranks
    assert egress_share <= plan.stats.max_send_bytes <= 1.03 * egress_share
