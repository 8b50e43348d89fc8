"""The ElasticRefit runtime: epochs, attempts, commits and recovery.

Names import on first use: the pure decision functions (``runtime.agent``,
``runtime.attempt``) must not load torch through the driver.
"""

from elastic_refit._lazy import lazy_exports

_EXPORTS = {
    **{name: "elastic_refit.runtime.attempt" for name in
       ("AttemptSpec", "CommitAction", "by_role", "next_action", "plan_attempt")},
    "RefitConfig": "elastic_refit.runtime.config",
    "RefitLayouts": "elastic_refit.runtime.config",
    **{name: "elastic_refit.runtime.settings" for name in
       ("EtcdAccess", "PlanSettings", "Timeouts", "TransferSettings", "VersionSettings")},
    "ElasticRefit": "elastic_refit.runtime.refit",
    "PublishHandle": "elastic_refit.runtime.refit",
    "ServedVersion": "elastic_refit.runtime.serving",
}

__all__ = ["AttemptSpec", "CommitAction", "ElasticRefit", "EtcdAccess", "PlanSettings", "PublishHandle",
           "RefitConfig", "RefitLayouts", "ServedVersion", "Timeouts", "TransferSettings", "VersionSettings", "by_role", "next_action",
           "plan_attempt"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
