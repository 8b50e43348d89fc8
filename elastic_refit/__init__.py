"""elastic-refit: move only the shard intersections between live training and inference layouts.

The public API, re-exported here and imported on first use (so that planning code does not
load etcd or gRPC):

- layouts: ``LayoutBuilder``, ``Layout``, ``Topology``, ``Box``, ``Shard``, ``Replicate``,
  ``add_sharded_tensor``, ``from_dtensors``, ``load_spec``;
- planning: ``make_plan``, ``Plan``, ``PlanOptions``;
- runtime: ``ElasticRefit``, ``RefitConfig``, ``RefitLayouts``;
- runtime faults: ``RefitError``, ``TransportAborted``, ``PlanMismatch``,
  ``VerificationFailed``, ``MembershipLost``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Box": "elastic_refit.layout",
    "Layout": "elastic_refit.layout",
    "LayoutBuilder": "elastic_refit.layout",
    "Replicate": "elastic_refit.layout",
    "Shard": "elastic_refit.layout",
    "Topology": "elastic_refit.layout",
    "add_sharded_tensor": "elastic_refit.layout",
    "from_dtensors": "elastic_refit.layout",
    "load_spec": "elastic_refit.layout",
    "Plan": "elastic_refit.plan",
    "PlanOptions": "elastic_refit.plan",
    "make_plan": "elastic_refit.plan",
    "ElasticRefit": "elastic_refit.runtime",
    "RefitConfig": "elastic_refit.runtime",
    "RefitLayouts": "elastic_refit.runtime",
    "PlanMismatch": "elastic_refit.errors",
    "RefitError": "elastic_refit.errors",
    "TransportAborted": "elastic_refit.errors",
    "VerificationFailed": "elastic_refit.errors",
    "MembershipLost": "elastic_refit.membership",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_refit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
