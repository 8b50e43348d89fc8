"""Membership on etcd and the communicator lifecycle (DESIGN.md, "Membership on etcd").

Public API::

    EtcdServer / EtcdCluster        real etcd on loopback (tests, bench, demo)
    EtcdClient / EtcdConfig         sync adapter over aetcd (endpoints, TLS, auth, retries)
    Membership                      lease registration, list-then-watch, leader, epochs
    MemberRecord / MembershipView   frozen records and views; diff(old, new)
    EtcdStore                       torch.distributed.Store under store/{epoch}/
    CommunicatorManager             reconfigure(old_view, new_view): shrink/grow/rebuild
    MembershipConfig                TTL, debounce and ordered timeouts
"""

from membership.client import EtcdClient, EtcdConfig
from membership.comm import (
    Communicator,
    CommunicatorManager,
    ReconfigureResult,
    RuntimeSupport,
    choose_path,
    probe_runtime,
)
from membership.config import MembershipConfig
from membership.errors import (
    CommunicatorError,
    EpochTimeout,
    EtcdServerError,
    EtcdUnavailable,
    FencedWrite,
    LeadershipLost,
    MembershipError,
    MembershipLost,
    StoreTimeout,
)
from membership.keys import JobKeys
from membership.server import EtcdCluster, EtcdServer
from membership.service import Membership
from membership.store import EtcdStore
from membership.view import MemberRecord, MembershipView, ViewDiff, diff
from membership.watch import RangeWatcher

__all__ = [
    "Communicator",
    "CommunicatorError",
    "CommunicatorManager",
    "EpochTimeout",
    "EtcdClient",
    "EtcdCluster",
    "EtcdConfig",
    "EtcdServer",
    "EtcdServerError",
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
