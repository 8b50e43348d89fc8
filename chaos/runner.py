"""Run chaos trials: a real etcd, warm member processes, faults, the oracle, a summary.

One etcd (or 3-node cluster) serves a whole run; every trial is a fresh job (its own key
prefix) of 2 trainer replicas and ``num_inference`` inference replicas, so recovery is
always possible. Members run in a pool of warm worker processes reused across trials; a
worker a fault killed is replaced. The parent watches the trial's fault records and does
the parent's part of each fault (SIGCONT after a stop, etcd down and up, restarting a
victim as a new incarnation), then collects reports, waits for leases to settle and asks
the oracle for a verdict. One trial is :class:`~elastic_refit.chaos.trial.Trial`; the
run's processes are in :mod:`elastic_refit.chaos.resources`.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from elastic_refit.chaos.faults import Scenario
from elastic_refit.chaos.inject import Killer
from elastic_refit.chaos.oracle import CATEGORIES, check_all
from elastic_refit.chaos.resources import RunEtcd, WorkerPool, burn
from elastic_refit.chaos.trial import MEMBER_CONFIG, Trial, TrialResult

from elastic_refit._validate import require_at_least
from elastic_refit.testing.processes import pid_alive

__all__ = ["ChaosRun", "TrialResult", "run_matrix", "summarize"]

# The runs of this process not yet closed (a trial's stray check must not count the warm
# workers and etcd of another run in the same process as its own leftovers).
_LIVE_RUNS: weakref.WeakValueDictionary[int, ChaosRun] = weakref.WeakValueDictionary()


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
        self._etcd: dict[int, RunEtcd] = {}
        self._failed: set[str] = set()  # the failed trials' folders under root: close() keeps them
        require_at_least("cpu_burners", self.cpu_burners, 0)
        self._burners = [mp.get_context("spawn").Process(target=burn, daemon=True, name="chaos-burner")
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

    def etcd(self, nodes: int) -> RunEtcd:
        if nodes not in self._etcd:
            self._etcd[nodes] = RunEtcd(nodes)
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
        if not self.keep_logs:  # a failed trial's folder stays (run_trial kept it for its reader)
            for trial_dir in (Path(self.root).iterdir() if os.path.isdir(self.root) else ()):
                if trial_dir.name not in self._failed:
                    shutil.rmtree(trial_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(self.root)  # empty: every trial passed
        return left + [p for p in pids if pid_alive(p)]

    # ---- a trial -------------------------------------------------------------------------
    def run_trial(self, scenario: Scenario, index: int = 0,
                  narrate: Callable[[str], None] | None = None, clock_origin: float | None = None) -> TrialResult:
        """Run one scenario end to end and judge it; ``narrate`` (optional) is told of
        faults, restarts, commits and catch-ups as they happen, stamped in seconds since
        ``clock_origin`` (``time.time()``; None: the trial's start)."""
        etcd = self.etcd(scenario.etcd_nodes)
        job = f"chaos-{index}-{uuid.uuid4().hex[:6]}"
        trial_dir = Path(self.root) / job
        trial_dir.mkdir(parents=True)
        trial = Trial(scenario, job, trial_dir, etcd, self.pool, {**MEMBER_CONFIG, **self._device_config()},
                      self.deadline_s, narrate, clock_origin)
        evidence, wall = trial.run(owned_pids=self._owned_by_live_runs)
        verdict = check_all(evidence)
        keep = self.keep_logs or not verdict.passed
        if not verdict.passed:
            self._failed.add(job)
        if not keep:
            shutil.rmtree(trial_dir, ignore_errors=True)
        return TrialResult(scenario, verdict, wall, job, str(trial_dir) if keep else None, evidence)

    def _owned_by_live_runs(self) -> set[int]:
        """Processes this run and every other live run of this process hold: another run (a
        test module's run beside a matrix) keeps its own warm workers and etcd, and they are
        not a trial's leftovers."""
        return set().union(*(run.owned_pids() for run in list(_LIVE_RUNS.values())), self.owned_pids())


# ---- matrices and summaries -----------------------------------------------------------------
def _percentile(values: list[float], q: float) -> float | None:
    """Linearly interpolated ``q`` quantile (numpy's default), None for no values."""
    return float(np.percentile(values, q * 100)) if values else None


COUNTED_EVENTS = {  # summary field -> the member log event it counts
    "leases_lost": "membership.member.lost", "rejoined": "refit.member.rejoined",
    "rejoin_failed": "refit.member.rejoin_failed", "keepalive_late": "membership.keepalive.unreachable",
    "versions_failed": "refit.version.failed"}


def _count_events(results: list[TrialResult], event: str) -> int:
    return sum(1 for t in results if t.evidence is not None for events in t.evidence.logs.values()
               for e in events if e.get("event") == event)


def _keepalive_silence(results: list[TrialResult]) -> dict[str, float | None]:
    """How close the leases of members that left came to their TTL: p50 / p99 / max over
    members of each one's longest wait for a keepalive answer (``membership.member.left``)."""
    silences = [e["max_keepalive_silence_s"] for t in results if t.evidence is not None
                for events in t.evidence.logs.values() for e in events
                if e.get("event") == "membership.member.left" and e.get("max_keepalive_silence_s") is not None]
    return {"keepalive_silence_p50_s": _percentile(silences, 0.5), "keepalive_silence_p99_s": _percentile(silences, 0.99),
            "keepalive_silence_max_s": max(silences) if silences else None}


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
        # Leases that ran out under a live member, and its ways back (runtime.rejoin): on a
        # loaded host with nothing killed, every lost lease should rejoin on its own and no
        # version fail.
        **{name: _count_events(results, event) for name, event in COUNTED_EVENTS.items()},
        **_keepalive_silence(results),
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
               backend: str = "gloo", cpu_burners: int = 0, until_s: float | None = None,
               run: ChaosRun | None = None) -> dict[str, Any]:
    """Run ``scenarios`` in order on one etcd and one worker pool; returns :func:`summarize`.
    ``cpu_burners``: processes spinning on the CPU for the whole run; ``until_s``: start
    no trial after this many seconds (the rest of ``scenarios`` is left out).
    ``results_path``: append each trial's verdict there as one JSON line as it finishes;
    ``backend``: the members' communicators (``nccl`` / ``nccl4py``: every member on GPU 0).
    ``run``: an open run to use (its warm workers and etcd, its backend, burners and
    deadline) instead of a new one; the caller closes it and checks what outlived it."""
    say = progress or (lambda _m: None)
    own = run is None
    if run is None:
        run = ChaosRun(keep_logs=keep_logs, deadline_s=deadline_s, backend=backend, cpu_burners=cpu_burners)
    else:
        from elastic_refit.transport.protocol import Backend

        if Backend.parse(backend).value != run.backend or cpu_burners:
            raise ValueError(f"run_matrix: backend={backend!r}, cpu_burners={cpu_burners} are the given run's "
                             f"to set (it has backend={run.backend!r}, cpu_burners={run.cpu_burners})")
        run.keep_logs = run.keep_logs or keep_logs
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
        leaked = run.close() if own else []
    return summarize(results, time.monotonic() - t0, leaked)
