"""The planner: intersections, domain dedupe, sender balance, schedule, buckets, figures."""

from elastic_refit.plan.planner import PLANNER_VERSION, gather_broadcast_bytes, make_plan
from elastic_refit.plan.types import (
    RELAY_MODES,
    Phase,
    Plan,
    PlanOptions,
    PlanStats,
    SourceSide,
    TransferKind,
    TransferTable,
    relay_mode,
)

__all__ = [
    "PLANNER_VERSION",
    "RELAY_MODES",
    "Phase",
    "Plan",
    "PlanOptions",
    "PlanStats",
    "SourceSide",
    "TransferKind",
    "TransferTable",
    "gather_broadcast_bytes",
    "make_plan",
    "relay_mode",
]
