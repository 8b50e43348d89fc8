"""The demo job: a real etcd, trainer and inference processes, faults, recovery, a summary.

The demo is one scenario of the chaos machinery (the same launcher, member loop, fault
injection, log reader and invariant oracle as ``elastic-refit chaos``). On one machine
(CPU, gloo) two trainer ranks (data-parallel replicas, each holding the whole policy)
publish versions of a small transformer-shaped model; four inference ranks hold it as two
tensor-parallel (TP=2) replicas in one domain (a different layout: the planner moves only
the shard intersections, each once across domains). Mid-refit one inference rank and then
one trainer rank are SIGKILLed right after their first message. The job retries the
version with the survivors; the killed inference rank is restarted with a new incarnation
and catches up from its peers. Every committed version an inference rank serves is
checked bit-exactly against the trainers' deterministic pattern, and the oracle checks
that nothing was torn, lost, hung or leaked.

One clock throughout: seconds since the demo (the job) started, in the live narration and in
the summary alike. Start-up (etcd, the member processes, joining the job) is reported apart
from the refits. Member logs stay where the demo says they are (``DemoSummary.log_dir``):
``--log-dir``, or a new temporary folder, never removed.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from elastic_refit.chaos.faults import FaultPlan, Scenario
from elastic_refit.chaos.oracle import TrialEvidence
from elastic_refit.chaos.runner import ChaosRun, TrialResult

from elastic_refit._validate import require_at_least
from elastic_refit.testing.specs import NUM_TRAINERS, demo_spec

__all__ = ["DemoConfig", "DemoSummary", "FaultRecord", "demo_scenario", "run_demo"]

TRAINERS = tuple(f"t{r}" for r in range(NUM_TRAINERS))


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What the demo runs: how many versions, which faults, how long it may take."""

    num_versions: int = 6
    num_inference: int = 4  # replicas of TP=2
    kill_inference_at: int | None = 3  # version whose refit loses inference rank i1 (restarted)
    kill_trainer_at: int | None = 5  # version whose refit loses trainer rank t1
    pause_s: float = 0.5  # trainers: time between versions (a training step)
    timeout_s: float = 90.0
    log_dir: str | None = None  # member logs go there (default: a new temporary folder); always kept

    def __post_init__(self) -> None:
        require_at_least("num_versions", self.num_versions, 2)
        if self.num_inference < 4 or self.num_inference % 2:
            raise ValueError(f"num_inference must be an even number >= 4 (TP=2 replicas; one rank is killed "
                             f"and catches up from its replica), got {self.num_inference}")
        for label, at in (("kill_inference_at", self.kill_inference_at), ("kill_trainer_at", self.kill_trainer_at)):
            if at is not None and not 1 <= at <= self.num_versions:
                raise ValueError(f"{label} must be a version in 1..{self.num_versions}, got {at}")
        if not (self.pause_s >= 0 and self.timeout_s > 0):
            raise ValueError(f"pause_s must be >= 0 and timeout_s > 0, got {self.pause_s}, {self.timeout_s}")


@dataclass(frozen=True, slots=True)
class FaultRecord:
    """One injected fault and what followed it (times in seconds since the demo started)."""

    member_id: str
    role: str
    version: int
    phase: str
    killed_at_s: float
    recovered_at_s: float | None  # first commit after the kill
    committed_version: int | None
    restarted: bool = False
    caught_up_at_s: float | None = None  # restarted inference rank served a committed version
    restarted_at_s: float | None = None

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at_s is None else self.recovered_at_s - self.killed_at_s

    @property
    def serving_again_s(self) -> float | None:
        """A restarted rank: from its kill to serving a committed version again (the restart,
        the new process's start-up and its catch-up all included)."""
        return None if self.caught_up_at_s is None else self.caught_up_at_s - self.killed_at_s


@dataclass(frozen=True, slots=True)
class DemoSummary:
    """The demo's outcome; ``to_json`` is what ``elastic-refit demo --json`` prints."""

    num_versions_published: int
    num_versions_committed: int
    committed: tuple[dict[str, Any], ...]  # {version, epoch, digest, at_s}
    faults: tuple[FaultRecord, ...]
    verified: bool
    num_checks: int  # (inference rank incarnation, version) pairs checked bit-exactly
    problems: tuple[str, ...]
    plan: dict[str, Any]  # the model; one full-membership refit: reshard vs gather-and-broadcast
    moved: dict[str, int]  # bytes received by inference ranks over the whole run
    num_attempts: int
    num_failed_attempts: int
    num_epochs: int
    wall_s: float
    num_trainers: int = len(TRAINERS)
    num_inference: int = 4
    violations: tuple[str, ...] = ()  # what the chaos oracle found (torn, lost, hung, leaked, ...)
    leaked_pids: tuple[int, ...] = ()
    errors: tuple[str, ...] = ()
    log_dir: str = ""  # where the member logs are (kept)
    startup_s: float | None = None  # every member of the job registered (etcd and processes up)
    first_proposal_s: float | None = None  # the first refit proposed
    last_commit_s: float | None = None

    @property
    def recovered(self) -> bool:
        return all(f.recovered_at_s is not None for f in self.faults) and all(
            f.caught_up_at_s is not None for f in self.faults if f.restarted)

    @property
    def recovery_times(self) -> list[float]:
        return sorted(f.recovery_s for f in self.faults if f.recovery_s is not None)

    def to_json(self) -> dict[str, Any]:
        times = self.recovery_times
        return {
            "num_versions_published": self.num_versions_published,
            "num_versions_committed": self.num_versions_committed,
            "committed": list(self.committed),
            "num_faults": len(self.faults),
            "faults": [dict(asdict(f), recovery_s=f.recovery_s, serving_again_s=f.serving_again_s)
                       for f in self.faults],
            "recovered": self.recovered,
            "recovery_p50_s": float(np.percentile(times, 50)) if times else None,
            "recovery_max_s": max(times) if times else None,
            "verified": self.verified,
            "num_checks": self.num_checks,
            "problems": list(self.problems),
            "violations": list(self.violations),
            "leaked_pids": list(self.leaked_pids),
            "plan": self.plan,
            "moved": self.moved,
            "num_attempts": self.num_attempts,
            "num_failed_attempts": self.num_failed_attempts,
            "num_epochs": self.num_epochs,
            "num_trainers": self.num_trainers,
            "num_inference": self.num_inference,
            "wall_s": self.wall_s,
            "startup_s": self.startup_s,
            "first_proposal_s": self.first_proposal_s,
            "last_commit_s": self.last_commit_s,
            "log_dir": self.log_dir,
            "errors": list(self.errors),
        }


def demo_scenario(config: DemoConfig) -> Scenario:
    """The demo as a chaos :class:`~elastic_refit.chaos.faults.Scenario`: SIGKILL inference
    rank i1 (restarted at once) and then trainer t1, each right after its first message of
    the named version's transfer."""
    plan = FaultPlan()
    if config.kill_inference_at is not None:
        plan = plan.kill(role="inference", rank=1, at="transfer", version=config.kill_inference_at, chunk=1,
                         restart=True)
    if config.kill_trainer_at is not None:
        # After the first fault has fired, so that each recovery is measured on its own.
        plan = plan.kill(role="trainer", rank=1, at="transfer", version=config.kill_trainer_at, chunk=1,
                         after=0 if len(plan) else None)
    return Scenario(name="demo", victim="inference+trainer", fault="kill", phase="transfer", plan=plan, seed=0,
                    versions=config.num_versions, num_inference=config.num_inference,
                    spec_json=json.dumps(demo_spec(config.num_inference)), trainer_pause_s=config.pause_s,
                    member_config={"bucket_bytes": 16 << 20, "staging_bytes": 64 << 20})


def run_demo(config: DemoConfig | None = None, progress: Callable[[str], None] | None = None) -> DemoSummary:
    """Run the demo job end to end and return its summary; leaves no process behind."""
    config = config or DemoConfig()
    t0 = time.time()  # the job's clock: every time the demo shows is seconds since now
    say = progress or (lambda _msg: None)
    root = Path(config.log_dir) if config.log_dir else Path(tempfile.mkdtemp(prefix="elastic-refit-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    fresh = not any(root.iterdir())  # an earlier run's logs stay apart, in their own folder
    scenario = demo_scenario(config)
    run = ChaosRun(root=str(root), keep_logs=True, deadline_s=config.timeout_s)
    errors: list[str] = []
    result = None
    try:
        say(f"[{time.time() - t0:5.1f}s] starting etcd, trainers {', '.join(TRAINERS)} (replicas, whole tensors) "
            f"and {config.num_inference} inference ranks ({config.num_inference // 2} replicas of TP=2); member "
            f"logs in {root}{'' if fresh else ' (in a folder of their own: it holds earlier runs)'}")
        result = run.run_trial(scenario, narrate=say, clock_origin=t0)
    except Exception as exc:  # reported in the summary, never a traceback
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        leaked = run.close()
    wall_s = time.time() - t0
    log_dir = _logs_into(root, result.log_dir if result is not None else None, fresh)
    return _summarize(config, scenario, result, t0, wall_s, tuple(leaked), errors, log_dir)


def _logs_into(root: Path, trial_dir: str | None, fresh: bool) -> str:
    """Where the member logs are once the run is over: ``root`` itself when it was empty
    (the trial's folder moved up into it), else the trial's folder inside it."""
    if trial_dir is None or not Path(trial_dir).is_dir():
        return str(root)
    if not fresh:
        return trial_dir
    for entry in Path(trial_dir).iterdir():
        shutil.move(str(entry), str(root / entry.name))
    Path(trial_dir).rmdir()
    return str(root)


def _plan_bytes(spec_json: str) -> dict[str, Any]:
    """The demo's model (tensors, parameters, bytes, dtypes) and one full-membership refit of
    it: reshard vs gather-and-broadcast bytes."""
    from elastic_refit.layout import parse_spec
    from elastic_refit.plan import make_plan

    spec = parse_spec(json.loads(spec_json))
    s = make_plan(spec.source, spec.destination, spec.topology).stats
    tensors = spec.destination.tensors
    return {"model_bytes": s.model_bytes, "num_tensors": len(tensors), "dtypes": sorted({t.dtype for t in tensors}),
            "num_parameters": sum(t.numel for t in tensors), "cross_domain_bytes": s.cross_domain_bytes,
            "intra_domain_bytes": s.intra_domain_bytes, "lower_bound_bytes": s.lower_bound_bytes,
            "gather_broadcast_bytes": s.gather_broadcast_bytes}


def _fault_records(scenario: Scenario, evidence: TrialEvidence, committed_at: dict[int, float],
                   t0: float) -> list[FaultRecord]:
    """Each fault that fired, the next commit after it and, for a restarted rank, when its
    new incarnation started and first served a version (from its log)."""
    faults = []
    for record in evidence.faults:
        fault = scenario.plan.faults[record["index"]]
        after = sorted((t, v) for v, t in committed_at.items() if t >= record["t"])
        recovered_at, version = after[0] if after else (None, None)
        caught_up = restarted_at = None
        if fault.restart:
            prefix = f"{record['member_id']}-L{record['life'] + 1}-"
            mine = [e for inc, per in evidence.logs.items() if inc.startswith(prefix) for e in per if e.get("_t")]
            serving = [e["_t"] for e in mine if e.get("event") == "refit.version.serving"]
            restarted_at = min(e["_t"] for e in mine) - t0 if mine else None  # its process's first event
            caught_up = min(serving) - t0 if serving else None
        faults.append(FaultRecord(record["member_id"], str(record.get("role")), int(record["version"]),
                                  str(record["phase"]), record["t"] - t0,
                                  None if recovered_at is None else recovered_at - t0, version,
                                  fault.restart, caught_up, restarted_at))
    return faults


def _count_attempts(events: list[dict[str, Any]], event: str) -> int:
    return len({(e.get("epoch"), e.get("seq")) for e in events if e.get("event") == event})


def _phases(events: list[dict[str, Any]], t0: float) -> dict[str, float | None]:
    """When start-up ended (every first incarnation registered), the first refit was proposed
    and the last version committed, in seconds since ``t0``."""
    started: dict[str, float] = {}
    for e in events:
        if e.get("event") == "refit.member.started" and "-L0-" in str(e.get("incarnation", "")):
            started.setdefault(str(e["incarnation"]), e["_t"])
    proposed = [e["_t"] for e in events if e.get("event") == "refit.attempt.proposed"]
    commits = [e["_t"] for e in events if e.get("event") == "refit.version.committed"]

    def since(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 3)

    return {"startup_s": since(max(started.values()) if started else None),
            "first_proposal_s": since(min(proposed) if proposed else None),
            "last_commit_s": since(max(commits) if commits else None)}


def _summarize(config: DemoConfig, scenario: Scenario, result: TrialResult | None, t0: float, wall_s: float,
               leaked: tuple[int, ...], errors: list[str], log_dir: str) -> DemoSummary:
    """The summary, from the trial's evidence: member logs, reports, etcd commits, faults."""
    plan = _plan_bytes(scenario.spec_json)
    evidence = result.evidence if result is not None else None
    if evidence is None:
        evidence = TrialEvidence(logs={}, committed={}, reports={}, last_version=config.num_versions)
    events = sorted((e for per in evidence.logs.values() for e in per if e.get("_t") is not None),
                    key=lambda e: e["_t"])
    committed_at: dict[int, float] = {}
    for e in events:
        if e.get("event") == "refit.version.committed":
            committed_at.setdefault(int(e["version"]), e["_t"])
    committed = tuple({"version": v, "epoch": int(c["epoch"]), "digest": c["digest"],
                       "at_s": round(committed_at.get(v, t0) - t0, 3)} for v, c in sorted(evidence.committed.items()))
    faults = _fault_records(scenario, evidence, committed_at, t0)
    reports = evidence.reports
    checks = [c for r in reports.values() if r.get("role") == "inference" for c in r.get("committed", ())]
    problems = [p for r in reports.values() for p in r.get("problems", ())]
    violations = tuple(f"{v.category}: {v.check}: {v.detail}" for v in result.verdict.violations) if result else ()
    if result is None:
        errors.append("the demo did not run to its end")
    done = [e for e in events if e.get("event") == "refit.transfer.done" and e.get("role") == "inference"]
    moved = {
        "network_recv_bytes": sum(int(e.get("network_recv_bytes", 0)) for e in done),
        "intra_recv_bytes": sum(int(e.get("intra_recv_bytes", 0)) for e in done),
        "gather_broadcast_bytes": plan["gather_broadcast_bytes"] * len(committed),
    }
    verified = (result is not None and result.verdict.passed and bool(checks)
                and all(c.get("verified") for c in checks) and not problems and not leaked and not errors)
    return DemoSummary(
        num_versions_published=config.num_versions,
        num_versions_committed=len(committed),
        committed=committed,
        faults=tuple(faults),
        verified=verified,
        num_checks=len(checks),
        problems=tuple(problems),
        plan=plan,
        moved=moved,
        num_attempts=_count_attempts(events, "refit.attempt.proposed"),
        num_failed_attempts=_count_attempts(events, "refit.attempt.failed"),
        num_epochs=len({e.get("epoch") for e in events if e.get("event") == "refit.epoch.entered"}),
        wall_s=round(wall_s, 3),
        num_inference=config.num_inference,
        violations=violations,
        leaked_pids=leaked,
        errors=tuple(errors),
        log_dir=log_dir,
        **_phases(events, t0),
    )
