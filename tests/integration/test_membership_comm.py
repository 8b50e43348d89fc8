"""The etcd-backed Store and the communicator lifecycle with real gloo processes."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
from elastic_refit.membership.comm import CommunicatorManager, probe_runtime
from elastic_refit.membership.config import MembershipConfig
from elastic_refit.membership.errors import MembershipLost, StoreTimeout
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.store import EtcdStore
from elastic_refit.membership.view import MemberRecord, MembershipView

from elastic_refit.testing.agent import verify_transport

pytestmark = pytest.mark.etcd


def test_store_semantics(etcd_server, make_client):
    client = make_client(etcd_server.endpoints)
    store = EtcdStore(client, "jobs", 4, namespace="comm", timeout=timedelta(seconds=0.3))
    store.set("a", b"1")
    assert store.get("a") == b"1"
    assert store.add("n", 2) == 2 and store.add("n", 5) == 7 and store.get("n") == b"7"
    assert store.check(["a", "n"]) and not store.check(["a", "missing"])
    assert store.compare_set("c", b"", b"x") == b"x"      # absent -> set
    assert store.compare_set("c", b"nope", b"y") == b"x"  # mismatch -> current value
    assert store.num_keys() == 3
    assert store.delete_key("a") and not store.delete_key("a")
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="store/4/comm/missing"):
        store.get("missing")
    assert time.monotonic() - t0 < 3.0  # its 0.3 s timeout, not a hang
    with pytest.raises(StoreTimeout):
        store.wait(["missing"], timedelta(seconds=0.1))
    # get waits for a key another client sets later (within a patient store's timeout).
    patient = EtcdStore(client, "jobs", 4, namespace="comm", timeout=timedelta(seconds=60))
    late = threading.Timer(0.2, store.set, ("late", b"v"))
    late.start()
    try:
        assert patient.get("late") == b"v"
    finally:
        late.join()
    assert store.delete_key("late")
    # Keys live exactly where DESIGN.md puts them, and another epoch does not see them.
    epoch_store = JobKeys("jobs").store(4)
    assert store.prefix.startswith(epoch_store)
    stored = {kv.key.removeprefix(store.prefix): kv.value for kv in client.get_prefix(epoch_store).kvs}
    assert stored == {"n": b"7", "c": b"x"}
    assert not EtcdStore(client, "jobs", 5, namespace="comm").check(["n"])
    assert store.purge() == 2 and store.num_keys() == 0


def test_single_rank_gloo_communicator_and_membership_lost(etcd_server, make_client):
    client = make_client(etcd_server.endpoints)
    me = MemberRecord("trainer", "t0", "inc1", "h", "d0", "cpu")
    mgr = CommunicatorManager(client, "solo", "t0", config=MembershipConfig())
    v1 = MembershipView(1, (me,))
    res = mgr.reconfigure(None, v1)
    assert res.path == "build" and res.num_ranks == 1 and res.transport.world_size == 1
    assert verify_transport(res.transport)
    assert client.count_prefix(JobKeys("solo").store(1)) > 0  # rendezvous went via etcd
    other = MemberRecord("trainer", "t1", "inc1", "h", "d0", "cpu")
    with pytest.raises(MembershipLost, match="not in epoch 2"):
        mgr.reconfigure(v1, MembershipView(2, (other,)))
    assert mgr.current is None  # its communicator was aborted, not left dangling


def test_gloo_rebuild_across_processes_on_kill_and_restart(etcd_server, agents):
    eps = etcd_server.endpoints
    procs = [agents(eps, "comm", f"t{i}", comm="gloo") for i in range(3)]

    def verified(agent, epoch_pred, total):
        return agent.wait_event(lambda e: e.get("event") == "comm.verified" and epoch_pred(e["epoch"])
                                and e.get("total") == total and e.get("ok") is True, timeout_s=30)

    firsts = [verified(p, lambda e: True, 3.0) for p in procs]
    epoch3 = max(e["epoch"] for e in firsts)
    victim = procs[2]
    victim.kill()
    survivors = procs[:2]
    rebuilt = [verified(p, lambda e: e > epoch3, 2.0) for p in survivors]
    epoch2 = rebuilt[0]["epoch"]
    for p in survivors:
        rec = p.wait_event(lambda e: e.get("event") == "comm.reconfigured"
                           and e.get("epoch") == epoch2)
        assert rec["path"] == "rebuild" and rec["num_ranks"] == 2
        assert rec["seconds"] < 5.0, rec  # well under a second; the epoch deadline is 10 s
    victim.start()  # a new incarnation rejoins: everyone rebuilds to 3 ranks again
    back = [verified(p, lambda e: e > epoch2, 3.0) for p in procs]
    assert len({e["epoch"] for e in back}) == 1


def test_probe_reports_what_this_runtime_supports():
    s = probe_runtime()
    info = s.to_json()
    assert info["torch_version"] == torch.__version__
    assert info["gloo_shrink"] is False
    if not torch.cuda.is_available():
        assert s.nccl_version is None and not s.nccl_shrink and not s.nccl_grow
