"""Per-rank plans: one rank's rows of a plan, without building the whole transfer table.

Every rank runs the planner's global decisions itself, on the same inputs, with the same
code as the full plan (``planner._plan_rows``): tensor classes, regions and atoms (once per
class), demands, senders among replicas (egress balance), receivers, and the shift schedule's
rounds (``planner._rounds``, which needs every row's ranks, phase and kind). Those are
deterministic functions of the inputs, so they come out identical on every rank and equal to
the full plan's; balance is exactly the full plan's. What a rank skips is everything per row
that is not its own: the rows' tensors, bytes and boxes (gathered from the atoms for its
rows only), the message sort, stream offsets and buckets of other ranks' messages, the
plan-wide figures and the fingerprint of the whole table.

Ranks cannot hash rows they never built, so they agree on the fingerprint of the plan's
*inputs* (``plan_input_fingerprint``) before any byte moves; the inputs determine every row.

Relayed plans (``PlanOptions.relay``) are refused for now: a forward row takes the stream
offset of its network row, which lives in a message the needer is not part of.
"""

from __future__ import annotations

import hashlib

import numpy as np

from elastic_refit.layout import Layout, Topology
from elastic_refit.plan.planner import (
    PLANNER_VERSION,
    _atom_columns,
    _messages,
    _plan_rows,
    _rounds,
)
from elastic_refit.plan.types import Plan, PlanOptions, RankPlan, TransferTable

__all__ = ["make_rank_plan", "plan_input_fingerprint", "rank_slice"]


def plan_input_fingerprint(source: Layout, destination: Layout, topology: Topology,
                           options: PlanOptions | None = None) -> str:
    """Fingerprint of what determines a plan: both layouts, the topology, the options and
    ``PLANNER_VERSION``. Equal on every rank that would build the same plan; ranks compare it
    before data moves (``RankPlan.fingerprint``)."""
    options = options or PlanOptions()
    digest = hashlib.sha256()
    # "inputs;" keeps these apart from fingerprints of whole plans, which hash their rows
    digest.update(f"inputs;planner={PLANNER_VERSION};bucket={options.bucket_bytes};direct={options.direct_min_bytes};"
                  f"concurrent_rounds={options.concurrent_rounds};relay={options.relay};".encode())
    for part in (source.fingerprint, destination.fingerprint, topology.fingerprint()):
        digest.update(part.encode())
        digest.update(b";")
    return digest.hexdigest()[:32]


def _check_rank(rank: object, topology: Topology) -> int:
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or not 0 <= rank < topology.num_ranks:
        raise ValueError(f"rank must be an integer in [0, {topology.num_ranks}), got {rank!r}")
    return int(rank)


def make_rank_plan(source: Layout, destination: Layout, topology: Topology, options: PlanOptions | None = None,
                   *, rank: int) -> RankPlan:
    """Rank ``rank``'s view of ``make_plan(source, destination, topology, options)``: the rows
    it sends, receives or copies, equal to ``rank_slice(make_plan(...), rank)``.

    ``ValueError`` for the inputs ``make_plan`` refuses, a rank outside the topology, and a
    plan that relays (``relay="on"``, or ``"auto"`` where balance relays): build the full plan,
    or plan with ``relay="off"``.
    """
    options = options or PlanOptions()
    rank = _check_rank(rank, topology)
    rows = _plan_rows(source, destination, topology, options, figures=False)
    if rows.relayed:
        raise ValueError(f"per-rank plans of relayed plans are not supported (relay={options.relay!r} relays "
                         f"here): build the full plan with make_plan, or plan with relay='off'")
    table = rows.table
    num_ranks = topology.num_ranks
    row_round, num_rounds = _rounds(table, num_ranks)
    keep = np.flatnonzero((table["src_rank"] == rank) | (table["dst_rank"] == rank))
    mine = _atom_columns({name: column[keep] for name, column in table.items()}, rows.atoms)
    row_round = row_round[keep]
    del table
    transfers, _ = _messages(mine, row_round, num_rounds, options.bucket_bytes, rows.instances, num_ranks)
    return RankPlan(rank=rank, source=source, destination=destination, topology=topology, options=options,
                    transfers=transfers, classes=rows.classes, source_tensor=rows.tensor_map,
                    fingerprint=plan_input_fingerprint(source, destination, topology, options),
                    num_rounds=num_rounds, relayed=False)


def rank_slice(plan: Plan, rank: int) -> RankPlan:
    """Rank ``rank``'s rows of a full plan, as ``make_rank_plan`` gives them (messages
    renumbered among the rank's own, in the same order). ``ValueError`` for a relayed plan,
    whose forwards point at rows outside the slice."""
    rank = _check_rank(rank, plan.topology)
    if plan.relayed:
        raise ValueError("a relayed plan has no per-rank slice (forwards point at other ranks' rows)")
    rows = plan.rows_for(rank)
    columns = {name: column[rows] for name, column in plan.transfers.columns().items()}
    columns["message"] = np.unique(columns["message"], return_inverse=True)[1].reshape(-1).astype(np.int64)
    return RankPlan(rank=rank, source=plan.source, destination=plan.destination, topology=plan.topology,
                    options=plan.options, transfers=TransferTable(**columns), classes=plan.classes,
                    source_tensor=plan.source_tensor,
                    fingerprint=plan_input_fingerprint(plan.source, plan.destination, plan.topology, plan.options),
                    num_rounds=plan.stats.num_rounds, relayed=False)
