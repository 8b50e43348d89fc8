"""The planner: intersections, domain dedupe, sender balance, schedule, buckets, figures,
per-rank views, destination formats (FP8 planned at block granularity)."""

from elastic_refit.plan.planner import PLANNER_VERSION, Uncovered, gather_broadcast_bytes, make_plan
from elastic_refit.plan.quantized import (
    AmaxExchange,
    Quantization,
    destination_format_layout,
    format_layouts,
)
from elastic_refit.plan.rank import make_rank_plan, plan_input_fingerprint, rank_slice
from elastic_refit.plan.types import (
    RELAY_MODES,
    Phase,
    Plan,
    PlanOptions,
    PlanStats,
    RankPlan,
    SourceSide,
    TransferKind,
    TransferTable,
    relay_mode,
)

__all__ = [
    "PLANNER_VERSION",
    "RELAY_MODES",
    "AmaxExchange",
    "Phase",
    "Plan",
    "PlanOptions",
    "PlanStats",
    "Quantization",
    "RankPlan",
    "SourceSide",
    "TransferKind",
    "TransferTable",
    "Uncovered",
    "destination_format_layout",
    "format_layouts",
    "gather_broadcast_bytes",
    "make_plan",
    "make_rank_plan",
    "plan_input_fingerprint",
    "rank_slice",
    "relay_mode",
]
