"""Control-plane benchmark: many simulated members on one real etcd, no tensor bytes.

``num_members`` members live in ``num_processes`` worker processes (plus one process per
member to be killed). Every member is a real :class:`~membership.service.Membership`: its
own lease and keepalive, its record, its epoch view; the members of one process share
one watch stream per key range (:class:`~membership.watch.WatchHub`), as agents of one
host would. Versions go through the runtime's own pieces: trainers publish sources
(:class:`~membership.versions.VersionStore`, fenced), the epoch's coordinator (rank 0)
decides with :func:`~elastic_refit.runtime.agent.coordinate` and proposes the attempt,
every participant sees it through a watch, destinations ack (fenced, each on its own lease, with
its ``done`` key in the same write) and the other participants write their ``done`` keys in
the epoch's store -- batched per process as one host agent would
(:meth:`~membership.versions.VersionStore.ack_many`, ``EpochKV.multi_set``: 64 members a
transaction), the coordinator counts the acks
from watch events (:class:`~membership.versions.VersionTracker`) and commits (fenced), and
every member sees the commit. Nothing is transferred: a destination acks as soon as it sees
the attempt.

Measured:

- commit round: from the trainers being told to publish version ``v`` to every process
  having seen ``versions/{v}/committed`` (p50 / p99 over the versions), with its phases;
- epoch convergence: a member process is SIGKILLed (its lease is no longer kept alive, as
  in a crash); from the kill until each member sees the epoch without it (p99 / max over
  every member and kill); the goal is TTL + 0.5 s;
- etcd requests per second per idle member (etcd's own gRPC counters while nothing
  happens), and etcd's database size at the end.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from elastic_refit._validate import require_at_least
from elastic_refit.membership.attempts import OK, AttemptLedger
from elastic_refit.membership.epoch_kv import EpochKV
from elastic_refit.membership.keys import AttemptKeys
from elastic_refit.membership.leases import lease_keeper
from elastic_refit.membership.versions import AckRequest
from elastic_refit.runtime.attempt import AttemptSpec, CommitAction
from elastic_refit.runtime.coordination import Propose, coordinate
from elastic_refit.testing.stats import percentile

_TIMEOUT_S = 120.0  # one step of the driver (a startup, a round, a kill) gives up after this
NUM_CANDIDATES = 2  # leader candidates, in a process of their own (see member_specs)
_BATCH = 64  # members per batched ack transaction (etcd's --max-txn-ops is 128: two puts each)


@dataclass(frozen=True, slots=True)
class ControlPlaneConfig:
    """Bench shape: ``num_members`` in all (``num_trainers`` trainers, the rest inference
    ranks), ``num_versions`` commit rounds, ``num_kills`` SIGKILLed members (each alone in
    a process of its own, counted in ``num_members``), ``num_processes`` worker processes."""

    num_members: int = 1024
    num_versions: int = 5
    num_kills: int = 1
    num_processes: int = 4
    num_trainers: int = 0  # 0: one per 16 members
    ttl_s: int = 2
    idle_s: float = 5.0
    pool_threads: int = 16  # per process: the members' etcd writes in flight at once
    # Members joining per second, job-wide (0: all at once). Ranks of a real job start over
    # seconds; here every member shares two cores with etcd, and a thousand joins at once
    # (each a lease, a registration and an epoch for everyone) starve the keepalives.
    join_rate: float = 32.0

    def __post_init__(self) -> None:
        require_at_least("--members", self.num_members, 4)
        require_at_least("--versions", self.num_versions, 1)
        require_at_least("--kills", self.num_kills, 0)
        require_at_least("--processes", self.num_processes, 1)
        require_at_least("--ttl", self.ttl_s, 2, "etcd grants no shorter lease")
        require_at_least("--pool-threads", self.pool_threads, 1)
        if self.join_rate < 0:
            raise ValueError(f"--join-rate must be >= 0 members per second, got {self.join_rate}")
        if self.idle_s < 0:
            raise ValueError(f"--idle must be >= 0 seconds, got {self.idle_s}")
        if self.num_trainers < 0:
            raise ValueError(f"--trainers must be >= 0, got {self.num_trainers}")
        trainers = self.trainers
        if trainers + self.num_kills + 1 > self.num_members:
            raise ValueError(f"--members {self.num_members} leaves no inference rank besides the "
                             f"{self.num_kills} to be killed ({trainers} trainers)")

    @property
    def trainers(self) -> int:
        return self.num_trainers or max(1, self.num_members // 16)


@dataclass(frozen=True, slots=True)
class _MemberSpec:
    role: str
    member_id: str
    candidate: bool


@dataclass(frozen=True, slots=True)
class _WorkerSpec:
    endpoints: tuple[str, ...]
    job: str
    members: tuple[_MemberSpec, ...]
    ttl_s: int
    pool_threads: int
    join_rate: float = 0.0  # this process's members per second (0: all at once)


def member_specs(cfg: ControlPlaneConfig) -> tuple[list[list[_MemberSpec]], list[_MemberSpec]]:
    """(members of each process, the members to be killed), pure. The first process holds
    the ``NUM_CANDIDATES`` leader candidates (trainers) and nobody else: in a job every rank
    is a process of its own, and the leader's work (decoding every member record on each
    change) must not delay the keepalives of hundreds of members that merely share its
    process here. Trainers come first (the epoch's rank 0, its coordinator, is a trainer);
    the victims are inference ranks, each alone in its process."""
    trainers = [f"t{i:04d}" for i in range(cfg.trainers)]
    num_inference = cfg.num_members - cfg.trainers - cfg.num_kills
    everyone = ([_MemberSpec("trainer", m, False) for m in trainers]
                + [_MemberSpec("inference", f"i{i:04d}", False) for i in range(num_inference)])
    num_candidates = min(NUM_CANDIDATES, cfg.trainers)
    leaders = [_MemberSpec(s.role, s.member_id, True) for s in everyone[:num_candidates]]
    workers: list[list[_MemberSpec]] = [[] for _ in range(cfg.num_processes)]
    for k, spec in enumerate(everyone[num_candidates:]):
        workers[k % cfg.num_processes].append(spec)
    victims = [_MemberSpec("inference", f"v{i:04d}", False) for i in range(cfg.num_kills)]
    return [leaders] + [w for w in workers if w], victims


# ---------------------------------------------------------------- worker process
class _Worker:
    """The members of one process, and (when one of them is rank 0) the coordinator."""

    def __init__(self, spec: _WorkerSpec) -> None:
        from elastic_refit.membership.client import EtcdClient
        from elastic_refit.membership.config import MembershipConfig
        from elastic_refit.membership.keys import JobKeys
        from elastic_refit.membership.service import Membership
        from elastic_refit.membership.versions import VersionStore, VersionTracker
        from elastic_refit.membership.view import MemberRecord
        from elastic_refit.membership.watch import WatchHub

        self.spec = spec
        self.client = EtcdClient(list(spec.endpoints))
        self.keys = keys = JobKeys(spec.job)
        start, end = keys.control_range
        self.control = WatchHub(self.client, start, end, name="control")
        self.versions_hub = WatchHub(self.client, keys.versions_prefix,
                                     keys.versions_prefix[:-1] + "0", name="versions")
        self.store_hub = WatchHub(self.client, keys.store_root, keys.store_root[:-1] + "0", name="store")
        self.tracker = VersionTracker(self.client, spec.job, hub=self.versions_hub)
        self.versions = VersionStore(self.client, spec.job)
        self.ledger = AttemptLedger(self.versions)
        self.pool = ThreadPoolExecutor(spec.pool_threads, thread_name_prefix="member")
        self.lock = threading.Lock()
        self.seen_epoch: dict[str, dict[int, float]] = {}  # member -> epoch -> first seen (time.time)
        self.epoch_digests: dict[int, str] = {}  # epoch -> digest of its member ids
        self.done: dict[tuple[int, int], set[str]] = {}  # (epoch, seq) -> participants done (watched)
        self.committed_at: dict[int, float] = {}  # version -> when this process saw its commit
        self.errors: list[str] = []
        self.phases: dict[int, dict[str, float]] = {}  # version -> coordinator phase -> time.time
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.members: dict[str, Any] = {}
        self._stores: dict[int, EpochKV] = {}  # epoch -> its rendezvous store
        self.loop_lag_max_s = 0.0
        self.samples: Any = None
        for m in spec.members:
            record = MemberRecord(role=m.role, member_id=m.member_id, incarnation=f"{os.getpid()}-{m.member_id}",
                                  host=f"h{os.getpid()}", domain=f"d{os.getpid()}", device="cpu")
            config = MembershipConfig(ttl_s=spec.ttl_s, candidate=m.candidate)
            self.members[m.member_id] = Membership(self.client, spec.job, record, config, watch_hub=self.control)
        self.tracker.on_change(self._on_versions)
        self.store_hub.watcher.add_listener(self._on_store)

    # -- start-up
    def start(self) -> float:
        t0 = time.monotonic()
        self.client.spawn(self._watch_lag(), name="lag-monitor")
        if os.environ.get("ELASTIC_REFIT_CP_SAMPLE"):  # diagnostics: where the loop thread spends its time
            threading.Thread(target=self._sample_loop, name="sampler", daemon=True).start()
        self.control.start()
        self.tracker.start()
        self.store_hub.start()
        for member_id, membership in self.members.items():
            membership.on_view(lambda old, new, me=member_id: self._on_view(me, new))
        # Concurrently: each start waits for its own key to come back through the shared
        # watch, and one after another that adds up to minutes while etcd is busy. Paced
        # at the process's join rate.
        futures = []
        for k, m in enumerate(self.members.values()):
            if self.spec.join_rate > 0:
                time.sleep(max(0.0, t0 + k / self.spec.join_rate - time.monotonic()))
            futures.append(self.pool.submit(m.start))
        for future in futures:
            future.result()
        threading.Thread(target=self._coordinator, name="coordinator", daemon=True).start()
        return time.monotonic() - t0

    async def _watch_lag(self) -> None:
        """How late the client loop runs a 50 ms timer (a busy loop delays keepalives and watches)."""
        import asyncio

        while True:
            t = time.monotonic()
            await asyncio.sleep(0.05)
            lag = time.monotonic() - t - 0.05
            if lag > self.loop_lag_max_s:
                self.loop_lag_max_s = lag

    def _sample_loop(self) -> None:
        import collections
        import sys

        counts: collections.Counter = collections.Counter()
        ident = self.client._thread.ident
        while not self.stop.is_set():
            frame = sys._current_frames().get(ident)
            names = set()
            while frame is not None:
                names.add(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")
                frame = frame.f_back
            counts.update(names)
            self.samples = counts
            time.sleep(0.01)

    def _on_view(self, member_id: str, view) -> None:
        now = time.time()
        with self.lock:
            self.seen_epoch.setdefault(member_id, {}).setdefault(view.epoch, now)
            if view.epoch not in self.epoch_digests:
                self.epoch_digests[view.epoch] = members_digest(view.member_ids)
        self.wake.set()

    def _on_versions(self, reset: bool, events) -> None:
        now = time.time()
        for ev in events:
            parsed = self.keys.parse_version_key(ev.key)
            if parsed is not None and parsed[1] == "committed" and ev.kind == "put":
                with self.lock:
                    self.committed_at.setdefault(parsed[0], now)
        self.wake.set()

    def _on_store(self, reset: bool, events, snap) -> None:
        """An attempt appeared: each of this process's participants takes its part."""
        for ev in events:
            if ev.kind != "put":
                continue
            done = self.keys.parse_done_key(ev.key)
            if done is not None:
                with self.lock:
                    self.done.setdefault(done[:2], set()).add(done[2])
                self.wake.set()  # the coordinator waits for every done key
                continue
            parsed = self.keys.parse_attempt_key(ev.key)
            if parsed is None:
                continue
            epoch, seq = parsed
            spec = AttemptSpec.from_json(json.loads(ev.kv.value))
            destinations = set(spec.destinations)
            mine = [m for m in spec.participants if m in self.members]
            # As one host agent would: this process's acks (each fenced on its member's own
            # lease) and done keys go out in batched transactions, a batch per pool thread.
            acking = [m for m in mine if m in destinations]
            for start in range(0, len(acking), _BATCH):
                self.pool.submit(self._ack_batch, acking[start:start + _BATCH], epoch, seq, spec.version)
            others = [m for m in mine if m not in destinations]
            if others:
                self.pool.submit(self._done_batch, others, epoch, seq)

    def _ack_batch(self, member_ids: list[str], epoch: int, seq: int, version: int) -> None:
        """Destinations "received" the version (nothing moves here): each acks with its done key."""
        prefix = self._store(epoch).prefix
        requests = [AckRequest(self.members[m], version, epoch, f"{m}@{version}",
                               done=(prefix + AttemptKeys(seq).done(m), OK.encode().encode())) for m in member_ids]
        try:
            errors = self.versions.ack_many(requests)
        except Exception as exc:
            errors = [exc] * len(requests)
        with self.lock:
            self.errors.extend(f"{m} attempt {epoch}/{seq}: {type(e).__name__}: {e}"[:300]
                               for m, e in zip(member_ids, errors, strict=True) if e is not None)

    def _done_batch(self, member_ids: list[str], epoch: int, seq: int) -> None:
        try:
            self._store(epoch).multi_set([AttemptKeys(seq).done(m) for m in member_ids], [OK.encode()] * len(member_ids))
        except Exception as exc:
            with self.lock:
                self.errors.append(f"done keys of attempt {epoch}/{seq}: {type(exc).__name__}: {exc}"[:300])

    def _store(self, epoch: int):
        with self.lock:
            store = self._stores.get(epoch)
            if store is None:
                store = self._stores[epoch] = EpochKV(self.client, self.spec.job, epoch)
        return store

    def publish(self, version: int) -> None:
        """Every trainer of this process publishes ``version`` as a source (fenced, batched)."""
        trainers = [m for m in self.members.values() if m.record.role == "trainer"]
        try:
            errors = self.versions.publish_many(trainers, version, digest=f"src@{version}")
        except Exception as exc:
            errors = [exc] * len(trainers)
        with self.lock:
            self.errors.extend(f"{m.record.member_id} publish {version}: {e!r}"[:300]
                               for m, e in zip(trainers, errors, strict=True) if e is not None)

    # -- the coordinator: the runtime's decisions, woken by watch events
    def _coordinator(self) -> None:
        epoch, seq, pending = -1, 0, None  # pending: the attempt proposed last (seq - 1)
        while not self.stop.is_set():
            self.wake.wait(0.5)
            self.wake.clear()
            try:
                first = next(iter(self.members.values()))
                view = first.view
                if view is None or view.members[0].member_id not in self.members:
                    continue
                me = self.members[view.members[0].member_id]
                if view.epoch != epoch:
                    epoch, seq, pending = view.epoch, 0, None
                if pending is not None:
                    # Acks counted from watch events: no read, no decode until all are in.
                    if self.tracker.committed(pending.version) is None and \
                            self.tracker.num_acks(pending.version) < len(pending.destinations):
                        continue
                    with self.lock:  # done keys counted from watch events, then read once
                        num_done = len(self.done.get((epoch, seq - 1), ()))
                    if num_done < len(pending.participants):
                        continue
                    keys = [AttemptKeys(seq - 1).done(m) for m in pending.participants]
                    if not self._store(epoch).check(keys):
                        continue
                state = self.tracker.state()
                move = coordinate(view, seq, state)
                if isinstance(move, CommitAction):
                    if self.versions.commit(me, move.version, epoch, move.digest):
                        self._phase(move.version, "committed")
                        self.versions.prune(me, epoch, state, move.version)
                    pending = None
                elif (isinstance(move, Propose) and move.spec != pending
                      and self.ledger.propose(me, epoch, seq, move.spec)):
                    self._phase(move.spec.version, "proposed")
                    if seq >= 2:  # as the runtime does: nobody reads attempt seq - 2 again
                        self.ledger.prune(epoch, seq - 2, self._store(epoch))
                    pending, seq = move.spec, seq + 1
            except Exception as exc:
                with self.lock:
                    self.errors.append(f"coordinator: {type(exc).__name__}: {exc}"[:300])
                time.sleep(0.05)

    def _phase(self, version: int, name: str) -> None:
        with self.lock:
            self.phases.setdefault(version, {}).setdefault(name, time.time())

    def epochs(self) -> dict[str, Any]:
        """Per epoch: the digest of its member ids, how many of this process's members saw
        it and when the last one did."""
        with self.lock:
            out: dict[int, dict[str, Any]] = {}
            for seen in self.seen_epoch.values():
                for epoch, t in seen.items():
                    entry = out.setdefault(epoch, {"digest": self.epoch_digests[epoch], "num_seen": 0, "last": t})
                    entry["num_seen"] += 1
                    entry["last"] = max(entry["last"], t)
            return {"epochs": out, "num_members": len(self.members), "errors": list(self.errors[:5]),
                    "lost": [m for m, ms in self.members.items() if ms.lost.is_set()]}

    def epoch_times(self, epoch: int) -> list[float]:
        with self.lock:
            return [seen[epoch] for seen in self.seen_epoch.values() if epoch in seen]

    def diag(self) -> dict[str, Any]:
        """Since the last call: this process's CPU seconds, its lease keepalives' answer
        times and its client loop's worst lag (then both restart)."""
        keeper = lease_keeper(self.client)
        latencies = sorted(keeper.latencies)
        keeper.latencies.clear()
        lag, self.loop_lag_max_s = self.loop_lag_max_s, 0.0
        return {"cpu_s": time.process_time(), "keepalives": len(latencies),
                "keepalive_p50_s": percentile(latencies, 50) if latencies else 0.0,
                "keepalive_p99_s": percentile(latencies, 99) if latencies else 0.0,
                "keepalive_max_s": latencies[-1] if latencies else 0.0, "loop_lag_max_s": lag}

    def report(self) -> dict[str, Any]:
        with self.lock:
            return {"phases": {v: dict(p) for v, p in self.phases.items()}, "errors": list(self.errors),
                    "loop_lag_max_s": self.loop_lag_max_s,
                    "samples": self.samples.most_common(30) if self.samples else [],
                    "lost": [m for m, ms in self.members.items() if ms.lost.is_set()]}

    def close(self) -> None:
        self.stop.set()
        self.wake.set()
        for membership in self.members.values():
            with contextlib.suppress(Exception):
                membership.close()
        self.pool.shutdown(wait=True)
        for hub in (self.control, self.versions_hub, self.store_hub):
            hub.close()
        self.client.close()


def _worker_main(spec: _WorkerSpec, conn) -> None:
    """One worker process: serve the driver's commands over ``conn`` until ``close``."""
    import logging
    import sys

    from elastic_refit.log import configure_logging

    # Warnings and errors only: 1,024 members logging every epoch change is noise here.
    configure_logging(json=True, level=logging.WARNING)
    # Diagnostics: a shorter GIL switch interval lets the lease keeper's thread in before a
    # busy client loop (hundreds of members per process) gives the GIL up on its own.
    if os.environ.get("ELASTIC_REFIT_CP_SWITCH_INTERVAL_S"):
        sys.setswitchinterval(float(os.environ["ELASTIC_REFIT_CP_SWITCH_INTERVAL_S"]))
    worker = None
    try:
        worker = _Worker(spec)
        conn.send({"ready": True})
        while True:
            command, arg = conn.recv()
            if command == "start":
                conn.send({"started_s": worker.start()})
            elif command == "publish":
                worker.publish(arg)
                conn.send({"ok": True})
            elif command == "report":
                conn.send(worker.report())
            elif command == "diag":
                conn.send(worker.diag())
            elif command == "epochs":
                conn.send(worker.epochs())
            elif command == "epoch_times":
                conn.send({"times": worker.epoch_times(arg)})
            elif command == "committed":
                with worker.lock:
                    conn.send({"at": worker.committed_at.get(arg), "errors": list(worker.errors[:5])})
            elif command == "close":
                break
    except Exception as exc:
        with contextlib.suppress(Exception):
            conn.send({"error": f"{type(exc).__name__}: {exc}"[:1000]})
    finally:
        if worker is not None and worker.samples:
            print(json.dumps({"pid": os.getpid(), "loop_lag_max_s": worker.loop_lag_max_s,
                              "samples": worker.samples.most_common(40)}), file=sys.stderr, flush=True)
        if worker is not None:
            worker.close()
        with contextlib.suppress(Exception):
            conn.send({"closed": True})


class _Process:
    def __init__(self, ctx, spec: _WorkerSpec) -> None:
        self.spec = spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(spec, child), daemon=True)
        self.proc.start()
        child.close()

    def ask(self, command: str, arg: Any = None, timeout_s: float = _TIMEOUT_S) -> dict[str, Any]:
        self.conn.send((command, arg))
        return self.receive(timeout_s)

    def receive(self, timeout_s: float = _TIMEOUT_S) -> dict[str, Any]:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"worker {self.proc.pid} did not answer within {timeout_s} s")
        reply = self.conn.recv()
        if "error" in reply:
            raise RuntimeError(f"worker {self.proc.pid}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.conn.send(("close", None))
                self.conn.poll(10.0)
            self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)


# ---------------------------------------------------------------- driver
@dataclass(frozen=True, slots=True)
class _Measured:
    """What one run of the bench measured, before it is summed up: the start-up seconds,
    the idle upkeep, the commit rounds and kills, the workers' errors and lost members,
    etcd's size and key count at the end, and where each phase's time went."""

    startup_s: float
    idle: dict[str, Any]
    rounds: list[dict[str, Any]]
    kills: list[dict[str, Any]]
    errors: list[str]
    lost: list[str]
    db_bytes: int
    num_keys: int
    phases: list[dict[str, Any]]


def run_control_plane(cfg: ControlPlaneConfig, progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Run the bench; returns its figures (see the module docstring)."""
    from elastic_refit.membership.client import EtcdClient
    from elastic_refit.testing.etcd import EtcdServer
    from elastic_refit.testing.soak import etcd_requests

    job = f"cp-{os.getpid()}"
    workers_of, victims = member_specs(cfg)
    procs: list[_Process] = []
    victim_procs: list[_Process] = []
    with EtcdServer(name="cp") as etcd:
        endpoints = tuple(etcd.endpoints)
        client = EtcdClient(list(endpoints))
        try:
            t0 = time.monotonic()
            # The start-up phase counts from here (the workers' CPU from their own start).
            meter = _PhaseMeter([], etcd.pids[0] if etcd.pids else None)
            progress(f"starting {cfg.num_members} members in {len(workers_of)} processes "
                     f"(+{len(victims)} to be killed), lease TTL {cfg.ttl_s} s, "
                     + (f"{cfg.join_rate:g} joins/s" if cfg.join_rate else "all joining at once"))
            _spawn_workers(cfg, endpoints, job, workers_of, victims, procs, victim_procs)
            everyone, startup_s = _start_members(procs, victim_procs, meter, t0, progress)
            idle = _measure_idle(etcd_requests, endpoints[0], cfg.idle_s, len(everyone))
            if idle:
                progress(f"idle: {idle['idle_requests_per_s_per_member']:.2f} etcd requests/s per member")
                progress(_meter_line(meter.mark("idle")))
            rounds, kills = _rounds_and_kills(cfg, procs, victim_procs, everyone, meter, progress)
            reports = [p.ask("report") for p in procs]
            measured = _Measured(startup_s=startup_s, idle=idle, rounds=rounds, kills=kills,
                                 errors=[e for r in reports for e in r["errors"]],
                                 lost=[m for r in reports for m in r["lost"]], db_bytes=client.db_size(),
                                 num_keys=client.count_prefix(f"/elastic-refit/{job}/"), phases=meter.phases)
        finally:
            for p in procs + victim_procs:
                p.close()
            client.close()
    return _figures(cfg, len(workers_of) + len(victims), measured)


def _spawn_workers(cfg: ControlPlaneConfig, endpoints: tuple[str, ...], job: str,
                   workers_of: list[list[_MemberSpec]], victims: list[_MemberSpec],
                   procs: list[_Process], victim_procs: list[_Process]) -> None:
    """Start a worker process for each share of members and one per victim, appending each
    to ``procs`` or ``victim_procs`` as soon as it runs (the caller closes them all)."""
    ctx = mp.get_context("spawn")  # gRPC channels do not survive fork()
    for members in workers_of:  # each process's share of the job-wide rate
        rate = cfg.join_rate * len(members) / cfg.num_members
        procs.append(_Process(ctx, _WorkerSpec(endpoints, job, tuple(members), cfg.ttl_s, cfg.pool_threads,
                                               rate)))
    for victim in victims:
        victim_procs.append(_Process(ctx, _WorkerSpec(endpoints, job, (victim,), cfg.ttl_s, 2)))


def _start_members(procs: list[_Process], victim_procs: list[_Process], meter: _PhaseMeter, t0: float,
                   progress: Callable[[str], None]) -> tuple[set[str], float]:
    """Start every member and wait for the epoch that holds them all; returns (every
    member id, seconds since ``t0``)."""
    # Every process imported and connected before any member joins: a join burst
    # beside other processes' start-up is not what a job's ranks see.
    for p in procs + victim_procs:
        p.receive(timeout_s=3 * _TIMEOUT_S)
    for p in procs + victim_procs:
        p.conn.send(("start", None))
    started = [p.receive(timeout_s=3 * _TIMEOUT_S) for p in procs + victim_procs]
    everyone = {m.member_id for p in procs + victim_procs for m in p.spec.members}
    meter.procs = procs
    try:
        epoch, _ = _wait_epoch(procs, everyone, "every member")
    finally:
        progress(_meter_line(meter.mark("startup")))
    startup_s = time.monotonic() - t0
    progress(f"epoch {epoch}: all {len(everyone)} members in {startup_s:.1f} s "
             f"(slowest process start {max(s['started_s'] for s in started):.1f} s)")
    return everyone, startup_s


def _rounds_and_kills(cfg: ControlPlaneConfig, procs: list[_Process], victim_procs: list[_Process],
                      everyone: set[str], meter: _PhaseMeter,
                      progress: Callable[[str], None]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``num_versions`` commit rounds, then for each victim a kill and one more round
    (marked ``after_kill``); returns (rounds, kills)."""
    try:
        rounds = [_commit_round(procs, v, progress) for v in range(1, cfg.num_versions + 1)]
    finally:
        progress(_meter_line(meter.mark("rounds")))
    kills = []
    alive = set(everyone)
    version = cfg.num_versions
    for victim_proc in victim_procs:
        kills.append(_kill_trial(procs, victim_proc, alive, progress))
        alive -= {m.member_id for m in victim_proc.spec.members}
        version += 1
        rounds.append({**_commit_round(procs, version, progress), "after_kill": True})
    if victim_procs:
        progress(_meter_line(meter.mark("kills")))
    return rounds, kills


def _figures(cfg: ControlPlaneConfig, num_processes: int, m: _Measured) -> dict[str, Any]:
    """The bench's figures (see the module docstring) from what one run measured."""
    steady = [r["round_s"] for r in m.rounds if not r.get("after_kill")]
    convergence = [s for k in m.kills for s in k["per_member_s"]]
    return {
        "members": cfg.num_members,
        "trainers": cfg.trainers,
        "processes": num_processes,
        "ttl_s": cfg.ttl_s,
        "versions": len(steady),
        "kills": len(m.kills),
        "startup_s": m.startup_s,
        "commit_round_p50_s": percentile(steady, 50),
        "commit_round_p99_s": percentile(steady, 99),
        "commit_round_max_s": max(steady),
        "commit_round_after_kill_s": [r["round_s"] for r in m.rounds if r.get("after_kill")],
        "epoch_convergence_p50_s": percentile(convergence, 50),
        "epoch_convergence_p99_s": percentile(convergence, 99),
        "epoch_convergence_max_s": max(convergence) if convergence else float("nan"),
        "kill_seen_by_all": all(k["seen_by_all"] for k in m.kills),
        "goal_epoch_convergence_s": cfg.ttl_s + 0.5,
        "goal_commit_round_s": 1.0,
        "etcd_requests_per_s_per_member": m.idle.get("idle_requests_per_s_per_member", float("nan")),
        "etcd_requests_by_method": m.idle.get("idle_requests_by_method", {}),
        "idle_seconds": m.idle.get("idle_seconds", 0.0),
        "etcd_db_bytes": m.db_bytes,
        "etcd_keys_final": m.num_keys,
        "members_lost": m.lost,
        "errors": m.errors[:20],
        "num_errors": len(m.errors),
        "per_round": m.rounds,
        "per_phase": m.phases,
        "per_kill": [{k: v for k, v in kill.items() if k != "per_member_s"} for kill in m.kills],
        "config": asdict(cfg),
    }


def _cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) a process used so far (Linux; NaN when unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


class _PhaseMeter:
    """Where one phase's time went: wall seconds, etcd's and the workers' CPU seconds, the
    workers' worst keepalive answer time and loop lag, and the load average (a 2-core
    machine shared with other work is the usual limit here)."""

    def __init__(self, procs: list[_Process], etcd_pid: int | None) -> None:
        self.procs, self.etcd_pid = procs, etcd_pid
        self.phases: list[dict[str, Any]] = []
        self._t, self._etcd = time.monotonic(), _cpu_s(etcd_pid)
        self._workers: dict[int, float] = {}  # pid -> CPU seconds at the last mark (0: process start)

    def _diag(self) -> list[dict[str, Any]]:
        return [p.ask("diag") for p in self.procs]

    def mark(self, phase: str) -> dict[str, Any]:
        diags = self._diag()
        now, etcd = time.monotonic(), _cpu_s(self.etcd_pid)
        workers = {p.proc.pid: d["cpu_s"] for p, d in zip(self.procs, diags, strict=True)}
        entry = {"phase": phase, "wall_s": round(now - self._t, 3), "etcd_cpu_s": round(etcd - self._etcd, 3),
                 "workers_cpu_s": round(sum(workers[k] - self._workers.get(k, 0.0) for k in workers), 3),
                 "keepalive_p99_s": round(max(d["keepalive_p99_s"] for d in diags), 4),
                 "keepalive_max_s": round(max(d["keepalive_max_s"] for d in diags), 4),
                 "loop_lag_max_s": round(max(d["loop_lag_max_s"] for d in diags), 4),
                 "load_avg_1m": os.getloadavg()[0]}
        self._t, self._etcd, self._workers = now, etcd, workers
        self.phases.append(entry)
        return entry


def members_digest(member_ids) -> str:
    """A short digest of a set of member ids (workers report epochs by it)."""
    return hashlib.blake2b("\n".join(sorted(member_ids)).encode(), digest_size=8).hexdigest()


def _meter_line(m: dict[str, Any]) -> str:
    return (f"{m['phase']}: {m['wall_s']:.1f} s wall, etcd {m['etcd_cpu_s']:.1f} s CPU, workers "
            f"{m['workers_cpu_s']:.1f} s CPU, keepalive answer p99 {m['keepalive_p99_s'] * 1e3:.0f} ms "
            f"(max {m['keepalive_max_s'] * 1e3:.0f}), loop lag max {m['loop_lag_max_s'] * 1e3:.0f} ms, "
            f"load {m['load_avg_1m']:.1f}")


def _wait_epoch(procs: list[_Process], members: set[str], what: str, after: int = -1) -> tuple[int, float]:
    """The first epoch after ``after`` of exactly ``members`` that every member of every
    process saw: (epoch, when the last member saw it). (The survivors of a kill may have
    had an epoch of their own before the victim joined.)"""
    want = members_digest(members)
    deadline = time.monotonic() + _TIMEOUT_S
    while True:
        reports = [p.ask("epochs") for p in procs]
        candidates = sorted({e for r in reports for e, x in r["epochs"].items() if x["digest"] == want and e > after})
        for epoch in candidates:
            entries = [r["epochs"].get(epoch) for r in reports]
            if all(x is not None and x["num_seen"] == r["num_members"] for x, r in zip(entries, reports, strict=True)):
                return epoch, max(x["last"] for x in entries)  # type: ignore[index]
        if time.monotonic() > deadline:
            lost = [m for r in reports for m in r["lost"]]
            raise TimeoutError(f"no epoch with {what} seen by all members within {_TIMEOUT_S} s "
                               f"(epochs {candidates}, lost members {lost[:10]}, errors "
                               f"{[e for r in reports for e in r['errors']][:5]})")
        time.sleep(0.1)


def _measure_idle(etcd_requests, endpoint: str, idle_s: float, num_members: int) -> dict[str, Any]:
    """etcd requests per second per member while nothing but the members' upkeep happens."""
    if idle_s <= 0:
        return {}
    time.sleep(1.0)  # the start-up's stragglers settle first
    before, t0 = etcd_requests(endpoint), time.monotonic()
    time.sleep(idle_s)
    after, seconds = etcd_requests(endpoint), time.monotonic() - t0
    rates = {m: (after.get(m, 0.0) - before.get(m, 0.0)) / seconds / num_members for m in after}
    return {"idle_seconds": seconds, "idle_requests_per_s_per_member": sum(rates.values()),
            "idle_requests_by_method": {m: round(r, 4) for m, r in sorted(rates.items()) if r > 0}}


def _commit_round(procs: list[_Process], version: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """Publish ``version`` from every trainer; wait until every process saw it committed."""
    t0 = time.time()
    for p in procs:
        p.conn.send(("publish", version))
    for p in procs:
        p.receive()
    published = time.time()
    deadline = time.monotonic() + _TIMEOUT_S
    while True:
        replies = [p.ask("committed", version) for p in procs]
        seen = [r["at"] for r in replies]
        if all(s is not None for s in seen):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"version {version} not committed everywhere within {_TIMEOUT_S} s "
                               f"(errors {[e for r in replies for e in r['errors']][:5]})")
        time.sleep(0.01)
    reports = [p.ask("report") for p in procs]
    phases = next((r["phases"][version] for r in reports if version in r["phases"]), {})
    result = {"version": version, "round_s": max(seen) - t0, "published_s": published - t0,  # type: ignore[type-var]
              "proposed_s": phases.get("proposed", float("nan")) - t0,
              "committed_s": phases.get("committed", float("nan")) - t0,
              "seen_by_all_s": max(seen) - t0}  # type: ignore[type-var]
    progress(f"version {version}: committed and seen by all in {result['round_s'] * 1e3:.0f} ms "
             f"(published {result['published_s'] * 1e3:.0f}, proposed {result['proposed_s'] * 1e3:.0f}, "
             f"commit written {result['committed_s'] * 1e3:.0f} ms)")
    return result


def _kill_trial(procs: list[_Process], victim: _Process, everyone: set[str],
                progress: Callable[[str], None]) -> dict[str, Any]:
    """SIGKILL ``victim`` (no clean leave: its lease runs out); time each member's view."""
    gone = {m.member_id for m in victim.spec.members}
    before, _ = _wait_epoch(procs, everyone, "every member")  # the epoch the kill ends
    t_kill = time.time()
    victim.proc.kill()
    victim.proc.join(5.0)
    survivors = everyone - gone
    epoch, _ = _wait_epoch(procs, survivors, f"the survivors of {sorted(gone)}", after=before)
    per_member = [t - t_kill for p in procs for t in p.ask("epoch_times", epoch)["times"]]
    result = {"victims": sorted(gone), "epoch": epoch, "per_member_s": per_member,
              "seen_by_all": len(per_member) == len(survivors),
              "first_s": min(per_member), "max_s": max(per_member), "p99_s": percentile(per_member, 99)}
    progress(f"killed {sorted(gone)}: epoch {epoch} seen by all {len(per_member)} survivors "
             f"{result['first_s']:.3f}-{result['max_s']:.3f} s after the kill")
    return result
