"""The demo job: a real etcd, trainer and inference processes, faults, recovery, a summary.

On one machine (CPU, gloo) two trainer ranks (data-parallel replicas, each holding the
whole policy) publish versions of a small transformer-shaped model; four inference ranks
hold it as two tensor-parallel (TP=2) replicas in one domain (a different layout: the
planner moves only the shard intersections, each once across domains). Mid-refit one inference rank and one trainer rank are SIGKILLed from
inside the runtime's ``transfer.before`` hook, after their first message. The job retries
the version with the survivors; the killed inference rank is restarted with a new
incarnation and catches up from its peers. Every committed version an inference rank
serves is checked bit-exactly against the trainers' deterministic pattern.

Members log JSON lines to one file each; the summary (commits, recovery times, bytes) is
computed from those logs and from etcd.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DemoConfig", "DemoSummary", "FaultRecord", "demo_spec", "run_demo"]

TRAINERS = ("t0", "t1")
TRAINER_DOMAIN = "node-train"
INFERENCE_DOMAIN = "node-infer"


def demo_spec(num_inference: int = 4, inference_tp: int = 2, hidden: int = 192, num_layers: int = 2,
              vocab: int = 960) -> dict[str, Any]:
    """Spec of the demo model: trainers 0 and 1 are data-parallel replicas (whole tensors);
    inference ranks 2.. are ``num_inference / inference_tp`` replicas of a tensor-parallel
    layout (column-parallel S(0), row-parallel S(1), norms replicated), all in one domain.
    Replicas on the inference side are what let a restarted rank catch up from its peers
    after the trainers dropped the version."""
    if inference_tp < 1 or num_inference < 2 * inference_tp or num_inference % inference_tp:
        raise ValueError(f"num_inference must be a multiple >= 2x of inference_tp={inference_tp} (a killed rank "
                         f"needs a replica), got {num_inference}")
    src = {"mesh": list(range(len(TRAINERS))), "placements": ["R"]}
    first = len(TRAINERS)
    dst_mesh = [list(range(first + r * inference_tp, first + (r + 1) * inference_tp))
                for r in range(num_inference // inference_tp)]

    def tensor(name: str, shape: list[int], placement: str) -> dict[str, Any]:
        return {"name": name, "shape": shape, "dtype": "bfloat16", "source": src,
                "destination": {"mesh": dst_mesh, "placements": ["R", placement]}}

    tensors = [tensor("embed_tokens.weight", [vocab, hidden], "S(0)")]
    for layer in range(num_layers):
        p = f"layers.{layer}."
        tensors += [
            tensor(p + "input_layernorm.weight", [hidden], "R"),
            tensor(p + "self_attn.qkv_proj.weight", [3 * hidden, hidden], "S(0)"),
            tensor(p + "self_attn.o_proj.weight", [hidden, hidden], "S(1)"),
            tensor(p + "post_attention_layernorm.weight", [hidden], "R"),
            tensor(p + "mlp.up_proj.weight", [4 * hidden, hidden], "S(0)"),
            tensor(p + "mlp.down_proj.weight", [hidden, 4 * hidden], "S(1)"),
        ]
    tensors += [tensor("norm.weight", [hidden], "R"), tensor("lm_head.weight", [vocab, hidden], "S(0)")]
    return {"domains": [0] * len(TRAINERS) + [1] * num_inference, "tensors": tensors}


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What the demo runs: how many versions, which faults, how long it may take."""

    versions: int = 6
    num_inference: int = 4  # replicas of TP=2
    kill_inference_at: int | None = 3  # version whose refit loses inference rank i1
    kill_trainer_at: int | None = 5  # version whose refit loses trainer rank t1
    pause_s: float = 0.5  # trainers: time between versions (a training step)
    timeout_s: float = 90.0
    log_dir: str | None = None  # keep member logs there (default: a temp dir, removed)

    def __post_init__(self) -> None:
        if self.versions < 1:
            raise ValueError(f"versions must be >= 1, got {self.versions}")
        if self.num_inference < 4 or self.num_inference % 2:
            raise ValueError(f"num_inference must be an even number >= 4 (TP=2 replicas; one rank is killed "
                             f"and catches up from its replica), got {self.num_inference}")
        for label, at in (("kill_inference_at", self.kill_inference_at), ("kill_trainer_at", self.kill_trainer_at)):
            if at is not None and not 1 <= at <= self.versions:
                raise ValueError(f"{label} must be a version in 1..{self.versions}, got {at}")
        if self.pause_s < 0 or self.timeout_s <= 0:
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


@dataclass(frozen=True, slots=True)
class DemoSummary:
    """The demo's outcome; ``to_json`` is what ``elastic-refit demo --json`` prints."""

    versions_published: int
    versions_committed: int
    committed: tuple[dict[str, Any], ...]  # {version, epoch, digest, at_s}
    faults: tuple[FaultRecord, ...]
    verified: bool
    checks: int  # (inference rank incarnation, version) pairs checked bit-exactly
    problems: tuple[str, ...]
    plan: dict[str, int]  # one full-membership refit: reshard vs gather-and-broadcast
    moved: dict[str, int]  # bytes received by inference ranks over the whole run
    attempts: int
    failed_attempts: int
    epochs: int
    wall_s: float
    num_trainers: int = len(TRAINERS)
    num_inference: int = 4
    errors: tuple[str, ...] = ()

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
            "versions_published": self.versions_published,
            "versions_committed": self.versions_committed,
            "committed": list(self.committed),
            "faults_injected": len(self.faults),
            "faults": [dict(asdict(f), recovery_s=f.recovery_s) for f in self.faults],
            "recovered": self.recovered,
            "recovery_p50_s": _percentile(times, 0.5),
            "recovery_max_s": max(times) if times else None,
            "verified": self.verified,
            "checks": self.checks,
            "problems": list(self.problems),
            "plan": self.plan,
            "moved": self.moved,
            "attempts": self.attempts,
            "failed_attempts": self.failed_attempts,
            "epochs": self.epochs,
            "num_trainers": self.num_trainers,
            "num_inference": self.num_inference,
            "wall_s": self.wall_s,
            "errors": list(self.errors),
        }


def _percentile(values: list[float], q: float) -> float | None:
    """Linearly interpolated ``q`` quantile (numpy's default), None for no values."""
    return float(np.percentile(values, q * 100)) if values else None


# ---- member processes ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _KillAt:
    """Fault hook: SIGKILL this process during the transfer of ``version`` (or the first
    later one it takes part in), right after its first message, so peers are mid-transfer.
    The kill time goes to ``fault_path`` first (the parent reads it)."""

    member_id: str
    version: int
    fault_path: str
    armed_path: str | None = None  # fire only once this file exists (the parent arms it)

    def __call__(self, phase: str, context: dict[str, Any]) -> None:
        if phase != "transfer.before" or context.get("version", -1) < self.version:
            return
        if self.armed_path is not None and not os.path.exists(self.armed_path):
            return
        group = context.get("group")

        def die(where: str) -> None:
            with open(self.fault_path, "a") as fh:
                fh.write(json.dumps({"member_id": self.member_id, "role": context.get("role"),
                                     "version": context["version"], "phase": where, "t": time.time()}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)

        if group is None:
            die("transfer.before")
            return
        # A rank with no message in this plan dies on a timer instead: still mid-refit.
        threading.Timer(0.05, die, args=("transfer.timer",)).start()
        for op in ("send", "recv"):
            original = getattr(group, op)

            def wrapped(tensor, peer, tag=0, _original=original, _op=op):
                work = _original(tensor, peer, tag)
                die(f"transfer.{_op}")
                return work

            setattr(group, op, wrapped)


def _member_main(role: str, member_id: str, layout_rank: int, incarnation: str, etcd: str, job: str,
                 spec_json: str, versions: tuple[int, ...], pause_s: float, log_path: str,
                 fail_at: _KillAt | None, events, stop, go=None) -> None:
    """Entry point of one spawned member process (``go``: a warm standby waits for it)."""
    # C++ noise (gloo connection errors, aborts at exit) goes to the member's own file.
    err = os.open(log_path.removesuffix(".log") + ".stderr", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(err, 2)
    import torch

    from elastic_refit.layout import parse_spec
    from elastic_refit.log import configure_logging
    from elastic_refit.runtime.config import RefitConfig, RefitLayouts
    from elastic_refit.runtime.refit import ElasticRefit
    from elastic_refit.testing.pattern import allocate, check_pieces, fill_pieces

    torch.set_num_threads(1)  # 2 cores, 6 processes
    if go is not None:
        while not go.wait(0.1):
            if stop.is_set():
                return
    log_file = open(log_path, "a", buffering=1)  # noqa: SIM115 - open for the process lifetime
    configure_logging(json=True, stream=log_file)
    spec = parse_spec(json.loads(spec_json))
    layouts = RefitLayouts(spec.source, spec.destination)
    domain = TRAINER_DOMAIN if role == "trainer" else INFERENCE_DOMAIN
    config = RefitConfig(job=job, role=role, member_id=member_id, layout_rank=layout_rank, etcd=(etcd,),
                         domain=domain, incarnation=incarnation)
    tag = {"member_id": member_id, "incarnation": incarnation, "role": role}
    try:
        if role == "trainer":
            with ElasticRefit(config, layouts, fail_at=fail_at) as refit:
                for version in versions:
                    time.sleep(pause_s)
                    tensors = allocate(layouts.source, layout_rank, fill=0)
                    fill_pieces(layouts.source, layout_rank, tensors, seed=version)
                    commit = refit.publish(tensors, version)
                    events.put(dict(tag, type="published", version=commit.version, epoch=commit.epoch))
                events.put(dict(tag, type="done", stats=dict(refit.stats)))
            return
        params = allocate(layouts.destination, layout_rank, fill=0)
        with ElasticRefit(config, layouts, parameters=params, fail_at=fail_at) as refit:
            seen = -1
            while not stop.is_set():
                try:
                    refit.wait_for_version(seen + 1, timeout_s=0.2)
                except TimeoutError:
                    continue
                with refit.weights() as serving:
                    problems = check_pieces(layouts.destination, layout_rank, params, seed=serving)
                events.put(dict(tag, type="verified", version=serving, ok=not problems, problems=problems,
                                t=time.time()))
                seen = max(seen, serving)
            events.put(dict(tag, type="done", stats=dict(refit.stats)))
    except BaseException as exc:  # the parent reports it; the member must not hang
        events.put(dict(tag, type="error", error=f"{type(exc).__name__}: {str(exc)[:300]}"))
    finally:
        log_file.flush()


# ---- the parent -------------------------------------------------------------------------
class _Job:
    """Member processes of the demo, started by spawn and stopped by pid."""

    def __init__(self, etcd: str, job: str, spec_json: str, config: DemoConfig, log_dir: Path) -> None:
        self.ctx = mp.get_context("spawn")
        self.events = self.ctx.Queue()
        self.stop_event = self.ctx.Event()
        self.etcd, self.job, self.spec_json, self.config, self.log_dir = etcd, job, spec_json, config, log_dir
        self.fault_path = str(log_dir / "faults.jsonl")
        self.armed_path = str(log_dir / "trainer-fault.armed")
        self.procs: dict[str, mp.process.BaseProcess] = {}  # member_id -> current process
        self.all_procs: list[mp.process.BaseProcess] = []
        self.incarnations: dict[str, str] = {}
        self.spares: dict[str, tuple[tuple[Any, str], Any]] = {}

    def standby(self, role: str, member_id: str, layout_rank: int) -> None:
        """A warm spare for ``member_id``: imported and idle until :meth:`activate` (a real
        deployment restarts onto a spare too; a cold start costs seconds of imports here)."""
        go = self.ctx.Event()
        self.spares[member_id] = (self._spawn(role, member_id, layout_rank, None, go), go)

    def activate(self, member_id: str) -> str:
        """Swap the spare in as ``member_id``'s new incarnation; returns it."""
        (p, incarnation), go = self.spares.pop(member_id)
        go.set()
        self.procs[member_id] = p
        self.incarnations[member_id] = incarnation
        return incarnation

    def start(self, role: str, member_id: str, layout_rank: int, fail_version: int | None = None) -> str:
        p, incarnation = self._spawn(role, member_id, layout_rank, fail_version, None)
        self.procs[member_id] = p
        self.incarnations[member_id] = incarnation
        return incarnation

    def _spawn(self, role: str, member_id: str, layout_rank: int, fail_version: int | None, go):
        incarnation = f"{member_id}-{uuid.uuid4().hex[:6]}"
        # Trainer faults wait for the parent to arm them, so that each fault's recovery is
        # measured on its own (overlapping faults: see the runtime notes in the report).
        armed = self.armed_path if role == "trainer" else None
        fail = _KillAt(member_id, fail_version, self.fault_path, armed) if fail_version is not None else None
        versions = tuple(range(1, self.config.versions + 1))
        p = self.ctx.Process(target=_member_main, name=f"refit-{member_id}", daemon=True, args=(
            role, member_id, layout_rank, incarnation, self.etcd, self.job, self.spec_json, versions,
            self.config.pause_s, str(self.log_dir / f"{incarnation}.log"), fail, self.events, self.stop_event, go))
        p.start()
        self.all_procs.append(p)
        return p, incarnation

    def kill_all(self) -> None:
        for p in self.all_procs:
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        for p in self.all_procs:
            p.join(timeout=5)

    def read_faults(self) -> list[dict[str, Any]]:
        with contextlib.suppress(FileNotFoundError), open(self.fault_path) as fh:
            return [json.loads(line) for line in fh if line.strip()]
        return []


def run_demo(config: DemoConfig | None = None, progress: Callable[[str], None] | None = None) -> DemoSummary:
    """Run the demo job end to end and return its summary; leaves no process behind."""
    from elastic_refit.layout import parse_spec
    from elastic_refit.membership import EtcdClient
    from elastic_refit.membership.versions import VersionStore
    from elastic_refit.plan import make_plan
    from elastic_refit.testing.etcd import EtcdServer

    config = config or DemoConfig()
    say = progress or (lambda _msg: None)
    spec_dict = demo_spec(config.num_inference)
    spec_json = json.dumps(spec_dict)
    inference = tuple(f"i{k}" for k in range(config.num_inference))
    victim_inference, victim_trainer = inference[1], TRAINERS[1]
    job_name = "demo-" + uuid.uuid4().hex[:6]
    log_dir = Path(config.log_dir) if config.log_dir else Path(tempfile.mkdtemp(prefix="elastic-refit-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    server = EtcdServer(name="demo")
    job: _Job | None = None
    errors: list[str] = []
    verified: dict[tuple[str, str], dict[int, bool]] = {}  # (member, incarnation) -> version -> ok
    problems: list[str] = []
    stats: dict[str, dict[str, int]] = {}
    restarts: dict[str, tuple[str, float]] = {}  # member -> (new incarnation, time)
    commit_seen: dict[int, float] = {}
    try:
        server.start()
        say(f"etcd up at {server.endpoint}; job {job_name}; member logs in {log_dir}")
        job = _Job(server.endpoint, job_name, spec_json, config, log_dir)
        for rank, member_id in enumerate(TRAINERS):
            job.start("trainer", member_id, rank,
                      config.kill_trainer_at if member_id == victim_trainer else None)
        for k, member_id in enumerate(inference):
            job.start("inference", member_id, len(TRAINERS) + k,
                      config.kill_inference_at if member_id == victim_inference else None)
        if config.kill_inference_at is not None:
            job.standby("inference", victim_inference, len(TRAINERS) + inference.index(victim_inference))
        say(f"started trainers {', '.join(TRAINERS)} (replicas, whole tensors) and inference ranks "
            f"{', '.join(inference)} ({config.num_inference // 2} replicas of TP=2)")
        client = EtcdClient([server.endpoint])
        store = VersionStore(client, job_name)
        deadline = time.monotonic() + config.timeout_s
        faults_seen = 0
        trainer_done = False
        last = config.versions
        try:
            while True:
                if time.monotonic() > deadline:
                    errors.append(f"timed out after {config.timeout_s} s")
                    break
                state = store.snapshot()
                for v in sorted(state.committed):
                    if v not in commit_seen:
                        commit_seen[v] = time.time()
                        say(f"[{time.time() - t0:5.1f}s] version {v} committed in epoch {state.committed[v].epoch}"
                            f" ({len(state.acks.get(v, {}))} inference ranks acked)")
                faults = job.read_faults()
                for f in faults[faults_seen:]:
                    say(f"[{f['t'] - t0:5.1f}s] FAULT: {f['member_id']} ({f['role']}) SIGKILLed during the refit "
                        f"of version {f['version']} ({f['phase']})")
                faults_seen = len(faults)
                # Restart a killed inference rank (a new incarnation) once the job's epoch no
                # longer lists its dead incarnation: a restart that races the old lease would
                # find its member id in the current epoch (see the report on runtime issues).
                for f in faults:
                    member_id = f["member_id"]
                    if f["role"] == "inference" and member_id not in restarts:
                        proc = job.procs[member_id]
                        # ... and right after a commit: a join landing while an attempt is being
                        # proposed can stall the epoch (runtime issue, see the report).
                        newest = max(commit_seen) if commit_seen else -1
                        if (not proc.is_alive() and newest >= f["version"]
                                and time.time() - commit_seen[newest] < 0.25
                                and not _epoch_lists(client, job_name, member_id, job.incarnations[member_id])):
                            proc.join()
                            incarnation = job.activate(member_id)
                            restarts[member_id] = (incarnation, time.time())
                            say(f"[{time.time() - t0:5.1f}s] {member_id} left the epoch; restarted it (warm spare) as "
                                f"incarnation {incarnation}")
                while True:
                    try:
                        e = job.events.get_nowait()
                    except queue.Empty:
                        break
                    key = (e["member_id"], e["incarnation"])
                    if e["type"] == "verified":
                        verified.setdefault(key, {})[e["version"]] = e["ok"]
                        problems.extend(f"{e['member_id']} v{e['version']}: {p}" for p in e["problems"])
                        if restarts.get(e["member_id"], ("",))[0] == e["incarnation"] and len(verified[key]) == 1:
                            say(f"[{e['t'] - t0:5.1f}s] {e['member_id']} caught up from its peers: serving "
                                f"version {e['version']}, bit-exact={e['ok']}")
                    elif e["type"] == "done":
                        stats[f"{e['member_id']}/{e['incarnation']}"] = e["stats"]
                        if e["role"] == "trainer":
                            trainer_done = True
                    elif e["type"] == "error":
                        errors.append(f"{e['member_id']} ({e['incarnation']}): {e['error']}")
                        say(f"error in {e['member_id']}: {e['error']}")
                # Arm the trainer fault once every restarted inference rank serves again.
                if not os.path.exists(job.armed_path) and all(
                        restarts.get(f["member_id"], ("",))[0] in {i for (m, i) in verified}
                        for f in faults if f["role"] == "inference") and (
                        config.kill_inference_at is None or faults):
                    Path(job.armed_path).touch()
                live = [(m, job.incarnations[m]) for m in inference if job.procs[m].is_alive()]
                if trainer_done and last in state.committed and all(
                        last in verified.get(key, {}) for key in live):
                    break
                if not any(job.procs[m].is_alive() for m in TRAINERS) and not trainer_done:
                    errors.append("every trainer exited before the last version committed")
                    break
                time.sleep(0.05)
            # clean leave: inference ranks close (revoke leases) and report
            job.stop_event.set()
            for p in job.procs.values():
                p.join(timeout=15)
            with contextlib.suppress(queue.Empty):
                while True:
                    e = job.events.get(timeout=0.2)
                    if e["type"] == "done":
                        stats[f"{e['member_id']}/{e['incarnation']}"] = e["stats"]
            final_state = store.snapshot()
        finally:
            client.close()
    finally:
        if job is not None:
            job.kill_all()
        server.stop()
    wall = time.time() - t0

    events = _read_logs(log_dir)
    committed_events = sorted((e for e in events if e.get("event") == "refit.version.committed"),
                              key=lambda e: e["_t"])
    commit_time: dict[int, float] = {}
    for e in committed_events:
        commit_time.setdefault(int(e["version"]), e["_t"])
    for v, t in commit_seen.items():
        commit_time.setdefault(v, t)
    committed = tuple({"version": v, "epoch": c.epoch, "digest": c.digest,
                       "at_s": round(commit_time.get(v, t0) - t0, 3)}
                      for v, c in sorted(final_state.committed.items()))

    fault_records = []
    for f in (job.read_faults() if job else []):
        after = [(t, v) for v, t in commit_time.items() if t >= f["t"]]
        recovered_at, version = min(after) if after else (None, None)
        member_id = f["member_id"]
        restarted = member_id in restarts
        caught_up = restarted_at = None
        if restarted:
            incarnation, restarted_at = restarts[member_id]
            restarted_at -= t0
            times = [e["_t"] for e in events if e.get("event") == "refit.version.serving"
                     and e.get("incarnation") == incarnation]
            caught_up = min(times) - t0 if times else None
        fault_records.append(FaultRecord(member_id, f["role"], int(f["version"]), f["phase"], f["t"] - t0,
                                         None if recovered_at is None else recovered_at - t0, version,
                                         restarted, caught_up, restarted_at))

    # One full-membership refit, planned as the runtime plans it, vs gather-and-broadcast.
    spec = parse_spec(spec_dict)
    s = make_plan(spec.source, spec.destination, spec.topology).stats
    plan = {"model_bytes": s.model_bytes, "cross_domain_bytes": s.cross_domain_bytes,
            "intra_domain_bytes": s.intra_domain_bytes, "lower_bound_bytes": s.lower_bound_bytes,
            "gather_broadcast_bytes": s.gather_broadcast_bytes}
    done = [e for e in events if e.get("event") == "refit.transfer.done" and e.get("role") == "inference"]
    moved = {
        "network_recv_bytes": sum(int(e.get("network_recv_bytes", 0)) for e in done),
        "intra_recv_bytes": sum(int(e.get("intra_recv_bytes", 0)) for e in done),
        "gather_broadcast_bytes": s.gather_broadcast_bytes * len(final_state.committed),
    }
    checks = sum(len(v) for v in verified.values())
    all_ok = all(ok for per in verified.values() for ok in per.values())
    # every committed version was served, bit-exact, by every inference rank alive at its commit
    live_at_end = {(m, job.incarnations[m]) for m in inference} if job else set()
    missing_last = [k for k in live_at_end if final_state.latest_committed not in verified.get(k, {})]
    if missing_last:
        problems.append(f"latest version not verified on {sorted(missing_last)}")
    if config.log_dir is None and not errors:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif errors:
        errors.append(f"member logs kept in {log_dir}")
    return DemoSummary(
        versions_published=config.versions,
        versions_committed=len(final_state.committed),
        committed=committed,
        faults=tuple(fault_records),
        verified=all_ok and not problems and checks > 0 and not errors,
        checks=checks,
        problems=tuple(problems),
        plan=plan,
        moved=moved,
        attempts=len({(e.get("epoch"), e.get("seq")) for e in events if e.get("event") == "refit.attempt.proposed"}),
        failed_attempts=len({(e.get("epoch"), e.get("seq")) for e in events
                             if e.get("event") == "refit.attempt.failed"}),
        epochs=len({e.get("epoch") for e in events if e.get("event") == "refit.epoch.entered"}),
        wall_s=round(wall, 3),
        num_inference=config.num_inference,
        errors=tuple(errors),
    )


def _epoch_lists(client: Any, job: str, member_id: str, incarnation: str) -> bool:
    """Whether the job's current epoch still lists ``member_id`` in ``incarnation``."""
    from elastic_refit.membership import JobKeys, MembershipView

    kv = client.get(JobKeys(job).epoch)
    if kv is None:
        return False
    view = MembershipView.decode(kv.value)
    return member_id in view and view.member(member_id).incarnation == incarnation


def _read_logs(log_dir: Path) -> list[dict[str, Any]]:
    """Every JSON event of every member log, with ``_t`` (unix seconds) parsed."""
    out = []
    for path in sorted(log_dir.glob("*.log")):
        with open(path) as fh:
            for line in fh:
                try:
                    e = json.loads(line)
                    e["_t"] = datetime.fromisoformat(e["timestamp"]).timestamp()
                except (ValueError, KeyError):
                    continue  # a line cut by SIGKILL
                out.append(e)
    return out
