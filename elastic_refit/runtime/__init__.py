"""The ElasticRefit runtime: epochs, attempts, commits and recovery."""

from elastic_refit.runtime.attempt import (
    AttemptSpec,
    CommitAction,
    by_role,
    next_action,
    plan_attempt,
)
from elastic_refit.runtime.config import RefitConfig, RefitLayouts
from elastic_refit.runtime.refit import ElasticRefit, PublishHandle

__all__ = ["AttemptSpec", "CommitAction", "ElasticRefit", "PublishHandle", "RefitConfig", "RefitLayouts", "by_role",
           "next_action", "plan_attempt"]
