"""Soak: many versions through one real job, to show that nothing grows with the number of
steps (``elastic-refit bench soak``).

A real etcd, 2 trainer replicas and 4 inference ranks (2 x TP=2) as processes, tiny tensors,
trainers publishing back to back. Every version commits only once every inference rank
acked it with verified digests, and each inference rank checks every version it serves
byte for byte. While the job runs, a sampler reads the job's etcd key count, etcd's db size,
every member's resident memory and the CPU time of the members and etcd. The per-version
overhead is a trainer's publish -> commit seconds (there is no training step in between).

The machine is shared and its speed drifts by tens of percent over minutes, so the last
window is also compared with a *reference job* at the same time: a second, fresh job (its own
etcd, same members and tensors), started idle beside the long one. While the long job
publishes its last window, the two take turns in blocks of versions, and the reference
publishes its first window. Last window against the reference's first, both timed under the
same machine, is what a long run costs over a fresh one; last window against the long job's
own first is also given. After the last version the members stay in the job, idle, for
``idle_s``: the etcd requests they make meanwhile (etcd's own gRPC counters, the sampler
paused) are what an idle member costs etcd. Those counters also give the etcd requests of the
whole run per version (start-up and the sampler included).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from elastic_refit._validate import require_at_least
from elastic_refit.errors import RefitError
from elastic_refit.membership.client import EtcdClient
from elastic_refit.membership.keys import JobKeys
from elastic_refit.membership.versions import VersionStore
from elastic_refit.testing.etcd import EtcdServer
from elastic_refit.testing.job import MemberSpec, run_member
from elastic_refit.testing.probes import cpu_seconds, etcd_requests, rss_bytes
from elastic_refit.testing.processes import apply_environ, fork_server_context
from elastic_refit.testing.specs import tiny_spec_json

TRAINERS = ("t0", "t1")
INFERENCE = ("i0", "i1", "i2", "i3")


@dataclass(frozen=True, slots=True)
class SoakConfig:
    """``num_versions`` versions; overheads are the means of the first and the last
    ``window`` versions (at most half of them each). With ``reference``, a fresh job publishes
    ``window`` versions in turns of ``block`` versions with the long job's last window."""

    num_versions: int = 20_000
    window: int = 1_000
    sample_s: float = 1.0
    idle_s: float = 10.0
    timeout_s: float = 7_200.0
    reference: bool = True
    block: int = 100
    # etcd's auto-compaction (mode, retention). Its history costs etcd CPU on every request
    # (a 2,000-version A/B here: etcd +15% per version after 1,500 versions with the 10,000-
    # revision default, which etcd 3.4 applies every 5 minutes; +3% with 10 s). The soak runs
    # ~10 versions a second, ~100x an RL job's pace, so 10 s of history here holds as many
    # versions as a production etcd's minutes (deploy/README.md).
    etcd_compaction: tuple[str, str] = ("periodic", "10s")

    def __post_init__(self) -> None:
        require_at_least("--versions", self.num_versions, 20, "two windows of 10 at least")
        require_at_least("--window", self.window, 10)
        require_at_least("--block", self.block, 1)
        if self.etcd_compaction[0] not in ("revision", "periodic") or not self.etcd_compaction[1]:
            raise ValueError(f"etcd_compaction must be ('revision' | 'periodic', retention), got {self.etcd_compaction!r}")
        if not 0 < self.sample_s < self.timeout_s:
            raise ValueError(f"sample_s must be in (0, timeout_s), got {self.sample_s}")
        if not 0 <= self.idle_s < self.timeout_s:
            raise ValueError(f"idle_s must be in [0, timeout_s), got {self.idle_s}")


LONG, REFERENCE = "long", "reference"


def interleave_schedule(num_versions: int, window: int, block: int,
                        reference: bool = True) -> tuple[tuple[str, int], ...]:
    """The soak's steps (pure): ``(job, version)`` pairs, each letting ``job`` publish up to
    ``version``, each step begun once the one before committed. The long job runs alone up to
    its last ``window``; then the two jobs take turns in blocks of ``block`` versions, each
    pair's order flipped (long, reference, reference, long, ...) so that neither always goes
    first, until the long job reached ``num_versions`` and the reference ``window``."""
    if not 0 < window <= num_versions // 2 or block < 1:
        raise ValueError(f"window {window} must be in [1, {num_versions // 2}] and block {block} at least 1")
    if not reference:
        return ((LONG, num_versions),)
    steps: list[tuple[str, int]] = [(LONG, num_versions - window)]
    ends = [min(window, k + block) for k in range(0, window, block)]
    for pair, end in enumerate(ends):
        order = (LONG, REFERENCE) if pair % 2 == 0 else (REFERENCE, LONG)
        steps += [(job, num_versions - window + end if job == LONG else end) for job in order]
    return tuple(steps)


class _SharedPace:
    """A trainer's side of the parent's gate (``job.Pace``): shared memory, polled."""

    def __init__(self, allowed, mine) -> None:
        self._allowed = allowed  # RawValue: the job may publish up to this version
        self._mine = mine  # RawArray: [version waited for, last version committed]

    def wait_turn(self, version: int) -> None:
        self._mine[0] = version
        while self._allowed.value < version:
            time.sleep(0.002)

    def committed(self, version: int) -> None:
        self._mine[1] = version


def _member_main(member: MemberSpec, results, environ: dict[str, str], release, pace) -> None:
    apply_environ(environ)
    try:
        # Stay in the job after the last version until the idle window was measured.
        results.put(run_member(member, hold=lambda _refit: _until_released(release), pace=pace))
    except BaseException as exc:  # reported; the bench fails with it
        results.put({"member_id": member.member_id, "error": f"{type(exc).__name__}: {exc}"})


def _until_released(release, timeout_s: float = 3_600.0) -> None:
    # Polled, not release.wait(): a multiprocessing Event's set() waits for every sleeper to
    # wake, and one that died asleep would block the parent's set() forever.
    deadline = time.monotonic() + timeout_s
    while not release.is_set() and time.monotonic() < deadline:
        time.sleep(0.1)


class _SoakJob:
    """One job of the soak in the parent: its etcd, its six member processes, their reports
    and the gate its trainers publish through."""

    def __init__(self, stack: contextlib.ExitStack, ctx, name: str, num_versions: int, record_window: int,
                 release, compaction: tuple[str, str], timeout_s: float) -> None:
        self.name = name
        self.num_versions = num_versions
        self.etcd = stack.enter_context(EtcdServer(name=name, compaction=compaction))
        self.endpoints = tuple(self.etcd.endpoints)
        self.requests_start = sum(etcd_requests(self.endpoints[0]).values())
        self.requests_run = 0.0  # etcd's gRPC messages once every version committed
        self.job = f"{name}-{uuid.uuid4().hex[:6]}"
        self.results = ctx.Queue()
        self.allowed = ctx.RawValue("q", 0)
        self.trainers = {t: ctx.RawArray("q", 2) for t in TRAINERS}
        self.reports: dict[str, dict[str, Any]] = {}
        self.procs: dict[str, Any] = {}
        spec = tiny_spec_json(len(INFERENCE))
        versions = tuple(range(1, num_versions + 1))
        for rank, member_id in enumerate(TRAINERS + INFERENCE):
            role = "trainer" if member_id in TRAINERS else "inference"
            member = MemberSpec(self.job, role, member_id, rank, self.endpoints, f"d-{role}", spec_json=spec,
                                versions=versions, start_with=TRAINERS + INFERENCE if role == "trainer" else (),
                                # The reference job's inference ranks wait idle for most of the run.
                                config={"version_timeout_s": timeout_s}, record_window=record_window)
            pace = _SharedPace(self.allowed, self.trainers[member_id]) if role == "trainer" else None
            proc = ctx.Process(target=_member_main, args=(member, self.results, dict(os.environ), release, pace),
                               daemon=True)
            proc.start()
            self.procs[member_id] = proc
        stack.callback(self._kill)
        self.client = stack.enter_context(EtcdClient(list(self.endpoints)))
        self.store = VersionStore(self.client, self.job)

    def ready(self) -> bool:
        """Every member joined and both trainers wait to publish (start_with)."""
        return all(mine[0] >= 1 for mine in self.trainers.values())

    def committed(self) -> int:
        """The last version both trainers saw committed."""
        return min(mine[1] for mine in self.trainers.values())

    def open(self, version: int) -> None:
        self.allowed.value = version

    def collect(self) -> None:
        """Take the reports in the pipe; RuntimeError if a member failed (the others would
        wait for it until the timeout) or died without a report."""
        with contextlib.suppress(queue.Empty):
            while True:
                report = self.results.get_nowait()
                self.reports[report["member_id"]] = report
                if "error" in report:
                    raise RuntimeError(f"soak job {self.name}: member {report['member_id']} failed: {report['error']}")
        if any(not p.is_alive() and m not in self.reports for m, p in self.procs.items()):
            with contextlib.suppress(queue.Empty):  # a report may still be in the pipe
                report = self.results.get(timeout=5.0)
                self.reports[report["member_id"]] = report
            dead = [m for m, p in self.procs.items() if not p.is_alive() and m not in self.reports]
            if dead:
                raise RuntimeError(f"soak job {self.name}: members {dead} died without a report")

    def done(self) -> bool:
        return len(self.reports) == len(self.procs)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds of each member and of etcd so far."""
        pids = {m: p.pid for m, p in self.procs.items()} | {f"etcd{k or ''}": pid for k, pid in enumerate(self.etcd.pids)}
        cpu = {name: cpu_seconds(pid) for name, pid in pids.items() if pid is not None}
        return {name: c for name, c in cpu.items() if c is not None}

    def _kill(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join(10)


class _Sampler:
    """Every ``sample_s``, on a thread of its own: the long job's etcd key count and db size,
    its members' resident memory, and the CPU seconds of each job's processes. Paused while
    the idle window is measured, so that its own requests stay out of it."""

    def __init__(self, config: SoakConfig, jobs: dict[str, _SoakJob], window: int,
                 progress: Callable[[str], None]) -> None:
        self.config = config
        self.jobs = jobs
        self.window = window
        self.progress = progress
        self.prefix = JobKeys(jobs[LONG].job).prefix
        self.samples: list[dict[str, Any]] = []
        self.failed: list[BaseException] = []
        self.stop = threading.Event()
        self.paused = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.stop.set()
        self._thread.join(10)

    def _read(self) -> dict[str, Any]:
        long_job = self.jobs[LONG]
        latest = long_job.store.snapshot().latest_committed or 0
        rss = {m: rss_bytes(p.pid) for m, p in long_job.procs.items() if p.pid is not None}
        # What a version costs the members and etcd, whatever else the (shared) machine runs
        # meanwhile; by process, to see which one does more work.
        cpu = long_job.cpu_seconds()
        reading = {"t": time.monotonic(), "version": latest,
                   "keys": long_job.client.count_prefix(self.prefix), "db_bytes": long_job.client.db_size(),
                   "rss": {m: r for m, r in rss.items() if r is not None},
                   "cpu_s": sum(cpu.values()), "cpu_s_by_process": cpu}
        if REFERENCE in self.jobs:
            cpu = self.jobs[REFERENCE].cpu_seconds()
            reading |= {"reference_version": self.jobs[REFERENCE].committed(),
                        "reference_cpu_s": sum(cpu.values()), "reference_cpu_s_by_process": cpu}
        return reading

    def _run(self) -> None:
        last_said = 0.0
        while not self.stop.wait(self.config.sample_s):
            if self.paused.is_set():
                continue
            try:
                reading = self._read()
                self.samples.append(reading)
            except (RefitError, OSError):
                continue  # etcd busy for a moment: the next sample
            except Exception as exc:  # a bug here would leave the run without samples: fail it
                self.failed.append(exc)
                return
            if time.monotonic() - last_said > 10:
                last_said = time.monotonic()
                said = f"version {reading['version']}/{self.config.num_versions}, {reading['keys']} etcd keys"
                if REFERENCE in self.jobs:
                    said += f"; reference {reading['reference_version']}/{self.window}"
                self.progress(said)


def run_soak(config: SoakConfig, progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Run the soak; returns the figures (see ``elastic-refit bench soak --help``)."""
    window = _window(config)
    steps = interleave_schedule(config.num_versions, window, _block(config), config.reference)
    ctx = fork_server_context()
    release = ctx.Event()
    idle: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        stack.callback(release.set)
        jobs = {LONG: _SoakJob(stack, ctx, "soak", config.num_versions, window, release, config.etcd_compaction,
                               config.timeout_s)}
        if config.reference:
            jobs[REFERENCE] = _SoakJob(stack, ctx, "soak-ref", window, window, release, config.etcd_compaction,
                                       config.timeout_s)
        long_job = jobs[LONG]
        sampler = _Sampler(config, jobs, window, progress)
        stack.callback(sampler.close)
        deadline = time.monotonic() + config.timeout_s
        step = -1  # the step under way; -1: the members are still joining

        def step_done() -> bool:
            if step < 0:
                return all(j.ready() for j in jobs.values())
            job, version = steps[step]
            # the last step ends with a sample past it: the last window's CPU figures need one
            return jobs[job].committed() >= version and (step < len(steps) - 1
                                                         or _sampled_the_end(sampler.samples, jobs))

        while not all(j.done() for j in jobs.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"soak timed out after {config.timeout_s} s at step {step} of {steps}")
            if sampler.failed:
                raise RuntimeError(f"the soak's sampler failed: {sampler.failed[0]!r}") from sampler.failed[0]
            for job in jobs.values():
                job.collect()
            if step < len(steps) and step_done():
                step += 1
                if step < len(steps):
                    jobs[steps[step][0]].open(steps[step][1])
                else:  # every version committed: what idle members cost etcd, then let them go
                    long_job.requests_run = sum(etcd_requests(long_job.endpoints[0]).values())
                    idle.update(_measure_idle(long_job.endpoints[0], config.idle_s, sampler.paused,
                                              len(long_job.procs)))
                    sampler.close()  # no samples of members on their way out
                    release.set()
            time.sleep(0.005)
        final_keys = long_job.client.count_prefix(sampler.prefix)
    # Every member reported without an error here: collect() raised on the first error or death.
    figures = summarize(config, long_job.reports, sampler.samples, final_keys, idle,
                        reference=jobs[REFERENCE].reports if REFERENCE in jobs else None)
    # everything of the run (start-up, the sampler's reads) over its versions
    figures["etcd_requests_per_version"] = (long_job.requests_run - long_job.requests_start) / config.num_versions
    figures["etcd_compaction"] = ":".join(config.etcd_compaction)
    return figures


def _sampled_the_end(samples: list[dict[str, Any]], jobs: dict[str, _SoakJob]) -> bool:
    """A sample past every job's last version."""
    return bool(samples) and samples[-1]["version"] >= jobs[LONG].num_versions and (
        REFERENCE not in jobs or samples[-1]["reference_version"] >= jobs[REFERENCE].num_versions)


def _measure_idle(endpoint: str, idle_s: float, paused: threading.Event, num_members: int) -> dict[str, Any]:
    """etcd requests per second per member while every member is idle in the job."""
    if idle_s <= 0:
        return {}
    paused.set()
    time.sleep(1.0)  # the last commit's stragglers (acks seen, serving) settle first
    before, t0 = etcd_requests(endpoint), time.monotonic()
    time.sleep(idle_s)
    after, seconds = etcd_requests(endpoint), time.monotonic() - t0
    paused.clear()
    rates = {m: (after.get(m, 0.0) - before.get(m, 0.0)) / seconds / num_members for m in after}
    # The two metrics reads themselves are HTTP, not gRPC: nothing of ours is counted.
    return {"idle_seconds": seconds,
            "idle_requests_per_member_s": sum(rates.values()),
            "idle_requests_by_method": {m: round(r, 3) for m, r in sorted(rates.items()) if r > 0}}


def _second_half(versions: np.ndarray, values: np.ndarray) -> tuple[float, float]:
    """Least-squares slope per 1,000 versions over the second half of the run, and the
    growth from its first to its last point (a fraction)."""
    half = versions >= versions[0] + (versions[-1] - versions[0]) / 2
    slope = float(np.polyfit(versions[half], values[half], 1)[0]) * 1000 if np.ptp(versions[half]) > 0 else 0.0
    return slope, float(values[half][-1] / values[half][0] - 1.0)


def _rss_trend(warm: list[dict[str, Any]], num_versions: int) -> dict[str, Any]:
    """Member memory over the run, from the samples past start-up (pure): the largest
    member's RSS at each tenth of the versions, and each member's least-squares slope over
    the second half, past any warm-up (flat memory: a slope near 0, where a leak grows with
    every version); the figures are the steepest member's."""
    points = [s for s in warm if s["rss"]]
    if len(points) < 4:
        return {"member_rss_by_tenth_bytes": [], "member_rss_second_half_slope_bytes_per_1000_versions": None,
                "member_rss_second_half_growth": None, "member_rss_second_half_slope_by_member": {}}
    versions = np.array([s["version"] for s in points], dtype=np.float64)
    largest = np.array([max(s["rss"].values()) for s in points], dtype=np.float64)
    by_tenth = [int(largest[int(np.argmin(np.abs(versions - num_versions * k / 10)))]) for k in range(1, 11)]
    trends: dict[str, tuple[float, float]] = {}
    for member in sorted({m for s in points for m in s["rss"]}):
        seen = [(s["version"], s["rss"][member]) for s in points if member in s["rss"]]
        if len(seen) >= 4:
            trends[member] = _second_half(np.array([v for v, _ in seen], dtype=np.float64),
                                          np.array([r for _, r in seen], dtype=np.float64))
    steepest = max(trends, key=lambda m: trends[m][0])
    return {"member_rss_by_tenth_bytes": by_tenth,
            "member_rss_second_half_slope_bytes_per_1000_versions": trends[steepest][0],
            "member_rss_second_half_growth": trends[steepest][1],
            "member_rss_second_half_slope_by_member": {m: round(t[0]) for m, t in trends.items()}}


def _cpu_per_version(samples: list[dict[str, Any]], versions: tuple[int, int],
                     version_key: str = "version", cpu_key: str = "cpu_s") -> float | None:
    """CPU seconds per version over ``versions`` (inclusive bounds), from the two samples
    that bracket that range (pure); ``None`` where none do."""
    points = [(s[version_key], s[cpu_key]) for s in samples if s.get(cpu_key) is not None]
    lo, hi = versions
    before = [p for p in points if p[0] <= lo]
    after = [p for p in points if p[0] >= hi]
    if not before or not after or after[0][0] <= before[-1][0]:
        return None
    (v0, c0), (v1, c1) = before[-1], after[0]
    return (c1 - c0) / (v1 - v0)


def _cpu_by_process(samples: list[dict[str, Any]], versions: tuple[int, int], version_key: str,
                    cpu_key: str) -> dict[str, float]:
    """Each process's CPU seconds per version over ``versions`` (as ``_cpu_per_version``)."""
    names = sorted({n for s in samples for n in s.get(cpu_key, {})})
    rates = {n: _cpu_per_version([{version_key: s[version_key], "cpu": s[cpu_key].get(n)}
                                  for s in samples if cpu_key in s], versions, version_key, "cpu")
             for n in names}
    return {n: r for n, r in rates.items() if r is not None}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _verified(reports: dict[str, dict[str, Any]], num_versions: int) -> tuple[int, int, int]:
    """(versions verified: all or 0, the fewest versions an inference rank served and
    checked, problems): every version committed as itself (a trainer blocks on each),
    verified by every rank's digests before the commit, and checked byte for byte by every
    rank that served it."""
    committed_as_published = all(
        reports[t]["num_committed"] == num_versions and reports[t]["committed_consecutive"]
        and reports[t]["committed_span"] == [1, num_versions] for t in TRAINERS)
    problems = sum(len(reports[i]["problems"]) for i in INFERENCE)
    served = min(reports[i]["num_committed"] for i in INFERENCE)
    return (num_versions if committed_as_published and problems == 0 else 0), served, problems


def _window(config: SoakConfig) -> int:
    return min(config.window, config.num_versions // 2)


def _block(config: SoakConfig) -> int:
    return min(config.block, _window(config))


def summarize(config: SoakConfig, reports: dict[str, dict[str, Any]], samples: list[dict[str, Any]],
              final_keys: int, idle: dict[str, Any] | None = None,
              reference: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The soak's figures from the members' reports (``CommitRecord.report`` fields, first
    and last ``window`` versions kept), the reference job's members' reports (its ``window``
    versions) and the sampler's readings (pure)."""
    window = _window(config)
    seconds = np.array([c["seconds"] for c in reports[TRAINERS[0]]["committed"]], dtype=np.float64)
    verified, served, problems = _verified(reports, config.num_versions)
    warm = [s for s in samples if s["version"] >= window // 10]  # past start-up
    first, last = (warm[0], warm[-1]) if warm else ({"rss": {}}, {"rss": {}})
    first_overhead, last_overhead = float(seconds[:window].mean()), float(seconds[-window:].mean())
    # Version ranges of the windows for the sampler's figures: the first ones past start-up,
    # as the memory figures (joins and first plans aside).
    first_versions = (max(1, window // 10), window)
    last_versions = (config.num_versions - window + 1, config.num_versions)
    last_cpu = _cpu_per_version(samples, last_versions)
    first_cpu = _cpu_per_version(samples, first_versions)
    out = {
        "versions": config.num_versions,
        "window": window,
        "verified": verified,
        "served_checked_min": served,
        "problems": problems,
        "first_overhead_s": first_overhead,
        "last_overhead_s": last_overhead,
        "overhead_ratio": last_overhead / first_overhead,
        "etcd_keys_max": max((s["keys"] for s in samples), default=final_keys),
        "etcd_keys_final": final_keys,
        "etcd_db_bytes_first": first.get("db_bytes"),
        "etcd_db_bytes_last": last.get("db_bytes"),
        "member_rss_first_bytes": max(first["rss"].values(), default=None),
        "member_rss_last_bytes": max(last["rss"].values(), default=None),
        **_rss_trend(warm, config.num_versions),
        "first_cpu_s_per_version": first_cpu,
        "last_cpu_s_per_version": last_cpu,
        "cpu_ratio": _ratio(last_cpu, first_cpu),
        "first_cpu_s_per_version_by_process": _cpu_by_process(samples, first_versions, "version", "cpu_s_by_process"),
        "last_cpu_s_per_version_by_process": _cpu_by_process(samples, last_versions, "version", "cpu_s_by_process"),
        "num_samples": len(samples),
        **(idle or {}),
    }
    if reference is not None:
        ref_seconds = np.array([c["seconds"] for c in reference[TRAINERS[0]]["committed"]], dtype=np.float64)
        ref_verified, ref_served, ref_problems = _verified(reference, window)
        ref_overhead = float(ref_seconds[:window].mean())
        ref_cpu = _cpu_per_version(samples, first_versions, "reference_version", "reference_cpu_s")
        out |= {"reference_versions": window,
                "reference_verified": ref_verified,
                "reference_served_checked_min": ref_served,
                "reference_problems": ref_problems,
                "reference_overhead_s": ref_overhead,
                "overhead_ratio_same_time": last_overhead / ref_overhead,
                "reference_cpu_s_per_version": ref_cpu,
                "cpu_ratio_same_time": _ratio(last_cpu, ref_cpu),
                "reference_cpu_s_per_version_by_process": _cpu_by_process(
                    samples, first_versions, "reference_version", "reference_cpu_s_by_process")}
    return out
