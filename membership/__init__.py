"""Membership on etcd and the communicator lifecycle (DESIGN.md, "Membership on etcd").

Public API::

    EtcdClient / EtcdConfig         sync adapter over aetcd (endpoints, TLS, auth, retries)
    Membership                      lease registration, list-then-watch, leader, epochs
    MemberRecord / MembershipView   frozen records and views; diff(old, new)
    EtcdStore                       torch.distributed.Store under store/{epoch}/
    CommunicatorManager             reconfigure(old_view, new_view): shrink/grow/rebuild
    MembershipConfig                TTL, debounce and ordered timeouts
"""

from elastic_refit.membership.client import EtcdClient, EtcdConfig
from elastic_refit.membership.comm import (
    Communicator,
    CommunicatorManager,
    ReconfigureResult,
    RuntimeSupport,
    choose_path,
    probe_runtime,
)
from elastic_refit.membership.config import MembershipConfig
from elastic_refit.membership.errors import (
    CommunicatorError,
    EpochTimeout,
    EtcdAccessDenied,
    EtcdUnavailable,
    FencedWrite,
    LeadershipLost,
    MembershipError,
    MembershipLost,
    StoreTimeout,
)
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.service import Membership
from elastic_refit.membership.store import EtcdStore
from elastic_refit.membership.view import MemberRecord, MembershipView, ViewDiff, diff
from elastic_refit.membership.watch import RangeWatcher

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
    "JobKeys",
    "LeadershipLost",
    "MemberRecord",
    "Membership",
    "MembershipConfig",
    "MembershipError",
    "MembershipLost",
    "MembershipView",
    "RangeWatcher",
    "ReconfigureResult",
    "RuntimeSupport",
    "StoreTimeout",
    "ViewDiff",
    "choose_path",
    "diff",
    "probe_runtime",
]
