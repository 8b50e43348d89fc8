"""Run chaos trials: a real etcd, warm member processes, faults, the oracle, a summary.

One etcd (or 3-node cluster) serves a whole run; every trial is a fresh job (its own key
prefix) of 2 trainer replicas and ``num_inference`` inference replicas, so recovery is
always possible. Members run in a pool of warm worker processes reused across trials; a
worker a fault killed is replaced. The parent watches the trial's fault records and does
the parent's part of each fault (SIGCONT after a stop, etcd down and up, restarting a
victim as a new incarnation), then collects reports, waits for leases to settle and asks
the oracle for a verdict.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait as wait_conns
from pathlib import Path
from typing import Any

import numpy as np
from elastic_refit.chaos.faults import Scenario
from elastic_refit.chaos.inject import FaultHook, Killer, read_fault_records
from elastic_refit.chaos.oracle import CATEGORIES, TrialEvidence, TrialVerdict, check_all
from elastic_refit.chaos.worker import worker_main

from elastic_refit._validate import require_at_least
from elastic_refit.testing.logs import read_logs
from elastic_refit.testing.processes import pid_alive
from elastic_refit.testing.specs import tiny_spec_json

__all__ = ["ChaosRun", "TrialResult", "run_matrix", "summarize"]

TTL_S = 2


# Small buckets: a tensor travels as several messages, so "transfer chunk k" has meaning.
MEMBER_CONFIG = {"bucket_bytes": 4096, "staging_bytes": 1 << 16, "version_timeout_s": 40.0}


# ---- the worker pool --------------------------------------------------------------------
@dataclass
class _Worker:
    proc: Any
    conn: Any
    pid: int
    task: tuple[str, int] | None = None  # (member_id, life) it runs now


class WorkerPool:
    """Warm worker processes; keeps ``spares`` idle ones ready for restarts, so a victim's
    new incarnation starts at once (inside its old lease's TTL), not after an import."""

    def __init__(self, killer: Killer, spares: int = 2, gpu: bool = False) -> None:
        self.ctx = mp.get_context("spawn")
        self.killer = killer
        self.spares = spares
        self.gpu = gpu
        self.workers: list[_Worker] = []
        self.started_pids: list[int] = []

    def _spawn(self) -> _Worker:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=worker_main, args=(child, self.gpu), daemon=True, name="chaos-worker")
        proc.start()
        child.close()
        w = _Worker(proc, parent, proc.pid)
        self.killer.adopt(proc.pid)
        self.started_pids.append(proc.pid)
        self.workers.append(w)
        return w

    def replenish(self, count: int) -> None:
        """Start workers until ``count`` + ``spares`` are idle, without waiting for them
        (they import while the last trial settles)."""
        idle = [w for w in self.workers if w.task is None]
        for _ in range(count + self.spares - len(idle)):
            self._spawn()

    def ensure(self, count: int, timeout_s: float = 180.0) -> None:
        """At least ``count`` + ``spares`` idle warm workers (waits for them to import: eight
        torch imports at once took over 60 s on this 2-core machine at load 15-20)."""
        self.replenish(count)
        deadline = time.monotonic() + timeout_s
        for w in [w for w in self.workers if w.task is None]:
            if getattr(w, "ready", False):
                continue
            left = max(0.1, deadline - time.monotonic())
            if not w.conn.poll(left):
                raise RuntimeError(f"chaos worker {w.pid} not ready within {timeout_s} s")
            _kind, _ = w.conn.recv()
            w.ready = True  # type: ignore[attr-defined]

    def acquire(self) -> _Worker:
        for w in self.workers:
            if w.task is None and getattr(w, "ready", False) and w.proc.is_alive():
                return w
        self.ensure(1)
        return self.acquire()

    def drop(self, w: _Worker) -> None:
        """Forget a worker that died (reaped) or must not be reused (killed by pid)."""
        if w.proc.is_alive():
            with contextlib.suppress(ProcessLookupError, ValueError):
                self.killer.signal(w.pid, signal.SIGCONT)
                self.killer.signal(w.pid, signal.SIGKILL)
        w.proc.join(5)
        with contextlib.suppress(Exception):
            w.conn.close()
        self.killer.forget(w.pid)
        if w in self.workers:
            self.workers.remove(w)

    def close(self) -> list[int]:
        """Stop every worker (None, then SIGKILL by pid); returns pids still alive after."""
        for w in list(self.workers):
            with contextlib.suppress(Exception):
                w.conn.send(None)
        for w in list(self.workers):
            w.proc.join(3)
            self.drop(w)
        return [p for p in self.started_pids if pid_alive(p)]


def _children_of(pids: set[int]) -> list[int]:
    """Live processes whose parent is one of ``pids``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[1]) in pids:
                out.append(int(entry))
    return out


# The runs of this process not yet closed (a trial's stray check must not count the warm
# workers and etcd of another run in the same process as its own leftovers).
_LIVE_RUNS: weakref.WeakValueDictionary[int, ChaosRun] = weakref.WeakValueDictionary()


# ---- one trial ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TrialResult:
    scenario: Scenario
    verdict: TrialVerdict
    wall_s: float
    job: str
    log_dir: str | None  # kept when the trial failed
    evidence: TrialEvidence | None = field(default=None, repr=False, compare=False)  # what the oracle judged

    def categories(self) -> dict[str, bool]:
        return {c: self.verdict.has(c) for c in CATEGORIES}

    def to_json(self) -> dict[str, Any]:
        return {"name": self.scenario.name, "victim": self.scenario.victim, "fault": self.scenario.fault,
                "phase": self.scenario.phase, "seed": self.scenario.seed, "wall_s": round(self.wall_s, 3),
                "job": self.job, "log_dir": self.log_dir, **self.verdict.to_json()}


class _Etcd:
    """The run's etcd: one node or a 3-node cluster; the fault side of etcd restarts."""

    def __init__(self, nodes: int) -> None:
        from elastic_refit.testing.etcd import EtcdCluster, EtcdServer

        self.cluster = EtcdServer(name="chaos") if nodes == 1 else EtcdCluster(nodes, name="chaos3")
        self.cluster.start()

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(self.cluster.endpoints)

    def bounce(self, down_s: float, then: Callable[[], None]) -> threading.Thread:
        """SIGKILL a node (the raft leader of a cluster), call ``then``, restart after ``down_s``."""

        def run() -> None:
            index = self.cluster.leader_index() if self.cluster.size > 1 else 0
            self.cluster.stop_node(index, signal.SIGKILL)
            then()
            time.sleep(down_s)
            self.cluster.restart_node(index)

        t = threading.Thread(target=run, name="etcd-bounce", daemon=True)
        t.start()
        return t

    @property
    def pids(self) -> set[int]:
        return set(self.cluster.pids)

    def stop(self) -> None:
        self.cluster.stop()


@dataclass
class ChaosRun:
    """A run of many trials sharing one etcd and one worker pool."""

    root: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="elastic-refit-chaos-"))
    keep_logs: bool = False
    deadline_s: float = 60.0
    progress: Callable[[str], None] = lambda _m: None
    backend: str = "gloo"  # members' communicators: gloo on the CPU, or NCCL on GPU 0
    cpu_burners: int = 0  # processes that spin for the whole run (a loaded machine)

    def __post_init__(self) -> None:
        from elastic_refit.transport.protocol import Backend

        if self.deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")
        self.backend = Backend.parse(self.backend).value
        self.killer = Killer()
        self.pool = WorkerPool(self.killer, gpu=self.backend != "gloo")
        self._etcd: dict[int, _Etcd] = {}
        require_at_least("cpu_burners", self.cpu_burners, 0)
        self._burners = [mp.get_context("spawn").Process(target=_burn, daemon=True, name="chaos-burner")
                         for _ in range(self.cpu_burners)]
        for proc in self._burners:
            proc.start()
        _LIVE_RUNS[id(self)] = self

    def owned_pids(self) -> set[int]:
        """The processes this run started and still holds: workers, etcd nodes, burners."""
        return ({w.pid for w in self.pool.workers} | {pid for e in self._etcd.values() for pid in e.pids}
                | {b.pid for b in self._burners if b.pid is not None})

    def _device_config(self) -> dict[str, Any]:
        if self.backend == "gloo":
            return {}
        return {"backend": self.backend, "device": "cuda:0"}

    def etcd(self, nodes: int) -> _Etcd:
        if nodes not in self._etcd:
            self._etcd[nodes] = _Etcd(nodes)
        return self._etcd[nodes]

    def close(self) -> list[int]:
        """Stop workers and etcd; returns pids that survived (should be none)."""
        _LIVE_RUNS.pop(id(self), None)
        left = self.pool.close()
        for proc in self._burners:  # ours, by their process objects
            proc.terminate()
            proc.join(5)
        pids: list[int] = []
        for e in self._etcd.values():
            pids += list(e.pids)
            e.stop()
        if not self.keep_logs:
            shutil.rmtree(self.root, ignore_errors=True)
        return left + [p for p in pids if pid_alive(p)]

    # ---- a trial -------------------------------------------------------------------------
    def run_trial(self, scenario: Scenario, index: int = 0,
                  narrate: Callable[[str], None] | None = None) -> TrialResult:
        """Run one scenario end to end and judge it; ``narrate`` (optional) is told of
        faults, restarts, commits and catch-ups as they happen."""
        from elastic_refit.membership import EtcdClient

        etcd = self.etcd(scenario.etcd_nodes)
        job = f"chaos-{index}-{uuid.uuid4().hex[:6]}"
        trial_dir = Path(self.root) / job
        trial_dir.mkdir(parents=True)
        members = [("trainer", "t0", 0), ("trainer", "t1", 1)] + [
            ("inference", f"i{k}", 2 + k) for k in range(scenario.num_inference)]
        layout_of = {m: (role, rank) for role, m, rank in members}
        versions = tuple(range(1, scenario.versions + 1))
        spec = scenario.spec_json or tiny_spec_json(scenario.num_inference)
        self.pool.ensure(len(members))
        t_start = time.monotonic()
        running: dict[str, tuple[Any, str, int]] = {}  # incarnation -> (worker, member_id, life)
        latest: dict[str, str] = {}  # member_id -> latest incarnation
        reports: dict[str, dict[str, Any]] = {}
        died: set[str] = set()
        pending_restarts: list[tuple[float, str, int]] = []  # (at monotonic, member_id, life)
        handled: set[int] = set()
        victims: set[str] = set()
        etcd_threads: list[threading.Thread] = []
        restart_after_exit: dict[str, tuple[str, int]] = {}  # incarnation -> (member, next life)
        reached: set[str] = set()  # incarnations holding the last version, waiting for stop
        stopping = False

        def start(member_id: str, life: int) -> None:
            from elastic_refit.testing.job import MemberSpec

            role, rank = layout_of[member_id]
            incarnation = f"{member_id}-L{life}-{uuid.uuid4().hex[:4]}"
            faults = tuple((i, f) for i, f in enumerate(scenario.plan.faults)
                           if f.life == life and f.matches_member(role, member_id))
            hook = FaultHook(member_id, life, faults, str(trial_dir)) if faults else None
            member = MemberSpec(job, role, member_id, rank, etcd.endpoints,
                                "d-train" if role == "trainer" else "d-infer", spec_json=spec,
                                versions=versions, incarnation=incarnation,
                                pause_s=scenario.trainer_pause_s if role == "trainer" else 0.0,
                                config={**MEMBER_CONFIG, **self._device_config(), **(scenario.member_config or {})})
            w = self.pool.acquire()
            w.task = (member_id, life)
            w.conn.send((member, hook, str(trial_dir / f"{incarnation}.log")))
            running[incarnation] = (w, member_id, life)
            latest[member_id] = incarnation
            if life and narrator is not None:
                narrator.restarted(member_id, incarnation)

        narrator = _Narrator(narrate, etcd.endpoints, job, trial_dir) if narrate is not None else None
        commits = _CommitRecorder(etcd.endpoints, job)
        def take_new_faults(now: float) -> None:
            """The parent side of every newly fired fault."""
            for record in read_fault_records(trial_dir):
                if record["index"] in handled:
                    continue
                handled.add(record["index"])
                fault = scenario.plan.faults[record["index"]]
                if narrator is not None:
                    narrator.fault(fault, record)
                incarnation = next((inc for inc, (_, m, life) in running.items()
                                    if m == record["member_id"] and life == record["life"]), None)
                if fault.kind != "etcd_restart" and fault.kind != "slow" and incarnation:
                    victims.add(incarnation)
                if fault.kind == "stop":
                    self.killer.cont_later(record["pid"], max(0.0, record["t"] + fault.duration_s - time.time()))
                elif fault.kind == "etcd_restart":
                    ack = trial_dir / f"ack-{record['index']}"
                    etcd_threads.append(etcd.bounce(fault.duration_s, lambda ack=ack: ack.touch()))
                if fault.restart:
                    next_life = record["life"] + 1
                    if fault.kind == "stop" and incarnation and incarnation not in reports and incarnation not in died:
                        restart_after_exit[incarnation] = (record["member_id"], next_life)
                    else:  # (a stopped member that already exited restarts after the delay)
                        pending_restarts.append((now + fault.restart_delay_s, record["member_id"], next_life))

        for _, member_id, _ in members:
            start(member_id, 0)
        timed_out = False
        while True:
            now = time.monotonic()
            if narrator is not None:
                narrator.tick()
            for item in list(pending_restarts):
                if item[0] <= now:
                    pending_restarts.remove(item)
                    start(item[1], item[2])
            # reports and deaths
            conns = {w.conn: inc for inc, (w, _, _) in running.items() if inc not in reports and inc not in died}
            for conn in wait_conns(list(conns), timeout=0.02) if conns else ():
                inc = conns[conn]
                w, member_id, _life = running[inc]
                try:
                    kind, payload = conn.recv()
                    if kind == "reached":
                        reached.add(inc)
                        continue
                    reports[inc] = payload
                    w.task = None
                    # A worker that leaked sockets or threads would carry them into later
                    # trials: the leak is this trial's finding, and the worker is retired.
                    if not w.proc.is_alive() or payload.get("error_type") == "Terminated" \
                            or payload.get("leftover_sockets") or payload.get("leftover_threads"):
                        w.proc.join(5)
                        self.pool.drop(w)
                except (EOFError, OSError):
                    died.add(inc)
                    self.pool.drop(w)
                if inc in restart_after_exit:
                    m, life = restart_after_exit.pop(inc)
                    start(m, life)
            if not conns:
                time.sleep(0.02)
            # After the reports and deaths: a victim writes its record before it dies, so each
            # death seen above has its record now, and the restart it asks for is pending
            # before the job may end. (Read before them, a death seen in the same turn looked
            # like the job's end: the survivors were told to stop while the victim's restart
            # was not yet scheduled, and the restarted rank found no job.)
            take_new_faults(now)
            open_members = [inc for inc in latest.values() if inc not in reports and inc not in died]
            if open_members and all(inc in reached for inc in open_members) and not pending_restarts \
                    and not restart_after_exit and not stopping:
                # Every live member holds the last version: end the job (all leave together).
                stopping = True
                for inc in open_members:
                    with contextlib.suppress(Exception):
                        running[inc][0].conn.send("stop")
            if not open_members and not pending_restarts and not restart_after_exit and \
                    not any(t.is_alive() for t in etcd_threads):
                break
            if now - t_start > self.deadline_s:
                timed_out = True
                break
        missing = tuple(inc for inc in running if inc not in reports and inc not in died and inc not in victims)
        # Anything still running is hung: dump its stacks into its .stderr (SIGUSR2, see
        # the worker), then stop it by pid (and do not reuse the worker).
        hung = [w for inc, (w, _, _) in running.items() if inc not in reports and inc not in died]
        for w in hung:
            with contextlib.suppress(ProcessLookupError, ValueError):
                self.killer.signal(w.pid, signal.SIGCONT)
                self.killer.signal(w.pid, signal.SIGUSR2)
        if hung:
            time.sleep(0.5)
        for w in hung:
            self.pool.drop(w)
        self.pool.replenish(len(members))
        for t in etcd_threads:
            t.join(30)
        if narrator is not None:
            narrator.close()
        wall = time.monotonic() - t_start
        # Settle: dead members' leases expire within the TTL; nothing else may remain.
        client = EtcdClient(list(etcd.endpoints))
        try:
            leases: list[int] = []
            settle = time.monotonic() + TTL_S + 2.0
            while time.monotonic() < settle:
                try:
                    leases = client.leases()
                except Exception:
                    leases = []
                if not leases:
                    break
                time.sleep(0.1)
            from elastic_refit.membership import JobKeys
            from elastic_refit.membership.versions import VersionStore

            committed = commits.committed()  # as they happened: old versions' keys are pruned
            committed.update({v: asdict(c) for v, c in VersionStore(client, job).snapshot().committed.items()})
            client.delete_prefix(JobKeys(job).prefix)  # keep the shared etcd small
        finally:
            commits.close()
            client.close()
        worker_pids = {w.pid for w in self.pool.workers}
        stray = [p for p in _children_of(worker_pids)]
        # Another live run of this process (a test module's run beside a matrix) holds its
        # own warm workers and etcd: they are not this trial's leftovers.
        owned = set().union(*(run.owned_pids() for run in list(_LIVE_RUNS.values())), self.owned_pids())
        stray += [p for p in _children_of({os.getpid()}) if p not in owned and not _is_mp_helper(p)]
        faults = tuple(read_fault_records(trial_dir))
        evidence = TrialEvidence(
            logs=read_logs(trial_dir), committed=committed, reports=reports, last_version=versions[-1],
            victims=frozenset(victims | died), faults=faults, expected_faults=len(scenario.plan.faults),
            timed_out=timed_out, deadline_s=self.deadline_s, missing=missing, leases=tuple(leases),
            stray_pids=tuple(stray), final=frozenset(latest.values()) - frozenset(victims | died))
        verdict = check_all(evidence)
        keep = self.keep_logs or not verdict.passed
        if not keep:
            shutil.rmtree(trial_dir, ignore_errors=True)
        return TrialResult(scenario, verdict, wall, job, str(trial_dir) if keep else None, evidence)


class _CommitRecorder:
    """Every commit of a trial as it lands, from a watch on the job's versions: after each
    commit the coordinator prunes older versions (``VersionStore.prune``), so the final etcd
    state no longer lists every committed version. The watch resumes across etcd restarts
    from the last revision it saw (trials are far shorter than etcd's compaction period)."""

    def __init__(self, endpoints: tuple[str, ...], job: str) -> None:
        from elastic_refit.membership import EtcdClient, JobKeys
        from elastic_refit.membership.watch import RangeWatcher

        self.keys = JobKeys(job)
        self.client = EtcdClient(list(endpoints))
        self._committed: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        prefix = self.keys.versions_prefix
        self.watcher = RangeWatcher(self.client, prefix, prefix[:-1] + "0", name="chaos-commits")  # '0' follows '/'
        self.watcher.add_listener(self._on_change)
        self.watcher.start()

    def _on_change(self, reset: bool, events: list, snapshot: Any) -> None:
        kvs = list(snapshot.items.values()) if reset else [e.kv for e in events if e.kind == "put"]
        for kv in kvs:
            parsed = self.keys.parse_version_key(kv.key)
            if parsed is not None and parsed[1] == "committed":
                data = json.loads(kv.value)
                with self._lock:
                    self._committed[parsed[0]] = {"version": int(data["version"]), "epoch": int(data["epoch"]),
                                                  "digest": str(data["digest"])}

    def committed(self) -> dict[int, dict[str, Any]]:
        with self._lock:
            return dict(self._committed)

    def close(self) -> None:
        self.watcher.stop()
        self.client.close()


class _Narrator:
    """Tells a trial's story as it happens: faults, restarts, commits (read through
    ``VersionStore``) and restarted ranks serving again (read from their logs)."""

    def __init__(self, say: Callable[[str], None], endpoints: tuple[str, ...], job: str, trial_dir: Path) -> None:
        from elastic_refit.membership import EtcdClient
        from elastic_refit.membership.versions import VersionStore

        self.say = say
        self.t0 = time.time()
        self.client = EtcdClient(list(endpoints))
        self.versions = VersionStore(self.client, job)
        self.trial_dir = trial_dir
        self.committed: set[int] = set()
        self.waiting: dict[str, str] = {}  # restarted incarnation -> member id, until it serves
        self.next_tick = 0.0

    def _stamp(self) -> str:
        return f"[{time.time() - self.t0:5.1f}s]"

    def fault(self, fault: Any, record: dict[str, Any]) -> None:
        what = {"kill": "SIGKILLed", "restart": "SIGKILLed", "terminate": "sent SIGTERM", "stop": "SIGSTOPped",
                "stall": "stalled", "slow": "slowed down", "etcd_restart": "saw etcd go down"}[fault.kind]
        self.say(f"{self._stamp()} FAULT: {record['member_id']} ({record.get('role')}) {what} during the refit "
                 f"of version {record.get('version')} ({record.get('phase')})")

    def restarted(self, member_id: str, incarnation: str) -> None:
        self.waiting[incarnation] = member_id
        self.say(f"{self._stamp()} {member_id} restarted as incarnation {incarnation}")

    def tick(self) -> None:
        if time.monotonic() < self.next_tick:
            return
        self.next_tick = time.monotonic() + 0.2
        with contextlib.suppress(Exception):  # etcd may be down on purpose
            state = self.versions.snapshot()
            for v in sorted(set(state.committed) - self.committed):
                self.committed.add(v)
                self.say(f"{self._stamp()} version {v} committed in epoch {state.committed[v].epoch} "
                         f"({len(state.acks.get(v, {}))} inference ranks acked)")
        for incarnation, member_id in list(self.waiting.items()):
            serving = [e for e in read_logs(self.trial_dir, incarnation).get(incarnation, [])
                       if e.get("event") == "refit.version.serving"]
            if serving:
                del self.waiting[incarnation]
                self.say(f"{self._stamp()} {member_id} caught up from its peers: serving version "
                         f"{serving[0].get('version')}")

    def close(self) -> None:
        self.next_tick = 0.0
        self.tick()
        self.client.close()


def _burn() -> None:
    """A CPU burner: spin until terminated."""
    while True:
        pass


def _is_mp_helper(pid: int) -> bool:
    """multiprocessing's resource tracker (started by spawn) or fork server (started by the
    harness's local worlds, elastic_refit.testing.processes), identified by their pids."""
    with contextlib.suppress(Exception):
        from multiprocessing import forkserver, resource_tracker

        return pid in (resource_tracker._resource_tracker._pid, forkserver._forkserver._forkserver_pid)
    return False


# ---- matrices and summaries -----------------------------------------------------------------
def _percentile(values: list[float], q: float) -> float | None:
    """Linearly interpolated ``q`` quantile (numpy's default), None for no values."""
    return float(np.percentile(values, q * 100)) if values else None


def summarize(results: list[TrialResult], wall_s: float, leaked_pids: list[int] | None = None) -> dict[str, Any]:
    """The run's JSON summary: counts per category, recovery percentiles, per-cell rows."""
    recovery = [r for t in results for r in t.verdict.recovery_s]
    cells: dict[tuple[str, str, str], dict[str, Any]] = {}
    for t in results:
        s = t.scenario
        cell = cells.setdefault((s.victim, s.fault, s.phase), {
            "victim": s.victim, "fault": s.fault, "phase": s.phase, "trials": 0, "passed": 0,
            **{c: 0 for c in CATEGORIES}, "recovery": []})
        cell["trials"] += 1
        cell["passed"] += t.verdict.passed
        for c in CATEGORIES:
            cell[c] += t.verdict.has(c)
        cell["recovery"] += list(t.verdict.recovery_s)
    rows = []
    for cell in cells.values():
        rec = cell.pop("recovery")
        cell["recovery_p50_s"] = _percentile(rec, 0.5)
        cell["recovery_max_s"] = max(rec) if rec else None
        rows.append(cell)
    out = {
        "trials": len(results),
        "passed": sum(t.verdict.passed for t in results),
        **{c: sum(t.verdict.has(c) for t in results) for c in CATEGORIES},
        "recovery_p50_s": _percentile(recovery, 0.5),
        "recovery_p99_s": _percentile(recovery, 0.99),
        "recovery_max_s": max(recovery) if recovery else None,
        "faults_fired": sum(t.verdict.faults_fired for t in results),
        # Members fenced as confirmed suspects, and those of them no fault had killed.
        "fenced": sum(1 for t in results if t.evidence is not None for events in t.evidence.logs.values()
                      for e in events if e.get("event") == "membership.suspect.confirmed"),
        "fenced_live": sum(1 for t in results for v in t.verdict.violations if v.check == "no_live_member_fenced"),
        "wall_s": round(wall_s, 1),
        "cells": sorted(rows, key=lambda r: (r["victim"], r["fault"], r["phase"])),
        "failures": [t.to_json() for t in results if not t.verdict.passed],
    }
    if leaked_pids:
        out["leaked"] += 1
        out["leaked_pids"] = leaked_pids
    return out


def run_matrix(scenarios: list[Scenario], *, progress: Callable[[str], None] | None = None,
               deadline_s: float = 60.0, keep_logs: bool = False, results_path: str | None = None,
               backend: str = "gloo", cpu_burners: int = 0, until_s: float | None = None) -> dict[str, Any]:
    """Run ``scenarios`` in order on one etcd and one worker pool; returns :func:`summarize`.
    ``cpu_burners``: processes spinning on the CPU for the whole run; ``until_s``: start
    no trial after this many seconds (the rest of ``scenarios`` is left out).
    ``results_path``: append each trial's verdict there as one JSON line as it finishes;
    ``backend``: the members' communicators (``nccl`` / ``nccl4py``: every member on GPU 0)."""
    say = progress or (lambda _m: None)
    run = ChaosRun(keep_logs=keep_logs, deadline_s=deadline_s, backend=backend, cpu_burners=cpu_burners)
    results: list[TrialResult] = []
    t0 = time.monotonic()
    leaked: list[int] = []
    try:
        say(f"chaos: {len(scenarios)} trials, logs under {run.root}")
        for i, scenario in enumerate(scenarios):
            if until_s is not None and time.monotonic() - t0 >= until_s:
                say(f"chaos: {until_s:.0f} s spent, {len(scenarios) - i} trials left out")
                break
            result = run.run_trial(scenario, i)
            results.append(result)
            if results_path:
                with open(results_path, "a") as fh:
                    fh.write(json.dumps(result.to_json()) + "\n")
            bad = [v for v in result.verdict.violations]
            mark = "ok" if not bad else "FAIL " + "; ".join(f"{v.category}/{v.check}: {v.detail}"[:200] for v in bad[:3])
            rec = ", ".join(f"{r:.2f}" for r in result.verdict.recovery_s)
            say(f"[{i + 1}/{len(scenarios) if until_s is None else '-'}] {scenario.name}: {mark} ({result.wall_s:.1f} s; recovery {rec or '-'})"
                + (f" logs: {result.log_dir}" if result.log_dir and bad else ""))
    finally:
        if any(not r.verdict.passed for r in results):
            run.keep_logs = True  # failed trials' logs are evidence
        leaked = run.close()
    return summarize(results, time.monotonic() - t0, leaked)
