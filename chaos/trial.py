"""One chaos trial: a fresh job of warm members in the run's etcd, the parent's side of each
fault as it fires, the job's end, and the evidence the oracle judges.

A trial's job has 2 trainer replicas (``t0``, ``t1``) and ``num_inference`` inference
replicas (``i0``..), so recovery is always possible. Members run in the run's warm workers;
each start is an incarnation ``{member_id}-L{life}-{random}`` (life 0 first, +1 per restart).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait as wait_conns
from pathlib import Path
from typing import Any

from elastic_refit.chaos.faults import ETCD_FAULTS, TTL_S, Scenario
from elastic_refit.chaos.inject import FaultHook, read_fault_records
from elastic_refit.chaos.observe import CommitRecorder, Narrator
from elastic_refit.chaos.oracle import CATEGORIES, TrialEvidence, TrialVerdict
from elastic_refit.chaos.resources import RunEtcd, Worker, WorkerPool, children_of, is_mp_helper

from elastic_refit.testing.logs import read_logs
from elastic_refit.testing.specs import tiny_spec_json

__all__ = ["MEMBER_CONFIG", "Trial", "TrialResult"]

# Small buckets: a tensor travels as several messages, so "transfer chunk k" has meaning.
MEMBER_CONFIG = {"bucket_bytes": 4096, "staging_bytes": 1 << 16, "version_timeout_s": 40.0}


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


class Trial:
    """One scenario, run once: :meth:`run` starts the members, plays the parent's side of
    the faults until every live member holds the last version (or the deadline passes),
    settles, and returns the evidence. Used once, by one thread."""

    def __init__(self, scenario: Scenario, job: str, trial_dir: Path, etcd: RunEtcd, pool: WorkerPool,
                 member_config: dict[str, Any], deadline_s: float,
                 narrate: Callable[[str], None] | None = None, clock_origin: float | None = None) -> None:
        self.scenario = scenario
        self.job = job
        self.trial_dir = trial_dir
        self.etcd = etcd
        self.pool = pool
        self.member_config = member_config
        self.deadline_s = deadline_s
        self.narrate = narrate
        self.clock_origin = clock_origin  # the narration's time zero (None: the trial's start)
        members = [("trainer", "t0", 0), ("trainer", "t1", 1)] + [
            ("inference", f"i{k}", 2 + k) for k in range(scenario.num_inference)]
        self.layout_of = {m: (role, rank) for role, m, rank in members}
        self.versions = tuple(range(1, scenario.versions + 1))
        self.spec = scenario.spec_json or tiny_spec_json(scenario.num_inference)
        # What the members did, by incarnation.
        self.running: dict[str, tuple[Worker, str, int]] = {}  # incarnation -> (worker, member_id, life)
        self.latest: dict[str, str] = {}  # member_id -> latest incarnation
        self.reports: dict[str, dict[str, Any]] = {}
        self.died: dict[str, int | None] = {}  # incarnation that ended without a report -> its exit code
        self.reached: set[str] = set()  # incarnations holding the last version, waiting for stop
        self.victims: set[str] = set()
        # The parent's side of the faults.
        self.handled: set[int] = set()  # fault indexes already acted on
        self.pending_restarts: list[tuple[float, str, int]] = []  # (at monotonic, member_id, life)
        self.restart_after_exit: dict[str, tuple[str, int]] = {}  # incarnation -> (member, next life)
        self.etcd_threads: list[threading.Thread] = []
        self.stopping = False
        self.timed_out = False
        self.narrator: Narrator | None = None

    def run(self, owned_pids: Callable[[], set[int]]) -> tuple[TrialEvidence, float]:
        """Run the trial; returns its evidence and its wall seconds (start to the members'
        end, before settling). ``owned_pids``: processes that live runs hold (not leftovers)."""
        self.pool.ensure(len(self.layout_of))
        t_start = time.monotonic()
        if self.narrate is not None:
            self.narrator = Narrator(self.narrate, self.etcd.endpoints, self.job, self.trial_dir, self.clock_origin)
        commits = CommitRecorder(self.etcd.endpoints, self.job)
        try:
            for member_id in self.layout_of:
                self._start(member_id, 0)
            self._loop(t_start)
            missing = self._wind_down()
            wall = time.monotonic() - t_start
            leases, committed = self._settle(commits)
        finally:
            commits.close()
        gone = frozenset(self.victims | self.died.keys())
        evidence = TrialEvidence(
            logs=read_logs(self.trial_dir), committed=committed, reports=self.reports,
            last_version=self.versions[-1], victims=gone, faults=tuple(read_fault_records(self.trial_dir)),
            expected_faults=len(self.scenario.plan.faults), timed_out=self.timed_out,
            deadline_s=self.deadline_s, missing=missing, leases=leases, stray_pids=self._strays(owned_pids),
            final=frozenset(self.latest.values()) - gone,
            crashed={inc: code for inc, code in self.died.items() if inc not in self.victims})
        return evidence, wall

    def _start(self, member_id: str, life: int) -> None:
        """Start life ``life`` of ``member_id`` in a warm worker, with the faults of that life."""
        from elastic_refit.testing.job import MemberSpec

        role, rank = self.layout_of[member_id]
        incarnation = f"{member_id}-L{life}-{uuid.uuid4().hex[:4]}"
        faults = tuple((i, f) for i, f in enumerate(self.scenario.plan.faults)
                       if f.life == life and f.matches_member(role, member_id))
        hook = FaultHook(member_id, life, faults, str(self.trial_dir)) if faults else None
        member = MemberSpec(self.job, role, member_id, rank, self.etcd.endpoints,
                            "d-train" if role == "trainer" else "d-infer", spec_json=self.spec,
                            versions=self.versions, incarnation=incarnation,
                            pause_s=self.scenario.trainer_pause_s if role == "trainer" else 0.0,
                            config={**self.member_config, **(self.scenario.member_config or {})},
                            delta_density=self.scenario.delta_density)
        w = self.pool.acquire()
        w.task = (member_id, life)
        w.conn.send((member, hook, str(self.trial_dir / f"{incarnation}.log")))
        self.running[incarnation] = (w, member_id, life)
        self.latest[member_id] = incarnation
        if life and self.narrator is not None:
            self.narrator.restarted(member_id, incarnation)

    def _loop(self, t_start: float) -> None:
        """Until the job ended (every member out, no restart due, etcd back up) or the deadline."""
        while True:
            now = time.monotonic()
            if self.narrator is not None:
                self.narrator.tick()
            for item in list(self.pending_restarts):
                if item[0] <= now:
                    self.pending_restarts.remove(item)
                    self._start(item[1], item[2])
            self._collect()
            # After the reports and deaths: a victim writes its record before it dies, so each
            # death seen above has its record now, and the restart it asks for is pending
            # before the job may end. (Read before them, a death seen in the same turn looked
            # like the job's end: the survivors were told to stop while the victim's restart
            # was not yet scheduled, and the restarted rank found no job.)
            self._take_new_faults(now)
            if self._ended():
                return
            if now - t_start > self.deadline_s:
                self.timed_out = True
                return

    def _collect(self) -> None:
        """Reports and deaths of the running incarnations (waits up to 20 ms for one)."""
        conns = {w.conn: inc for inc, (w, _, _) in self.running.items()
                 if inc not in self.reports and inc not in self.died}
        for conn in wait_conns(list(conns), timeout=0.02) if conns else ():
            self._receive(conns[conn])
        if not conns:
            time.sleep(0.02)

    def _receive(self, inc: str) -> None:
        """One message of incarnation ``inc``'s worker: reached the last version, its
        report, or its death (EOF)."""
        w = self.running[inc][0]
        try:
            kind, payload = w.conn.recv()
            if kind == "reached":
                self.reached.add(inc)
                return
            self.reports[inc] = payload
            w.task = None
            # A worker that leaked sockets, threads or mappings would carry them into later
            # trials: the leak is this trial's finding, and the worker is retired.
            if not w.proc.is_alive() or payload.get("error_type") == "Terminated" \
                    or payload.get("leftover_sockets") or payload.get("leftover_threads") \
                    or payload.get("leftover_ipc_mappings"):
                w.proc.join(5)
                self.pool.drop(w)
        except (EOFError, OSError):
            self.pool.drop(w)
            self.died[inc] = w.proc.exitcode  # -9 for a fault's SIGKILL, -11 for a crash
        if inc in self.restart_after_exit:
            member_id, life = self.restart_after_exit.pop(inc)
            self._start(member_id, life)

    def _take_new_faults(self, now: float) -> None:
        """The parent side of every newly fired fault."""
        for record in read_fault_records(self.trial_dir):
            if record["index"] in self.handled:
                continue
            self.handled.add(record["index"])
            fault = self.scenario.plan.faults[record["index"]]
            if self.narrator is not None:
                self.narrator.fault(fault, record)
            incarnation = next((inc for inc, (_, m, life) in self.running.items()
                                if m == record["member_id"] and life == record["life"]), None)
            if fault.kind not in (*ETCD_FAULTS, "slow") and incarnation:
                self.victims.add(incarnation)
            if fault.kind == "stop":
                self.pool.killer.cont_later(record["pid"], max(0.0, record["t"] + fault.duration_s - time.time()))
            elif fault.kind in ETCD_FAULTS:
                ack = self.trial_dir / f"ack-{record['index']}"
                act = {"etcd_restart": self.etcd.bounce, "etcd_stall": self.etcd.stall,
                       "etcd_wipe": self.etcd.wipe}[fault.kind]
                self.etcd_threads.append(act(fault.duration_s, lambda ack=ack: ack.touch()))
            if fault.restart:
                next_life = record["life"] + 1
                if fault.kind == "stop" and incarnation and incarnation not in self.reports \
                        and incarnation not in self.died:
                    self.restart_after_exit[incarnation] = (record["member_id"], next_life)
                else:  # (a stopped member that already exited restarts after the delay)
                    self.pending_restarts.append((now + fault.restart_delay_s, record["member_id"], next_life))

    def _ended(self) -> bool:
        """Tells every member to stop once each live one holds the last version; true once
        none is left, no restart is due and no etcd node is down."""
        # A stopped member that reached the last version came back on its own (its lease was
        # lost, it rejoined as a new incarnation in its process): no restart is due for it.
        for inc in [inc for inc in self.restart_after_exit if inc in self.reached]:
            del self.restart_after_exit[inc]
        open_members = [inc for inc in self.latest.values() if inc not in self.reports and inc not in self.died]
        no_restart_due = not self.pending_restarts and not self.restart_after_exit
        if open_members and all(inc in self.reached for inc in open_members) and no_restart_due \
                and not self.stopping:
            # Every live member holds the last version: end the job (all leave together).
            self.stopping = True
            for inc in open_members:
                with contextlib.suppress(Exception):
                    self.running[inc][0].conn.send("stop")
        return not open_members and no_restart_due and not any(t.is_alive() for t in self.etcd_threads)

    def _wind_down(self) -> tuple[str, ...]:
        """Stop what still runs (hung: its stacks dumped first); returns the live
        incarnations that never reported."""
        missing = tuple(inc for inc in self.running
                        if inc not in self.reports and inc not in self.died and inc not in self.victims)
        # Anything still running is hung: dump its stacks into its .stderr (SIGUSR2, see
        # the worker), then stop it by pid (and do not reuse the worker).
        hung = [w for inc, (w, _, _) in self.running.items() if inc not in self.reports and inc not in self.died]
        for w in hung:
            with contextlib.suppress(ProcessLookupError, ValueError):
                self.pool.killer.signal(w.pid, signal.SIGCONT)
                self.pool.killer.signal(w.pid, signal.SIGUSR2)
        if hung:
            time.sleep(0.5)
        for w in hung:
            self.pool.drop(w)
        self.pool.replenish(len(self.layout_of))
        for t in self.etcd_threads:
            t.join(30)
        if self.narrator is not None:
            self.narrator.close()
        return missing

    def _settle(self, commits: CommitRecorder) -> tuple[tuple[int, ...], dict[int, dict[str, Any]]]:
        """Dead members' leases expire within the TTL; nothing else may remain. Returns the
        leases left and every committed version; deletes the job's keys."""
        from elastic_refit.membership import EtcdClient, JobKeys
        from elastic_refit.membership.versions import VersionStore

        client = EtcdClient(list(self.etcd.endpoints))
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
            committed = commits.committed()  # as they happened: old versions' keys are pruned
            committed.update({v: asdict(c) for v, c in VersionStore(client, self.job).snapshot().committed.items()})
            client.delete_prefix(JobKeys(self.job).prefix)  # keep the shared etcd small
        finally:
            client.close()
        return tuple(leases), committed

    def _strays(self, owned_pids: Callable[[], set[int]]) -> tuple[int, ...]:
        """Processes the trial left: children of the workers, and children of this process
        that no live run holds (nor multiprocessing's helpers)."""
        stray = children_of({w.pid for w in self.pool.workers})
        owned = owned_pids()
        stray += [p for p in children_of({os.getpid()}) if p not in owned and not is_mp_helper(p)]
        return tuple(stray)
