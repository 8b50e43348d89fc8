"""elastic-refit: move only the shard intersections between live training and inference layouts.

The public API, re-exported here and imported on first use (so that planning loads neither
etcd nor gRPC):

- layouts: ``LayoutBuilder``, ``Layout``, ``Topology``, ``Box``, ``Shard``, ``StridedShard``,
  ``Replicate``, ``add_sharded_tensor``, ``from_dtensors``, ``local_shards``, ``load_spec``,
  ``load_side`` (one side's layout file), ``TensorFormats`` (an inference side's destination
  formats: FP8 weights with block scales);
- planning: ``make_plan``, ``Plan``, ``PlanOptions``;
- runtime: ``ElasticRefit``, ``RefitConfig``, ``RefitLayouts``, and ``Commit`` (what
  ``ElasticRefit.publish`` returns), ``PublishHandle`` (what ``publish(..., wait=False)``
  returns) and ``ServedVersion`` (what ``weights()`` yields: the version, and whether the rank
  was detached);
- runtime faults, all ``RefitError``: ``AgentStuck``, ``MembershipLost``, ``PlanMismatch``, ``RefitFailed``,
  ``RefitTimeout``, ``SourceChanged``, ``TransportAborted``, ``VerificationFailed``.

The executor and the transports it runs over are in :mod:`elastic_refit.transport`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_refit._lazy import lazy_exports

if TYPE_CHECKING:
    from elastic_refit.errors import (
        AgentStuck,
        MembershipLost,
        PlanMismatch,
        RefitError,
        RefitFailed,
        RefitTimeout,
        SourceChanged,
        TransportAborted,
        VerificationFailed,
        VersionUnreachable,
    )
    from elastic_refit.layout import (
        Box,
        Layout,
        LayoutBuilder,
        Replicate,
        Shard,
        StridedShard,
        TensorFormats,
        Topology,
        add_sharded_tensor,
        from_dtensors,
        load_side,
        load_spec,
        local_shards,
    )
    from elastic_refit.membership.versions import Commit
    from elastic_refit.plan import Plan, PlanOptions, make_plan
    from elastic_refit.runtime import (
        ElasticRefit,
        EtcdAccess,
        PlanSettings,
        PublishHandle,
        RefitConfig,
        RefitLayouts,
        ServedVersion,
        Timeouts,
        TransferSettings,
        VersionSettings,
    )

__version__ = "0.1.0"

__all__ = [
    "AgentStuck",
    "Box",
    "Commit",
    "ElasticRefit",
    "EtcdAccess",
    "Layout",
    "LayoutBuilder",
    "MembershipLost",
    "Plan",
    "PlanMismatch",
    "PlanOptions",
    "PlanSettings",
    "PublishHandle",
    "RefitConfig",
    "RefitError",
    "RefitFailed",
    "RefitLayouts",
    "RefitTimeout",
    "Replicate",
    "ServedVersion",
    "Shard",
    "SourceChanged",
    "StridedShard",
    "TensorFormats",
    "Timeouts",
    "Topology",
    "TransferSettings",
    "TransportAborted",
    "VerificationFailed",
    "VersionSettings",
    "VersionUnreachable",
    "__version__",
    "add_sharded_tensor",
    "from_dtensors",
    "load_side",
    "load_spec",
    "local_shards",
    "make_plan",
]

# The module each exported name is imported from on first use (the imports above, for
# type checkers and IDEs, run only for them).
_EXPORTS = {
    "Box": "elastic_refit.layout",
    "Layout": "elastic_refit.layout",
    "LayoutBuilder": "elastic_refit.layout",
    "Replicate": "elastic_refit.layout",
    "Shard": "elastic_refit.layout",
    "StridedShard": "elastic_refit.layout",
    "TensorFormats": "elastic_refit.layout",
    "Topology": "elastic_refit.layout",
    "add_sharded_tensor": "elastic_refit.layout",
    "from_dtensors": "elastic_refit.layout",
    "load_side": "elastic_refit.layout",
    "load_spec": "elastic_refit.layout",
    "local_shards": "elastic_refit.layout",
    "Plan": "elastic_refit.plan",
    "PlanOptions": "elastic_refit.plan",
    "make_plan": "elastic_refit.plan",
    "Commit": "elastic_refit.membership.versions",
    "ElasticRefit": "elastic_refit.runtime",
    "PublishHandle": "elastic_refit.runtime",
    "RefitConfig": "elastic_refit.runtime",
    "RefitLayouts": "elastic_refit.runtime",
    "ServedVersion": "elastic_refit.runtime",
    "EtcdAccess": "elastic_refit.runtime",
    "PlanSettings": "elastic_refit.runtime",
    "Timeouts": "elastic_refit.runtime",
    "TransferSettings": "elastic_refit.runtime",
    "VersionSettings": "elastic_refit.runtime",
    "MembershipLost": "elastic_refit.errors",
    "PlanMismatch": "elastic_refit.errors",
    "AgentStuck": "elastic_refit.errors",
    "RefitError": "elastic_refit.errors",
    "RefitFailed": "elastic_refit.errors",
    "RefitTimeout": "elastic_refit.errors",
    "SourceChanged": "elastic_refit.errors",
    "TransportAborted": "elastic_refit.errors",
    "VerificationFailed": "elastic_refit.errors",
    "VersionUnreachable": "elastic_refit.errors",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
