"""The etcd-backed Store and the communicator lifecycle with real gloo processes."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import threading
import time
from datetime import timedelta

import pytest
import structlog
import torch
from elastic_refit.membership.comm import CommunicatorManager, probe_runtime
from elastic_refit.membership.config import MembershipConfig
from elastic_refit.membership.errors import CommunicatorError, MembershipLost, StoreTimeout
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
    # The same members in a new epoch keep the communicator, but the epoch's keys (attempts,
    # plan and done keys) go to the new epoch's store, where its watch looks for them.
    v2 = MembershipView(2, (me,))
    res = mgr.reconfigure(v1, v2)
    assert res.path == "unchanged" and mgr.current.epoch == 2
    assert mgr.store.epoch == 2 and mgr.store.prefix.startswith(JobKeys("solo").store(2))
    assert verify_transport(res.transport)
    other = MemberRecord("trainer", "t1", "inc1", "h", "d0", "cpu")
    with pytest.raises(MembershipLost, match="not in epoch 3"):
        mgr.reconfigure(v2, MembershipView(3, (other,)))
    assert mgr.current is None  # its communicator was aborted, not left dangling


class _SlowAbort:
    """The real backend behind an abort that takes ``delay_s`` (as an NCCL abort did on a
    loaded H200): everything else goes to the backend."""

    def __init__(self, pg, delay_s: float):
        self._pg, self._delay_s, self.aborted = pg, delay_s, threading.Event()

    def abort(self) -> None:
        time.sleep(self._delay_s)
        self._pg.abort()
        self.aborted.set()

    def __getattr__(self, name):
        return getattr(self._pg, name)


def test_close_waits_for_an_abort_slower_than_the_watchdog(etcd_server, make_client):
    """A recovery's abort is bounded by the 1 s watchdog; a close waits for it to finish (up
    to the epoch deadline), so a process that lives on keeps none of its sockets."""
    client = make_client(etcd_server.endpoints)
    me = MemberRecord("trainer", "t0", "inc1", "h", "d0", "cpu")
    mgr = CommunicatorManager(client, "slow-close", "t0", config=MembershipConfig(abort_timeout_s=1.0))
    assert mgr.reconfigure(None, MembershipView(1, (me,))).path == "build"
    slow = _SlowAbort(mgr.current.pg, delay_s=1.6)
    mgr.current.pg = slow
    t0 = time.monotonic()
    mgr.close()
    assert slow.aborted.is_set(), "close returned while the abort was still running"
    assert 1.6 <= time.monotonic() - t0 < MembershipConfig().epoch_deadline_s
    assert mgr.current is None


def test_a_rank_that_dropped_its_communicator_rebuilds_from_its_epoch(etcd_server, make_client):
    """A rank's first communicator is its only "build": one whose communicator was dropped
    (a broken gloo transport: the runtime passes no previous view) or torn down by a
    formation that failed still rebuilds, and its log names the epoch it came from."""
    client = make_client(etcd_server.endpoints)
    me = MemberRecord("trainer", "t0", "inc1", "h", "d0", "cpu")
    gone = MemberRecord("trainer", "t1", "inc1", "h", "d0", "cpu")
    latest = {"epoch": 1}
    mgr = CommunicatorManager(client, "formed", "t0", config=MembershipConfig(),
                              superseded=lambda epoch: latest["epoch"] > epoch)
    with structlog.testing.capture_logs() as events:
        assert mgr.reconfigure(None, MembershipView(1, (me,))).path == "build"
        # The runtime dropped the broken transport: nothing to reuse, but a rank that had one.
        assert mgr.reconfigure(None, MembershipView(2, (me,))).path == "rebuild"
        # A formation that fails (t1 never comes; a newer epoch supersedes it) tears the
        # communicator of epoch 2 down.
        timer = threading.Timer(0.5, latest.__setitem__, ("epoch", 4))
        timer.start()
        try:
            with pytest.raises(CommunicatorError):
                mgr.reconfigure(None, MembershipView(3, (me, gone)))
        finally:
            timer.join()
        assert mgr.current is None
        res = mgr.reconfigure(None, MembershipView(4, (me,)))
        assert res.path == "rebuild" and verify_transport(res.transport)
    mgr.close()
    logged = [(e["path"], e["epoch"], e["from_epoch"]) for e in events if e.get("event") == "comm.reconfigured"]
    assert logged == [("build", 1, None), ("rebuild", 2, 1), ("rebuild", 4, 2)]


def test_gloo_connects_only_once_every_rank_arrived(etcd_server, make_client):
    """Two of an epoch's three ranks wait at the rendezvous for the third: neither writes a
    gloo address (a rank that left half a connect behind would strand the peers that read
    it), and once a newer epoch supersedes this one both give up at once and withdraw their
    arrival. The third rank comes later, to a newer epoch, and all three connect there."""
    client = make_client(etcd_server.endpoints)
    records = [MemberRecord("trainer", f"t{i}", "inc1", "h", "d0", "cpu") for i in range(3)]
    latest = {"epoch": 1}
    config = MembershipConfig()  # epoch deadline 10 s: giving up must not wait for it
    managers = [CommunicatorManager(client, "arrive", r.member_id, config=config,
                                    superseded=lambda epoch: latest["epoch"] > epoch) for r in records]
    v1, v2 = MembershipView(1, tuple(records)), MembershipView(2, tuple(records))
    outcome: dict[str, object] = {}

    def reconfigure(i: int, view: MembershipView) -> None:
        try:
            outcome[records[i].member_id] = managers[i].reconfigure(None, view)
        except Exception as exc:  # reported, the test decides
            outcome[records[i].member_id] = exc

    store_prefix = JobKeys("arrive").store(1)
    waiting = [threading.Thread(target=reconfigure, args=(i, v1)) for i in (0, 1)]
    for t in waiting:
        t.start()
    def arrived() -> set[str]:
        return {kv.key.rsplit("/", 2)[-2] for kv in client.get_prefix(store_prefix).kvs if "/arrived/" in kv.key}

    deadline = time.monotonic() + 10
    while arrived() != {"t0", "t1"} and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # both are waiting for t2 now
    keys = [kv.key.removeprefix(store_prefix) for kv in client.get_prefix(store_prefix).kvs]
    assert keys and all("/arrived/" in k for k in keys), f"keys other than arrivals before t2 came: {keys}"
    started = time.monotonic()
    latest["epoch"] = 2
    for t in waiting:
        t.join(10)
    assert time.monotonic() - started < 3.0, "the superseded rendezvous waited for its deadline"
    for m in ("t0", "t1"):
        assert isinstance(outcome[m], CommunicatorError) and "superseded" in str(outcome[m]), outcome[m]
    assert arrived() == set(), "a rank that gave up still counts as arrived"
    threads = [threading.Thread(target=reconfigure, args=(i, v2)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        for m in ("t0", "t1", "t2"):
            assert getattr(outcome[m], "num_ranks", None) == 3, outcome[m]
        checks = [threading.Thread(target=lambda i=i: outcome.__setitem__(
            f"ok{i}", verify_transport(outcome[f"t{i}"].transport))) for i in range(3)]
        for t in checks:
            t.start()
        for t in checks:
            t.join(30)
        assert all(outcome[f"ok{i}"] for i in range(3))
    finally:
        for mgr in managers:
            mgr.close()


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


def test_the_etcd_store_clones_where_torch_forwards_the_call(etcd_server, make_client):
    """torch's ProcessGroupNCCL.shrink clones its group's store (c10d ``Store::clone``) and
    prefixes it: through a PrefixStore's clone the etcd store answers with itself, the keys
    written through the clone are the store's, and the probe says so exactly when it works."""
    import torch.distributed as dist

    client = make_client(etcd_server.endpoints)
    store = EtcdStore(client, "clones", 2, namespace="comm-nccl", timeout=timedelta(seconds=5))
    try:
        clone = dist.PrefixStore("shrunk", store).clone()
    except RuntimeError as exc:  # this torch does not forward clone to a Python store
        assert "pure virtual" in str(exc)
        assert not probe_runtime().store_clone
        return
    assert probe_runtime().store_clone
    derived = dist.PrefixStore("child", clone)  # c10d joins a prefix and a key with "/"
    derived.set("unique_id", b"abc")
    assert store.get("shrunk/child/unique_id") == b"abc"
    assert client.count_prefix(JobKeys("clones").store(2)) == 1  # under the epoch's store, nowhere else

    class Uncloneable(dist.Store):  # what EtcdStore was before it had a clone
        def __init__(self):
            super().__init__()

    with pytest.raises(RuntimeError, match="pure virtual"):
        dist.PrefixStore("shrunk", Uncloneable()).clone()


def _ipv4_of(interface: str) -> str | None:
    """The IPv4 address of ``interface`` (SIOCGIFADDR), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _tcp_local_addresses() -> set[str]:
    """The local IPv4 addresses of this process's connected TCP sockets (its fds' inodes in
    /proc/net/tcp). Listeners are left out: gloo's device, with its listener, is the process's
    and outlives the groups that used it (``transport.factory.gloo_device``)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.read().splitlines()[1:]]
    return {socket.inet_ntoa(struct.pack("<I", int(row[1].split(":")[0], 16))) for row in rows
            if row[9] in inodes and row[3] != "0A"}


def _gloo_ring(make_client, endpoints, interface: str) -> set[str]:
    """Two ranks (threads) build a gloo communicator bound to ``interface`` and pass a ring
    check; the local addresses of this process's TCP sockets while it is up."""
    client = make_client(endpoints)
    records = [MemberRecord("trainer", f"t{i}", "inc1", "h", "d0", "cpu") for i in range(2)]
    view = MembershipView(1, tuple(records))
    managers = [CommunicatorManager(client, f"bind-{interface}", r.member_id, bind_interface=interface)
                for r in records]
    out: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            result = managers[i].reconfigure(None, view)
            out[i] = verify_transport(result.transport)
        except Exception as exc:  # reported, the test decides
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert out == {0: True, 1: True}, out
        return _tcp_local_addresses()
    finally:
        for mgr in managers:
            mgr.close()


def test_no_rank_tears_a_gloo_group_down_before_every_rank_is_through_its_connect(etcd_server, make_client):
    """A rank that finished gloo's connect and tore the group down at once (a newer epoch had
    come) stranded a peer still connecting to it: gloo retried the vanished listener for ~15 s,
    past its timeout, and every later epoch waited for that peer (the 15.5 s restart<ttl and
    restart+kill outliers of the chaos matrix). Here a newer epoch that keeps every rank exists
    as soon as all have arrived, and each rank leaves the moment its reconfigure returns: by
    then every rank's connect must be through."""
    client = make_client(etcd_server.endpoints)
    job = "teardown"
    records = tuple(MemberRecord("trainer", f"t{i}", "inc1", "h", "d0", "cpu") for i in range(3))
    first = MembershipView(1, records)
    newer = MembershipView(2, records + (MemberRecord("inference", "n0", "inc1", "h", "d1", "cpu"),))
    latest = {"view": first}
    prefix = JobKeys(job).store(1)

    def keys(kind: str) -> dict[str, bytes]:
        return {kv.key.rsplit("/", 2)[-2]: kv.value for kv in client.get_prefix(prefix).kvs if f"/{kind}/" in kv.key}

    def supersede_once_all_arrived() -> None:
        deadline = time.monotonic() + 20
        while len(keys("arrived")) < 3 and time.monotonic() < deadline:
            time.sleep(0.002)
        latest["view"] = newer

    managers = [CommunicatorManager(client, job, r.member_id, superseded=lambda e: latest["view"].epoch > e,
                                    latest_view=lambda: latest["view"]) for r in records]
    out: dict[str, object] = {}

    def build_and_leave(i: int) -> None:
        try:
            managers[i].reconfigure(None, first)
            out[f"t{i}"] = keys("built")  # what every rank had said when this one could leave
        except Exception as exc:  # reported, the test decides
            out[f"t{i}"] = exc
        finally:
            managers[i].close()

    watcher = threading.Thread(target=supersede_once_all_arrived)
    watcher.start()
    threads = [threading.Thread(target=build_and_leave, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    watcher.join(30)
    assert latest["view"] is newer, "the newer epoch never came: the test showed nothing"
    for m in ("t0", "t1", "t2"):
        assert out[m] == {"t0": b"1", "t1": b"1", "t2": b"1"}, (m, out[m])

class _GivesUpAfterItsAddress(EtcdStore):
    """The store of a rank that writes its gloo address and then gives up at once (in the
    chaos trial its peers' addresses came too late for it)."""

    def wait(self, keys, timeout=None):
        raise StoreTimeout(f"gave up waiting for {keys}")


def test_a_gloo_peer_that_gave_up_after_writing_its_address_frees_the_others_within_the_transport_timeout(
        etcd_server, make_client):
    """Three ranks arrive; one writes its gloo address and gives up before it connects. Every
    rank that read its address gives up too, within about the transport timeout (TTL + 1 s):
    gloo waits five times its own timeout for a peer that is to connect to it, and waited 15 s
    on a 3 s timeout (restart+kill, 15.7 s, 2026-12-03). Four epochs: which rank of a pair
    waits for the other depends on the ports, and each epoch draws them again."""
    import torch.distributed as dist

    client = make_client(etcd_server.endpoints)
    job = "gave-up"
    records = tuple(MemberRecord("trainer", f"t{i}", "inc1", "h", "d0", "cpu") for i in range(3))
    config = MembershipConfig()
    managers = [CommunicatorManager(client, job, r.member_id, config=config) for r in records[:2]]
    bound = managers[0].transport_timeout_s + 2.5  # the connect's bound, and the machine's slack
    try:
        for epoch in (1, 2, 3, 4):
            view = MembershipView(epoch, records)
            out: dict[str, object] = {}

            def build(i: int, view: MembershipView = view, out: dict = out) -> None:
                t0 = time.monotonic()
                try:
                    managers[i].reconfigure(None, view)
                    out[f"t{i}"] = ("built", time.monotonic() - t0)
                except Exception as exc:  # reported, the test decides
                    out[f"t{i}"] = (f"{type(exc).__name__}: {exc}"[:200], time.monotonic() - t0)

            threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            # t2 arrives, writes its address, and gives up.
            store = EtcdStore(client, job, epoch, namespace="comm-gloo")
            store.set("arrived/t2/inc1", "1")
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timedelta(seconds=config.ttl_s + 1.0)
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
            with pytest.raises(Exception, match="gave up"):
                dist.ProcessGroupGloo(_GivesUpAfterItsAddress(client, job, epoch, namespace="comm-gloo"), 2, 3, options)
            del options
            for t in threads:
                t.join(40)
            assert set(out) == {"t0", "t1"}, out
            slow = {m: r for m, r in out.items() if r[1] > bound}
            assert not slow, f"epoch {epoch}: ranks held past {bound:.1f} s by a peer that had given up: {slow}"
    finally:
        for m in managers:
            m.close()


def test_gloo_binds_to_the_configured_interface(etcd_server, make_client):
    """``bind_interface`` puts gloo's device on that interface: bound to a non-loopback
    interface, gloo's sockets carry its address (etcd's are on loopback); bound to
    loopback, none does. One of the two differs from gloo's default (the host name's
    address), so the test fails if the setting is not passed to gloo."""
    other = next(((name, address) for _, name in socket.if_nameindex()
                  if (address := _ipv4_of(name)) is not None and not address.startswith("127.")), None)
    if other is None:
        pytest.skip("this host has no interface with a non-loopback IPv4 address")
    name, address = other
    assert address not in _tcp_local_addresses()
    assert address in _gloo_ring(make_client, etcd_server.endpoints, name)
    assert address not in _gloo_ring(make_client, etcd_server.endpoints, "lo")
