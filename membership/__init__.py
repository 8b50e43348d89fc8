"""Membership on etcd and the communicator lifecycle (DESIGN.md, "Membership on etcd").

Public API::

    EtcdClient / EtcdConfig         sync adapter over aetcd (endpoints, TLS, auth, retries)
    Membership                      lease registration, list-then-watch, leader, epochs
    MemberRecord / MembershipView   frozen records and views; diff(old, new)
    EtcdStore                       torch.distributed.Store under store/{epoch}/
    CommunicatorManager             reconfigure(old_view, new_view): shrink/grow/rebuild
    MembershipConfig                TTL, debounce and ordered timeouts

Names import on first use: a process that only follows membership (a control-plane
simulation, a status query) must not load torch, which the communicators need.
"""

from elastic_refit._lazy import lazy_exports

_EXPORTS = {
    "EtcdClient": "elastic_refit.membership.client",
    "EtcdConfig": "elastic_refit.membership.client",
    "Communicator": "elastic_refit.membership.comm",
    "CommunicatorManager": "elastic_refit.membership.comm",
    "ReconfigureResult": "elastic_refit.membership.comm",
    "RuntimeSupport": "elastic_refit.membership.comm",
    "choose_path": "elastic_refit.membership.comm",
    "probe_runtime": "elastic_refit.membership.comm",
    "MembershipConfig": "elastic_refit.membership.config",
    "CommunicatorError": "elastic_refit.membership.errors",
    "EpochTimeout": "elastic_refit.membership.errors",
    "EtcdAccessDenied": "elastic_refit.membership.errors",
    "EtcdUnavailable": "elastic_refit.membership.errors",
    "FencedWrite": "elastic_refit.membership.errors",
    "IdentityClash": "elastic_refit.membership.errors",
    "JobStateLost": "elastic_refit.membership.errors",
    "LeadershipLost": "elastic_refit.membership.errors",
    "MembershipError": "elastic_refit.membership.errors",
    "MembershipLost": "elastic_refit.membership.errors",
    "RunClash": "elastic_refit.membership.errors",
    "StoreTimeout": "elastic_refit.membership.errors",
    "JobKeys": "elastic_refit.membership.keys",
    "Membership": "elastic_refit.membership.service",
    "EtcdStore": "elastic_refit.membership.store",
    "MemberRecord": "elastic_refit.membership.view",
    "MembershipView": "elastic_refit.membership.view",
    "ViewDiff": "elastic_refit.membership.view",
    "diff": "elastic_refit.membership.view",
    "RangeWatcher": "elastic_refit.membership.watch",
}

__all__ = [
    "Communicator",
    "CommunicatorError",
    "CommunicatorManager",
    "EpochTimeout",
    "EtcdAccessDenied",
    "EtcdClient",
    "EtcdConfig",
    "EtcdStore",
    "EtcdUnavailable",
    "FencedWrite",
    "IdentityClash",
    "JobKeys",
    "JobStateLost",
    "LeadershipLost",
    "MemberRecord",
    "Membership",
    "MembershipConfig",
    "MembershipError",
    "MembershipLost",
    "MembershipView",
    "RangeWatcher",
    "ReconfigureResult",
    "RunClash",
    "RuntimeSupport",
    "StoreTimeout",
    "ViewDiff",
    "choose_path",
    "diff",
    "probe_runtime",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
