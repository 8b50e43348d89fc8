"""Relayed plans (``PlanOptions.relay``): ingress balance over every NIC of a destination
domain, forwards that travel with their network bucket, the "auto" default, the cost model
and its bound.

Checked as data by ``plan_oracle.assert_plan_correct``, independently of the planner's
machinery: every destination byte (a forward reads what its network copy read), each
element written once, padding untouched, cross-domain bytes at the brute-force lower bound,
and no NIC of a domain above the balanced share plus one region; per-rank schedules move
exactly the plan's bytes, and the single-device transport runs relayed plans bit-exact.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from elastic_refit.layout import parse_spec
from elastic_refit.plan import (
    Plan,
    PlanOptions,
    SourceSide,
    TransferKind,
    TransferTable,
    cost,
    make_plan,
)
from elastic_refit.plan.cost import bound_seconds, get_cluster, predict
from elastic_refit.testing.inprocess import forward_sources
from elastic_refit.testing.local_transport import LocalTransport
from elastic_refit.testing.pattern import allocate, fill_pieces
from elastic_refit.testing.pattern import check_pieces as check_rank_pieces
from elastic_refit.testing.world import SENTINEL, padding_problems
from elastic_refit.transport.schedule import build_rank_schedule

from .plan_oracle import assert_ingress_balanced, assert_plan_correct, assert_same_plan
from .relay_cases import RELAY_SPEC
from .test_planner import _assert_replan_is_cold, refit_cases, repeated_refit_cases


def relay_spec():
    return parse_spec(json.loads(json.dumps(RELAY_SPEC)))


# ---- checks of a relayed plan ---------------------------------------------------------------


def assert_relayed_plan_correct(plan: Plan, seed: int = 0) -> None:
    """``assert_plan_correct`` (every destination byte, written once, padding untouched, the
    bound, the forwards and the ingress balance), and every rank's schedule moving exactly
    its bytes of the plan."""
    assert plan.relayed
    assert_plan_correct(plan, seed)
    assert_schedules_move_the_plan(plan)


def assert_schedules_move_the_plan(plan: Plan) -> None:
    """Every rank's schedule (what the executor runs) moves exactly its bytes of the plan."""
    for rank in sorted(set(plan.source.ranks) | set(plan.destination.ranks)):
        by_kind = build_rank_schedule(plan, rank).bytes_by_kind()
        assert by_kind["network_send"] == plan.network_send_bytes[rank]
        assert by_kind["network_recv"] == plan.network_recv_bytes[rank]
        assert by_kind["intra_send"] == plan.intra_send_bytes[rank]
        assert by_kind["intra_recv"] == plan.intra_recv_bytes[rank]


def with_relay(options: PlanOptions, relay: str) -> PlanOptions:
    return dataclasses.replace(options, relay=relay)


def num_relayed(plan: Plan) -> int:
    t = plan.transfers
    return int(np.count_nonzero((t.kind == int(TransferKind.NETWORK)) & (t.dst_piece < 0)))


def busiest_nic(plan: Plan) -> int:
    return int(max(plan.network_send_bytes.max(initial=0), plan.network_recv_bytes.max(initial=0)))


# ---- properties ------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(refit_cases(), st.integers(0, 2**31 - 1))
def test_random_relayed_plans_are_exact_minimal_and_balanced(case, seed):
    src, dst, topo, options = case
    plan = make_plan(src, dst, topo, with_relay(options, "on"))
    event(f"relayed regions: {'some' if num_relayed(plan) else 'none'}")
    assert_relayed_plan_correct(plan, seed)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(repeated_refit_cases(), st.data())
def test_relayed_plans_of_repeated_layouts_are_exact_and_replan_like_cold(case, data):
    src, dst, topo, options = case
    plan = make_plan(src, dst, topo, with_relay(options, "on"))
    event(f"relayed regions: {'some' if num_relayed(plan) else 'none'}")
    assert_relayed_plan_correct(plan)
    drop = data.draw(st.lists(st.sampled_from(dst.ranks), min_size=1, max_size=2))
    replan = _assert_replan_is_cold(src, dst.without_ranks(drop), topo, with_relay(options, "on"), check_oracle=False)
    if replan is not None:
        assert_relayed_plan_correct(replan)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(refit_cases())
def test_auto_is_the_plain_plan_unless_relaying_lowers_the_busiest_nic(case):
    src, dst, topo, options = case
    auto = make_plan(src, dst, topo, with_relay(options, "auto"))
    off = make_plan(src, dst, topo, with_relay(options, "off"))
    on = make_plan(src, dst, topo, with_relay(options, "on"))
    event(f"auto relays: {auto.relayed}")
    # "auto" is one of the two plans, down to every column and the fingerprint
    assert_same_plan(auto, on if auto.relayed else off)
    assert auto.relayed == (busiest_nic(on) < busiest_nic(off))
    assert not off.relayed and on.relayed
    # the fingerprint marks what the plan does, not what the option said
    assert off.fingerprint == make_plan(src, dst, topo, with_relay(options, False)).fingerprint
    assert on.fingerprint == make_plan(src, dst, topo, with_relay(options, True)).fingerprint


@settings(max_examples=30, deadline=None)
@given(refit_cases())
def test_relayed_plans_are_deterministic(case):
    src, dst, topo, options = case
    a, b = make_plan(src, dst, topo, with_relay(options, "on")), make_plan(src, dst, topo, with_relay(options, "on"))
    assert a.fingerprint == b.fingerprint
    for name, col in a.transfers.columns().items():
        assert np.array_equal(col, getattr(b.transfers, name)), name


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(refit_cases(), st.integers(0, 2**31 - 1))
def test_the_single_device_transport_runs_relayed_plans_bit_exact(case, seed):
    src, dst, topo, options = case
    plan = make_plan(src, dst, topo, with_relay(options, "on"))
    ranks = sorted(set(src.ranks) | set(dst.ranks))
    buffers = {}
    for r in ranks:
        source = allocate(src, r, fill=0)
        fill_pieces(src, r, source, seed)
        buffers[r] = (source, allocate(dst, r, fill=SENTINEL))
    runner = LocalTransport(plan, torch.device("cpu"))
    runner.run(buffers)
    for r, (_, destination) in buffers.items():
        assert check_rank_pieces(dst, r, destination, seed=seed) == []
        assert padding_problems(dst, r, destination, SENTINEL) == []
    s = plan.stats
    assert runner.bytes_moved == s.cross_domain_bytes + s.intra_domain_bytes + s.local_bytes


def test_the_oracle_refuses_a_forward_that_is_not_what_its_network_copy_brought():
    spec = relay_spec()
    plan = make_plan(spec.source, spec.destination, spec.topology, PlanOptions(relay="on"))
    t = plan.transfers
    forward = np.flatnonzero(t.src_side == int(SourceSide.RELAY))
    columns = t.columns()
    columns["src_rank"] = columns["src_rank"].copy()
    columns["src_rank"][forward[0]] = t.dst_rank[forward[0]] ^ 1  # forwarded by a rank that did not receive it
    broken = dataclasses.replace(plan, transfers=TransferTable(**columns))
    with pytest.raises(ValueError, match="its sender did not receive the network copy"):
        forward_sources(broken, broken.expand())


# ---- the hand-made case ---------------------------------------------------------------------


@pytest.mark.parametrize("bucket_bytes", [256, 1024, 1 << 20])
def test_a_lone_needer_is_relieved_by_relays(bucket_bytes):
    spec = relay_spec()
    plain = make_plan(spec.source, spec.destination, spec.topology, PlanOptions(bucket_bytes=bucket_bytes, relay="off"))
    plan = make_plan(spec.source, spec.destination, spec.topology, PlanOptions(bucket_bytes=bucket_bytes, relay="on"))
    assert_relayed_plan_correct(plan)
    assert num_relayed(plan) > 0
    # Without relay rank 4 receives all of "big" and its share of "rep"; with relay less.
    assert plan.network_recv_bytes[4] < plain.network_recv_bytes[4]
    assert plan.stats.max_recv_bytes < plain.stats.max_recv_bytes
    assert plan.stats.cross_domain_bytes == plain.stats.cross_domain_bytes == plan.stats.lower_bound_bytes
    # Relays forward over NVLink what they received for rank 4: intra-domain bytes grow.
    assert plan.stats.intra_domain_bytes > plain.stats.intra_domain_bytes
    assert plan.fingerprint != plain.fingerprint
    # the default ("auto") relays here: rank 4's NIC is the busiest, and balance relieves it
    assert_same_plan(make_plan(spec.source, spec.destination, spec.topology, PlanOptions(bucket_bytes=bucket_bytes)),
                     plan)


def test_relay_option_is_validated():
    assert PlanOptions().relay == "auto"
    assert PlanOptions(relay=True).relay == "on" and PlanOptions(relay=False).relay == "off"
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="relay must be one of auto, on, off"):
            PlanOptions(relay=bad)  # type: ignore[arg-type]


def test_refit_config_relay_is_a_mode_and_reads_its_variable():
    from elastic_refit.runtime.config import RefitConfig

    base = dict(job="j", role="trainer", member_id="m", layout_rank=0, etcd=("127.0.0.1:2379",))
    assert RefitConfig(**base).relay == "auto"
    assert RefitConfig(**base, relay=True).relay == "on" and RefitConfig(**base, relay=False).relay == "off"
    for raw, want in (("auto", "auto"), ("ON", "on"), ("off", "off"), ("1", "on"), ("false", "off")):
        assert RefitConfig.from_env({"ELASTIC_REFIT_RELAY": raw}, **base).relay == want
    with pytest.raises(ValueError, match="ELASTIC_REFIT_RELAY='sometimes' is not a relay mode"):
        RefitConfig.from_env({"ELASTIC_REFIT_RELAY": "sometimes"}, **base)
    with pytest.raises(ValueError, match="relay must be one of auto, on, off"):
        RefitConfig(**base, relay="sometimes")


def test_plan_command_takes_a_relay_mode(capsys, tmp_path):
    from .test_cli_plan import run_in_process

    spec_path = tmp_path / "relay.json"
    spec_path.write_text(json.dumps(RELAY_SPEC))
    fingerprints = {}
    for name, flags in (("default", []), ("bare", ["--relay"]), ("on", ["--relay", "on"]),
                        ("auto", ["--relay", "auto"]), ("off", ["--relay", "off"])):
        code, out, _ = run_in_process(capsys, "plan", "--spec", str(spec_path), "--json", *flags)
        assert code == 0
        fingerprints[name] = json.loads(out)["fingerprint"]
    spec = relay_spec()
    assert fingerprints["off"] == make_plan(spec.source, spec.destination, spec.topology,
                                            PlanOptions(relay="off")).fingerprint
    # rank 4's NIC is the busiest without relay: the default relays, a bare --relay is "on"
    assert fingerprints["default"] == fingerprints["auto"] == fingerprints["bare"] == fingerprints["on"]
    assert fingerprints["on"] != fingerprints["off"]


# ---- cost model ----------------------------------------------------------------------------


def test_cost_model_overlaps_nic_and_nvlink_for_relayed_plans():
    spec = relay_spec()
    cluster = get_cluster("gb200-nvl72")
    plain = make_plan(spec.source, spec.destination, spec.topology, PlanOptions(bucket_bytes=1024, relay="off"))
    plan = make_plan(spec.source, spec.destination, spec.topology, PlanOptions(bucket_bytes=1024, relay="on"))
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
    plan = make_plan(spec.source, spec.destination, spec.topology, PlanOptions(relay="on"))
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
def test_default_plans_of_the_table_are_at_the_physical_bound(cluster_name, model):
    from elastic_refit.layout.refit import model_refit_spec

    cluster = get_cluster(cluster_name)
    name, train, infer = TABLE[model]
    spec = model_refit_spec(name, train, infer, domain_size=cluster.domain_size)
    plan = make_plan(spec.source, spec.destination, spec.topology)  # the default options ("auto")
    p = predict(plan, cluster)
    print(f"{cluster_name} {model}: predicted {p.seconds:.3f} s, bound {p.bound_seconds:.3f} s, "
          f"ratio {p.seconds / p.bound_seconds:.3f}, relayed {plan.relayed}")
    assert plan.stats.cross_domain_bytes == plan.stats.lower_bound_bytes
    assert p.bound_seconds <= p.seconds <= 1.05 * p.bound_seconds
    if cluster_name == "gb200-nvl72":  # a few NICs of a 72-rank domain would carry its ingress
        assert plan.relayed
    if plan.relayed:
        assert_ingress_balanced(plan)
    # Egress: the busiest sender is within 3% of what the busiest holder domains must send per NIC.
    egress_share = plan.egress_group_bytes / plan.egress_group_ranks
    assert egress_share <= plan.stats.max_send_bytes <= 1.03 * egress_share
