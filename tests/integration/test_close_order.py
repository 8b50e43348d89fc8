"""A member leaves the job before its communicator closes.

The communicator's close waits up to the epoch deadline for NCCL's aborts; on the H100 a
member whose process ended inside that wait (before membership's goodbye) was fenced by a
ring neighbour as dead ("ring connection ended without goodbye"). So ``close`` must revoke
the lease and say goodbye first: here the communicator manager's close records what
membership had done by then, on a real etcd (checked failing with the earlier order)."""

from __future__ import annotations

import pytest
from elastic_refit.membership.client import EtcdClient

from elastic_refit.runtime import ElasticRefit, RefitConfig

from .conftest import wait_until
from .test_causes import SOURCE

pytestmark = pytest.mark.etcd


def _record_manager_close(refit: ElasticRefit, seen: list[dict]) -> None:
    """Wrap the manager's close among ``refit``'s closers: note whether membership had
    left (closing, its lease revoked) when it ran."""
    manager = refit._running.services.manager
    membership = refit.membership
    at = refit._closers.index(manager.close)

    def close() -> None:
        lease = membership.lease_id
        alive = EtcdClient(refit.config.etcd, monotonic=True)
        try:
            seen.append({"closing": membership.closing, "lease_alive": alive.lease_ttl(lease) > 0})
        finally:
            alive.close()
        manager.close()

    refit._closers[at] = close


def test_membership_leaves_before_the_communicator_closes(etcd_server, job):
    config = RefitConfig(job=job, role="trainer", member_id="t0", layout_rank=0, etcd=(etcd_server.endpoint,),
                         ttl_s=2)
    seen: list[dict] = []
    with ElasticRefit(config, SOURCE) as refit:
        wait_until(lambda: refit.membership.view is not None, 10, "t0 to see itself in the job")
        _record_manager_close(refit, seen)
    assert seen == [{"closing": True, "lease_alive": False}]
