"""One RL loop around the refit, as real processes: the parent's side (start, kill and
restart, collect, summarise). The members are in ``testing.rl_step``.

:func:`run_rl` starts the trainer and engine processes, SIGKILLs the last engine during the
asynchronous mode's refit of step ``kill_at - 1`` and restarts it as a new incarnation,
then returns :func:`summarize`'s figures per mode: the step breakdown (train, refit,
generate, generation paused, step time), the pool's tokens per second during refits
against idle, every served version checked against the trainers', and the kill's recovery.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_refit.testing.gil_sampler import GilSampler, dump_stacks
from elastic_refit.testing.rl_step import RLStepConfig, member_main

__all__ = ["run_rl", "summarize"]


def _env(config: RLStepConfig, slot: int) -> dict[str, str]:
    env = dict(config.env)
    if config.device == "cuda":
        from elastic_refit.testing.processes import nccl_rank_env

        # NCCL's threads by name in the engines' CPU samples (its proxy, socket helpers).
        env = {**nccl_rank_env(slot), "NCCL_SET_THREAD_NAME": "1", **env}
    return env


class _Records:
    """The members' record files, read as they grow (a line cut by a kill is skipped)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = Path(run_dir)
        self._offsets: dict[Path, int] = {}
        self.all: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        new = []
        for path in sorted(self.run_dir.glob("*.jsonl")):
            at = self._offsets.get(path, 0)
            with open(path, "rb") as fh:
                fh.seek(at)
                data = fh.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = at + end
            for line in data[:end].splitlines():
                try:
                    new.append(json.loads(line))
                except ValueError:
                    continue
        self.all += new
        return new


def run_rl(config: RLStepConfig, *, timeout_s: float = 600.0, progress: Callable[[str], None] | None = None,
           gil_profiler: str | None = None, stall_s: float = 45.0) -> dict[str, Any]:
    """Run the loop end to end; returns the summary (``summarize``) with ``errors``.
    ``gil_profiler``: py-spy's path, to sample which threads of engine i0 hold its GIL in
    the asynchronous mode (the summary's ``gil``), and to dump every member's stacks into
    ``run_dir/stacks-<member>.txt`` once no step or refit has progressed for ``stall_s``."""
    say = progress or (lambda _m: None)
    os.makedirs(config.log_dir, exist_ok=True)
    os.makedirs(config.run_dir, exist_ok=True)
    ctx = mp.get_context("spawn")  # gRPC channels and CUDA do not survive fork()
    procs: dict[str, Any] = {}

    def start(role: str, rank: int, slot: int, restarted: bool = False) -> None:
        p = ctx.Process(target=member_main, args=(config, role, rank, _env(config, slot), restarted), daemon=True)
        p.start()
        procs[f"{role[0]}{rank}{'-R' if restarted else ''}"] = p

    records, errors, trained = _Records(config.run_dir), [], {mode: set() for mode in config.modes}
    kill: dict[str, Any] = {}
    gil: GilSampler | None = None
    t0 = time.time()
    try:
        for r in range(config.num_trainers):
            start("trainer", r, r)
        for r in range(config.num_inference):
            start("inference", r, config.num_trainers + r)
        deadline = time.monotonic() + timeout_s
        stalled = _StallDump(gil_profiler, procs, config.run_dir, stall_s, say, t0)
        while time.monotonic() < deadline:
            for rec in records.poll():
                stalled.saw(rec)
                _narrate(rec, t0, say)
                if rec["kind"] == "error":
                    errors.append(f"{rec['member']}: {rec['error']}\n{rec.get('traceback', '')}")
                elif rec["kind"] == "trained":
                    trained[rec["mode"]].add(rec["member"])
                elif rec["kind"] == "joined" and rec["member"] == "i0" and gil_profiler and gil is None:
                    gil = GilSampler(gil_profiler, procs["i0"].pid, os.path.join(config.run_dir, "gil-i0.txt"),
                                     duration_s=timeout_s)
                elif rec["kind"] == "served" and "-R-" in rec["incarnation"]:
                    kill["served"] = True
                elif (rec["kind"] == "step" and rec["mode"] == "async-staged" and rec["member"] == "t0"
                      and config.kill_at is not None and rec["step"] == config.kill_at - 1 and not kill):
                    victim = procs[f"i{config.num_inference - 1}"]
                    os.kill(victim.pid, signal.SIGKILL)
                    kill = {"member": f"i{config.num_inference - 1}", "t": time.time(), "pid": victim.pid,
                            "after_step": rec["step"]}
                    say(f"[{time.time() - t0:6.1f}s] FAULT: SIGKILL engine {kill['member']} (pid {victim.pid}) "
                        f"while version {rec['step']} is being refit; restarting it")
                    _record_fault(config, kill, rec["step"])
                    start("inference", config.num_inference - 1, config.world_size, restarted=True)
                    kill["restarted_at"] = time.time()
            for mode, members in trained.items():
                # A mode is over once every trainer is done, and a restarted engine caught up.
                if len(members) == config.num_trainers and (mode != "async-staged" or not kill or "served" in kill):
                    Path(config.run_dir, f"over-{mode}").touch()
            if errors or all(p.exitcode is not None for k, p in procs.items() if k != kill.get("member")):
                break
            stalled.check()
            time.sleep(0.05)
        else:
            errors.append(f"timed out after {timeout_s} s")
        records.poll()
    finally:
        for p in procs.values():
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    failed = [f"{k}: exit status {p.exitcode}" for k, p in procs.items()
              if p.exitcode not in (0, None) and k != kill.get("member")]
    if failed and not errors:
        errors.append("process(es) failed: " + ", ".join(failed))
    if gil is not None:  # the engine is gone: py-spy has stopped too
        held, error = gil.result()
        records.all.append({"kind": "gil", "mode": "async-staged", "member": "i0", "started": gil.started,
                            "seconds_by_thread": held, "error": error})
    summary = summarize(config, records.all, kill)
    summary.update(errors=errors, wall_s=time.time() - t0)
    return summary


def _record_fault(config: RLStepConfig, kill: dict[str, Any], version: int) -> None:
    """The kill as chaos records faults (``faults.jsonl`` beside the logs): the timeline shows it."""
    line = json.dumps({"index": 0, "kind": "kill", "member_id": kill["member"], "role": "inference", "life": 0,
                       "phase": "async refit", "version": version, "pid": kill["pid"], "t": kill["t"]}) + "\n"
    with open(os.path.join(config.log_dir, "faults.jsonl"), "a") as fh:
        fh.write(line)


class _StallDump:
    """Once no step or refit record has arrived for ``stall_s`` (engines keep reporting CPU
    samples while a refit hangs, so those do not count), every live member's stacks are
    dumped with py-spy, once: a hung run says where each member waits."""

    _PROGRESS = ("step", "trained", "served", "refit.event", "joined")

    def __init__(self, pyspy: str | None, procs: dict[str, Any], run_dir: str, stall_s: float,
                 say: Callable[[str], None], t0: float) -> None:
        if stall_s <= 0:
            raise ValueError(f"stall_s must be > 0, got {stall_s}")
        self.pyspy, self.procs, self.run_dir, self.stall_s, self.say, self.t0 = pyspy, procs, run_dir, stall_s, say, t0
        self.last = time.monotonic()
        self.done = pyspy is None

    def saw(self, rec: dict[str, Any]) -> None:
        if rec["kind"] in self._PROGRESS:
            self.last = time.monotonic()

    def check(self) -> None:
        if self.done or time.monotonic() - self.last < self.stall_s:
            return
        self.done = True
        self.say(f"[{time.time() - self.t0:6.1f}s] no progress for {self.stall_s:.0f} s: dumping the members' stacks")
        for key, p in self.procs.items():
            if p.is_alive() and p.pid is not None:
                why = dump_stacks(self.pyspy, p.pid, os.path.join(self.run_dir, f"stacks-{key}.txt"))
                if why is not None:
                    self.say(f"  {key}: no stacks: {why}")


def _narrate(rec: dict[str, Any], t0: float, say: Callable[[str], None]) -> None:
    at = f"[{rec['t'] - t0:6.1f}s]"
    if rec["kind"] == "step" and rec["member"] == "t0":
        say(f"{at} {rec['mode']}: step {rec['step']} trained in {rec['train_s']:.3f} s (samples of "
            f"versions {rec['sample_versions']}), refit call {rec['refit_s']:.3f} s, reward {rec['reward']:.3f}")
    elif rec["kind"] == "mode.started" and rec["member"] == "t0":
        say(f"{at} mode {rec['mode']}")
    elif rec["kind"] == "error":
        say(f"{at} ERROR {rec['member']}: {rec['error']}")


# ---- the figures -----------------------------------------------------------------------------

def summarize(config: RLStepConfig, records: list[dict[str, Any]], kill: dict[str, Any]) -> dict[str, Any]:
    """Per mode: the step table, tokens/s during refits against idle, verification; and the kill."""
    out: dict[str, Any] = {"modes": {}, "kill": _recovery(config, records, kill) if kill else None}
    # The pool's rate is compared outside the kill's recovery (kill -> next commit): a failed
    # transfer logs no window, and what the fault costs is reported on its own.
    recovery = None
    if out["kill"] and out["kill"]["next_commit_s"] is not None:
        recovery = (kill["t"], kill["t"] + out["kill"]["next_commit_s"])
    for mode in config.modes:
        mine = [r for r in records if r.get("mode") == mode]
        out["modes"][mode] = {"steps": _steps(config, mode, mine), "verified": _verified(mine),
                              "throughput": _throughput(mode, mine, recovery if mode == "async-staged" else None),
                              "cpu": _cpu(mode, mine), "gil": _gil(mode, mine)}
    return out


def _steps(config: RLStepConfig, mode: str, recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    trainer = {r["step"]: r for r in recs if r["kind"] == "step" and r["member"] == "t0"}
    generated = [r for r in recs if r["kind"] == "generated"]
    paused = [r for r in recs if r["kind"] == "refit.event" and r["event"] == "refit.serving.paused"]
    rows = []
    for step in range(1, config.steps + 1):
        rec = trainer.get(step)
        if rec is None:
            continue
        nxt = trainer.get(step + 1)
        gens = [g for g in generated if g["version"] == step - (0 if mode == "async-staged" else 1)]
        if mode == "async-staged":
            held = [p["seconds"] for p in paused if p["version"] == step]
            pause = max(held) if held else None
        else:  # nobody generates from the end of training until the new version is served
            resumed = [g["start"] for g in generated if g["version"] == step]
            received = [r["end"] for r in recs if r["kind"] == "received" and r["version"] == step]
            pause = (max(resumed or received) - rec["train_end"]) if (resumed or received) else None
        rows.append({"step": step, "train_s": rec["train_s"], "refit_s": rec["refit_s"],
                     "generate_s": statistics.mean(g["end"] - g["start"] for g in gens) if gens else None,
                     "paused_s": pause, "wait_samples_s": rec["wait_samples_s"],
                     "step_s": (nxt["train_start"] - rec["train_start"]) if nxt else None,
                     "reward": rec["reward"]})
    return rows


def _windows(mode: str, recs: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """When weights were moving: synchronous, from trainer 0's refit call until the first
    engine has the version (nobody can generate meanwhile); asynchronous, each engine's
    transfers."""
    if mode != "async-staged":  # from the trainer's refit call until the first engine has the version
        received = {}
        for r in recs:
            if r["kind"] == "received":
                received[r["version"]] = min(received.get(r["version"], r["end"]), r["end"])
        return [(r["refit_start"], received.get(r["step"], r["refit_end"])) for r in recs
                if r["kind"] == "step" and r["member"] == "t0"]
    return [(r["at"] - r["seconds"], r["at"]) for r in recs
            if r["kind"] == "refit.event" and r["event"] == "refit.transfer.done"]


def _merged(intervals: list[tuple[float, float]], begin: float, end: float) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted((max(a, begin), min(b, end)) for a, b in intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _throughput(mode: str, recs: list[dict[str, Any]], exclude: tuple[float, float] | None = None) -> dict[str, Any]:
    """The engines' pool: tokens per second while weights move into any engine, and
    otherwise (``exclude``: an interval left out of both)."""
    steps = sorted((t, g["num_sequences"]) for g in recs if g["kind"] == "generated" for t in g["step_times"])
    if len(steps) < 2:
        return {}
    begin, end = steps[0][0], steps[-1][0]
    out = _merged([exclude] if exclude else [], begin, end)
    refit = _merged(_windows(mode, recs), begin, end)
    both = _merged([*refit, *out], begin, end)

    def length(spans: list[tuple[float, float]]) -> float:
        return sum(b - a for a, b in spans)

    def inside(t: float, spans: list[tuple[float, float]]) -> bool:
        return any(a <= t <= b for a, b in spans)

    refit_s = length(both) - length(out)  # refit windows outside the excluded interval
    idle_s = (end - begin) - length(both)
    kept = [(t, n) for t, n in steps if not inside(t, out)]
    tokens_in = sum(n for t, n in kept if inside(t, refit))
    tokens_idle = sum(n for _, n in kept) - tokens_in
    rate_in = tokens_in / refit_s if refit_s > 0 else None
    rate_idle = tokens_idle / idle_s if idle_s > 0 else None
    return {"refit_s": refit_s, "idle_s": idle_s, "excluded_s": length(out), "tokens_per_s_refit": rate_in,
            "tokens_per_s_idle": rate_idle, "ratio": rate_in / rate_idle if rate_in is not None and rate_idle else None}


def _cpu(mode: str, recs: list[dict[str, Any]], top: int = 6) -> dict[str, Any]:
    """The engines' CPU samples (``testing.cpu_sampler``) inside refit windows and outside:
    the host's busy fraction and the cores each thread name used, means over samples and
    engines; the ``top`` threads by use inside refits."""
    samples = [r for r in recs if r["kind"] == "cpu"]
    if not samples:
        return {}
    windows = _merged(_windows(mode, recs), min(r["t"] for r in samples), max(r["t"] for r in samples))
    split: dict[str, list[dict[str, Any]]] = {"refit": [], "idle": []}
    for r in samples:  # a sample belongs where its interval's middle lies
        middle = r["t"] - r["seconds"] / 2
        split["refit" if any(a <= middle <= b for a, b in windows) else "idle"].append(r)

    def means(rows: list[dict[str, Any]]) -> dict[str, Any]:
        if not rows:
            return {"samples": 0}
        busy = [r["host_busy"] for r in rows if "host_busy" in r]
        names = {n for r in rows for n in r["threads"]}
        return {"samples": len(rows), "host_busy": statistics.mean(busy) if busy else None,
                "threads": {n: statistics.mean(r["threads"].get(n, 0.0) for r in rows) for n in names}}

    out = {k: means(v) for k, v in split.items()}
    ranked = sorted(out["refit"].get("threads", {}).items(), key=lambda kv: -kv[1])[:top]
    out["top"] = [(n, cores, out["idle"].get("threads", {}).get(n, 0.0)) for n, cores in ranked]
    out["host_cores"] = samples[-1].get("host_cores")
    return out


def _gil(mode: str, recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Engine i0's GIL (``testing.gil_sampler``): the seconds each thread held it while
    sampled, and the refit windows' seconds in that time. The runtime's threads' seconds
    over the refits' bound the share of refit time in which they held it (all of their
    holding falls in refits at most)."""
    found = [r for r in recs if r["kind"] == "gil"]
    if not found:
        return {}
    rec = found[-1]
    if not rec["seconds_by_thread"]:
        return {"error": rec["error"]}
    mine = [r for r in recs if r.get("member") == "i0" and "t" in r]  # its own records (the gil one has no time)
    begin, end = rec["started"], max(r["t"] for r in mine)
    refit_s = sum(b - a for a, b in _merged(_windows(mode, mine), begin, end))
    held = rec["seconds_by_thread"]
    runtime = sum(s for n, s in held.items() if n not in ("MainThread", "cpu-sampler"))
    return {"sampled_s": end - begin, "refit_s": refit_s, "seconds_by_thread": held,
            "runtime_over_refit": runtime / refit_s if refit_s > 0 else None}


def _verified(recs: list[dict[str, Any]]) -> dict[str, Any]:
    published = {r["version"]: r["checksum"] for r in recs if r["kind"] == "published"}
    served = [r for r in recs if r["kind"] == "served"]
    bad = [f"{r['incarnation']} v{r['version']}" for r in served if published.get(r["version"]) != r["checksum"]]
    return {"num_served": len(served), "num_versions_published": len(published), "mismatches": bad,
            "ok": bool(served) and not bad}


def _recovery(config: RLStepConfig, records: list[dict[str, Any]], kill: dict[str, Any]) -> dict[str, Any]:
    """Kill -> the next commit (from the members' logs), and restart -> serving."""
    from elastic_refit.testing.logs import read_logs

    events = [e for per in read_logs(config.log_dir).values() for e in per if e.get("_t") is not None]
    job = f"{config.job}-async-staged"
    commits = sorted((e["_t"], e.get("version")) for e in events
                     if e.get("event") == "refit.version.committed" and e.get("job") == job and e["_t"] >= kill["t"])
    restarted = [r for r in records if r.get("incarnation", "").startswith(f"{kill['member']}-R")]
    served = sorted(r["t"] for r in restarted if r["kind"] == "served")
    joined = sorted(r["t"] for r in restarted if r["kind"] == "joined")
    return {**kill, "next_commit_s": commits[0][0] - kill["t"] if commits else None,
            "next_commit_version": commits[0][1] if commits else None,
            "restart_to_joined_s": joined[0] - kill["restarted_at"] if joined else None,
            "restart_to_serving_s": served[0] - kill["restarted_at"] if served else None,
            "restarted_served_versions": sorted({r["version"] for r in restarted if r["kind"] == "served"})}
