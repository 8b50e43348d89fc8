"""Per-rank plans equal the full plan's slices (same rows, messages, rounds and schedules)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_refit.layout import Topology, parse_spec
from elastic_refit.plan import (
    PlanOptions,
    make_plan,
    make_rank_plan,
    plan_input_fingerprint,
    planner,
    rank_slice,
)
from elastic_refit.transport.schedule import build_rank_schedule

from .relay_cases import RELAY_SPEC
from .test_planner import NUM_RANKS, refit_cases, repeated_refit_cases


def _plain(options: PlanOptions) -> PlanOptions:
    # Relayed plans have no per-rank view yet: plan without relay, and "auto" where it does not relay.
    return options if options.relay == "auto" else dataclasses.replace(options, relay="off")


def _assert_views_equal_slices(src, dst, topo, options) -> None:
    try:
        full = make_plan(src, dst, topo, options)
    except ValueError as error:  # inputs the planner refuses: every rank refuses them the same way
        with pytest.raises(ValueError, match=str(error)[:40].replace("(", r"\(").replace("[", r"\[")):
            make_rank_plan(src, dst, topo, options, rank=0)
        return
    if full.relayed:
        with pytest.raises(ValueError, match="relayed"):
            make_rank_plan(src, dst, topo, options, rank=0)
        return
    fingerprint = plan_input_fingerprint(src, dst, topo, options)
    num_rows = 0
    for rank in range(topo.num_ranks):
        view = make_rank_plan(src, dst, topo, options, rank=rank)
        want = rank_slice(full, rank)
        assert view.fingerprint == fingerprint == want.fingerprint
        assert view.num_rounds == want.num_rounds >= full.stats.num_rounds
        for name, column in view.transfers.columns().items():
            assert np.array_equal(column, getattr(want.transfers, name)), (rank, name)
        num_rows += len(view.transfers)
        # the executor's view: the schedule built from the rank's plan is the full plan's
        got, expected = build_rank_schedule(view, rank), build_rank_schedule(full, rank)
        assert dataclasses.replace(got, fingerprint="") == dataclasses.replace(expected, fingerprint="")
        assert view.bytes_by_kind() == expected.bytes_by_kind()
    # every row belongs to one rank (local copies) or two (its sender and its receiver)
    rows = full.transfers
    assert num_rows == len(rows) + int(np.count_nonzero(rows.src_rank != rows.dst_rank))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(refit_cases())
def test_rank_views_equal_slices_of_the_full_plan(case):
    src, dst, topo, options = case
    _assert_views_equal_slices(src, dst, topo, _plain(options))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(repeated_refit_cases())
def test_rank_views_equal_slices_with_repeated_layouts(case):
    src, dst, topo, options = case
    _assert_views_equal_slices(src, dst, topo, _plain(options))


def test_a_relayed_plan_is_refused_by_name():
    spec = parse_spec(RELAY_SPEC)
    with pytest.raises(ValueError, match="relayed plans are not supported"):
        make_rank_plan(spec.source, spec.destination, spec.topology, PlanOptions(relay="on"), rank=4)
    with pytest.raises(ValueError, match="relayed plan has no per-rank slice"):
        rank_slice(make_plan(spec.source, spec.destination, spec.topology, PlanOptions(relay="on")), 4)
    # the same layouts without relay plan per rank
    _assert_views_equal_slices(spec.source, spec.destination, spec.topology, PlanOptions(relay="off"))


@pytest.mark.parametrize("rank", [-1, NUM_RANKS, 1.0, True, "0"])
def test_a_rank_outside_the_topology_is_refused(rank):
    spec = parse_spec(RELAY_SPEC)
    with pytest.raises(ValueError, match="rank must be an integer"):
        make_rank_plan(spec.source, spec.destination, spec.topology, rank=rank)


def test_a_view_answers_only_for_its_rank():
    spec = parse_spec(RELAY_SPEC)
    view = make_rank_plan(spec.source, spec.destination, spec.topology, PlanOptions(relay="off"), rank=4)
    with pytest.raises(ValueError, match="rank 4's view"):
        view.rows_for(5)


def test_input_fingerprint_follows_every_input():
    spec = parse_spec(RELAY_SPEC)
    src, dst, topo = spec.source, spec.destination, spec.topology
    base = plan_input_fingerprint(src, dst, topo)
    assert base == plan_input_fingerprint(src, dst, topo, PlanOptions())
    others = {
        plan_input_fingerprint(src, dst, topo, PlanOptions(bucket_bytes=1 << 20)),
        plan_input_fingerprint(src, dst, topo, PlanOptions(direct_min_bytes=1)),
        plan_input_fingerprint(src, dst, topo, PlanOptions(concurrent_rounds=2)),
        plan_input_fingerprint(src, dst, topo, PlanOptions(relay="off")),
        plan_input_fingerprint(src, dst, Topology((0, 0, 1, 1, 1, 1, 0, 0))),
        plan_input_fingerprint(src, dst.without_ranks([7]), topo),
        plan_input_fingerprint(src.without_ranks([3]), dst, topo),
        plan_input_fingerprint(dst, src, topo),
    }
    assert base not in others and len(others) == 8
    # and it is no fingerprint of a whole plan
    assert base != make_plan(src, dst, topo).fingerprint


def test_input_fingerprint_is_identical_in_another_process():
    code = ("from elastic_refit.layout import parse_spec; from elastic_refit.plan import plan_input_fingerprint;"
            "from tests.unit.relay_cases import RELAY_SPEC; s = parse_spec(RELAY_SPEC);"
            "print(plan_input_fingerprint(s.source, s.destination, s.topology))")
    spec = parse_spec(RELAY_SPEC)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == plan_input_fingerprint(spec.source, spec.destination, spec.topology)


def test_cli_plan_rank_prints_that_ranks_view(tmp_path, capsys):
    import json

    from elastic_refit import cli

    spec_file = tmp_path / "relay.json"
    spec_file.write_text(json.dumps(RELAY_SPEC))
    spec = parse_spec(RELAY_SPEC)
    view = make_rank_plan(spec.source, spec.destination, spec.topology, PlanOptions(relay="off"), rank=4)
    assert cli.main(["plan", "--spec", str(spec_file), "--relay", "off", "--rank", "4", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert {"rank", "plan_seconds", "peak_rss_bytes", "send_bytes", "recv_bytes", "fingerprint"} <= set(figures)
    by_kind = view.bytes_by_kind()
    assert figures["rank"] == 4 and figures["fingerprint"] == view.fingerprint
    assert figures["recv_bytes"] == by_kind["network_recv"] + by_kind["intra_recv"] > 0
    assert sum(p["bytes"] for p in figures["peers"] if p["direction"] == "recv") == figures["recv_bytes"]
    full = make_plan(spec.source, spec.destination, spec.topology, PlanOptions(relay="off"))
    # every rank walks the plan's round space, which holds the rounds with messages
    assert figures["num_rounds"] == view.num_rounds == rank_slice(full, 4).num_rounds >= full.stats.num_rounds
    assert cli.main(["plan", "--spec", str(spec_file), "--relay", "off", "--rank", "4"]) == 0
    out = capsys.readouterr().out
    assert "rank 4 of 8" in out and f"input fingerprint {view.fingerprint}" in out
    # a relayed plan: one error line, exit status 2
    assert cli.main(["plan", "--spec", str(spec_file), "--relay", "on", "--rank", "4"]) == 2
    assert "relayed plans are not supported" in capsys.readouterr().err


# The sender decisions are made per replica group from runs (an atom's demands, of one weight)
# in closed form; these check the closed forms against the per-demand definitions.
_runs_strategy = st.lists(st.tuples(st.integers(1, 1 << 40), st.integers(1, 40)), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(_runs_strategy, st.integers(1, 17))
def test_slot_bytes_equal_round_robin_over_the_demands(runs, num_slots):
    weight = np.array([w for w, _ in runs], dtype=np.int64)
    count = np.array([c for _, c in runs], dtype=np.int64)
    position = np.cumsum(count) - count
    demand_weight = np.repeat(weight, count)
    slot = np.arange(demand_weight.size) % num_slots
    want = np.bincount(slot, weights=demand_weight, minlength=num_slots).astype(np.int64)
    assert np.array_equal(planner._slot_bytes(weight, position, count, num_slots), want)


@settings(max_examples=200, deadline=None)
@given(_runs_strategy, st.lists(st.integers(0, 1 << 42), min_size=1, max_size=9))
def test_fill_counts_equal_the_rooms_of_every_demand(runs, rooms):
    weight = np.array([w for w, _ in runs], dtype=np.int64)
    count = np.array([c for _, c in runs], dtype=np.int64)
    before = np.cumsum(weight * count) - weight * count
    room_end = np.cumsum(np.array(rooms, dtype=np.int64))
    filled = room_end.size
    # per demand, as water filling places it: twice its middle, scaled, against the rooms' ends
    demand_weight = np.repeat(weight, count)
    middle2 = 2 * np.cumsum(demand_weight) - demand_weight
    room = np.minimum(np.searchsorted(room_end, middle2 * filled // 2, side="right"), filled - 1)
    run = np.repeat(np.arange(weight.size), count)
    want = np.zeros((weight.size, filled + 1), dtype=np.int64)
    for u in range(filled + 1):
        want[:, u] = np.bincount(run[room < u], minlength=weight.size)
    assert np.array_equal(planner._fill_counts(weight, before, count, room_end, filled), want)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(refit_cases())
def test_rounds_depend_on_the_two_ranks_only(case):
    src, dst, topo, options = case
    try:
        plan = make_plan(src, dst, topo, options)
    except ValueError:
        return
    t = plan.transfers
    scheduled = (t.round >= 0) & (t.src_side != 2)  # forwards ride with their network row
    # one round per (phase, sender, receiver): the pair decides it, whatever the rows
    pair = np.stack([t.phase, t.src_rank, t.dst_rank], axis=1)[scheduled]
    _, first, inverse = np.unique(pair, axis=0, return_index=True, return_inverse=True)
    assert np.array_equal(t.round[scheduled], t.round[scheduled][first][inverse.reshape(-1)])
    # and in a round every rank sends to one peer at most and receives from one at most
    for ranks, peers in ((t.src_rank, t.dst_rank), (t.dst_rank, t.src_rank)):
        key = np.stack([t.phase, t.round, ranks], axis=1)[scheduled]
        peer_sets = np.unique(np.column_stack([key, peers[scheduled]]), axis=0)
        assert np.unique(peer_sets[:, :3], axis=0).shape[0] == peer_sets.shape[0]
