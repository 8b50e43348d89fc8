"""What one GPU allows: probing NCCL and a one-rank NCCL communicator via the etcd store."""

from __future__ import annotations

import pytest
from elastic_refit.membership.comm import NCCL_MIN_SHRINK, CommunicatorManager, probe_runtime
from elastic_refit.membership.view import MemberRecord, MembershipView

from elastic_refit.testing.agent import verify_transport

pytestmark = [pytest.mark.gpu, pytest.mark.etcd]


def test_probe_finds_nccl_and_shrink_support():
    s = probe_runtime()
    assert s.num_gpus >= 1
    assert s.nccl_version is not None and s.nccl_version >= (2, 0, 0)
    assert s.nccl_shrink == (s.nccl_version >= NCCL_MIN_SHRINK and s.nccl_backend_shrink and s.store_clone)


def test_one_rank_nccl_communicator_through_etcd_store(etcd_server, make_client):
    client = make_client(etcd_server.endpoints)
    me = MemberRecord("trainer", "g0", "inc", "h", "d0", "cuda:0")
    mgr = CommunicatorManager(client, "gpu", "g0", backend="nccl", device="cuda:0")
    res = mgr.reconfigure(None, MembershipView(1, (me,)))
    assert res.path == "build" and res.num_ranks == 1
    assert res.transport.device.type == "cuda" and verify_transport(res.transport)
    mgr.close()
    assert mgr.current is None
