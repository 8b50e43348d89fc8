"""Soak: many versions through one real job, to show that nothing grows with the number of
steps (``elastic-refit bench soak``).

A real etcd, 2 trainer replicas and 4 inference ranks (2 x TP=2) as processes, tiny tensors,
trainers publishing back to back. Every version commits only once every inference rank
acked it with verified digests, and each inference rank checks every version it serves
byte for byte. While the job runs, a sampler reads the job's etcd key count, etcd's db size,
every member's resident memory and the CPU time of the members and etcd. The per-version
overhead is a trainer's publish -> commit seconds (there is no training step in between);
the CPU seconds per version, first window against last, tell a runtime that does more work
per version from a shared machine that got slower, and a fixed calibration workload timed at
each sample (its CPU seconds) says how much slower the machine itself got. After the last version the members
stay in the job, idle, for ``idle_s``: the etcd requests they make meanwhile (etcd's own
gRPC counters, the sampler paused) are what an idle member costs etcd. Those counters also
give the etcd requests of the whole run per version (start-up and the sampler included).
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
from elastic_refit.testing.processes import apply_environ, fork_server_context

TRAINERS = ("t0", "t1")
INFERENCE = ("i0", "i1", "i2", "i3")


@dataclass(frozen=True, slots=True)
class SoakConfig:
    """``num_versions`` versions; overheads are the means of the first and the last
    ``window`` versions (at most half of them each)."""

    num_versions: int = 20_000
    window: int = 1_000
    sample_s: float = 1.0
    idle_s: float = 10.0
    timeout_s: float = 7_200.0

    def __post_init__(self) -> None:
        require_at_least("--versions", self.num_versions, 20, "two windows of 10 at least")
        require_at_least("--window", self.window, 10)
        if not 0 < self.sample_s < self.timeout_s:
            raise ValueError(f"sample_s must be in (0, timeout_s), got {self.sample_s}")
        if not 0 <= self.idle_s < self.timeout_s:
            raise ValueError(f"idle_s must be in [0, timeout_s), got {self.idle_s}")


def _member_main(member: MemberSpec, results, environ: dict[str, str], release) -> None:
    apply_environ(environ)
    try:
        # Stay in the job after the last version until the idle window was measured.
        results.put(run_member(member, hold=lambda _refit: _until_released(release)))
    except BaseException as exc:  # reported; the bench fails with it
        results.put({"member_id": member.member_id, "error": f"{type(exc).__name__}: {exc}"})


def _until_released(release, timeout_s: float = 3_600.0) -> None:
    # Polled, not release.wait(): a multiprocessing Event's set() waits for every sleeper to
    # wake, and one that died asleep would block the parent's set() forever.
    deadline = time.monotonic() + timeout_s
    while not release.is_set() and time.monotonic() < deadline:
        time.sleep(0.1)


def _rss_bytes(pid: int) -> int | None:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of process ``pid`` so far."""
    with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()  # past "pid (comm)": utime, stime are 14, 15
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return None


def calibration_cpu_seconds(num_steps: int = 200_000) -> float:
    """CPU seconds of this thread for a fixed piece of pure-Python work (~15 ms here): the
    same work each time, so its cost moves only with the machine's speed (a shared host's
    frequency and caches), not with how busy the cores are."""
    start = time.thread_time()
    total = 0
    for i in range(num_steps):
        total += i * i
    return time.thread_time() - start


def etcd_requests(endpoint: str) -> dict[str, float]:
    """etcd's count of gRPC messages received so far, by method (unary requests and stream
    messages such as lease keepalives and watch progress requests), from its metrics."""
    import urllib.request

    url = endpoint if "://" in endpoint else f"http://{endpoint}"  # the soak's etcd is plain http
    with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("grpc_server_msg_received_total{"):
            labels, value = line.rsplit(" ", 1)
            method = labels.split('grpc_method="', 1)[1].split('"', 1)[0]
            out[method] = out.get(method, 0.0) + float(value)
    return out


def run_soak(config: SoakConfig, progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Run the soak; returns the figures (see ``elastic-refit bench soak --help``)."""
    from elastic_refit.chaos.runner import spec_json  # the chaos trials' tiny model

    versions = tuple(range(1, config.num_versions + 1))
    job = f"soak-{uuid.uuid4().hex[:6]}"
    ctx = fork_server_context()
    results = ctx.Queue()
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    paused = threading.Event()  # the sampler's own requests stay out of the idle window
    release = ctx.Event()
    idle: dict[str, Any] = {}
    requests: dict[str, float] = {}  # etcd's gRPC messages received: before the members, after the last version
    with EtcdServer(name="soak") as etcd:
        endpoints = tuple(etcd.endpoints)
        requests["start"] = sum(etcd_requests(endpoints[0]).values())
        spec = spec_json(len(INFERENCE))
        procs: dict[str, Any] = {}
        for rank, member_id in enumerate(TRAINERS + INFERENCE):
            role = "trainer" if member_id in TRAINERS else "inference"
            member = MemberSpec(job, role, member_id, rank, endpoints, f"d-{role}", spec_json=spec, versions=versions,
                                start_with=TRAINERS + INFERENCE if role == "trainer" else (),
                                config={"version_timeout_s": 600.0}, record_window=_window(config))
            proc = ctx.Process(target=_member_main, args=(member, results, dict(os.environ), release), daemon=True)
            proc.start()
            procs[member_id] = proc
        client = EtcdClient(list(endpoints))
        store = VersionStore(client, job)
        prefix = JobKeys(job).prefix

        sampler_failed: list[BaseException] = []

        def sample() -> None:
            last_said = 0.0
            while not stop.wait(config.sample_s):
                if paused.is_set():
                    continue
                try:
                    latest = store.snapshot().latest_committed or 0
                    rss = {m: _rss_bytes(p.pid) for m, p in procs.items() if p.pid is not None}
                    # The members' and etcd's CPU time: what a version costs, whatever else
                    # the (shared) machine runs meanwhile.
                    cpu = [_cpu_seconds(pid) for pid in [*(p.pid for p in procs.values()), *etcd.pids]]
                    samples.append({"t": time.monotonic(), "version": latest, "keys": client.count_prefix(prefix),
                                    "db_bytes": client.db_size(),
                                    "rss": {m: r for m, r in rss.items() if r is not None},
                                    "cpu_s": sum(c for c in cpu if c is not None),
                                    "calibration_s": calibration_cpu_seconds()})
                except (RefitError, OSError):
                    continue  # etcd busy for a moment: the next sample
                except Exception as exc:  # a bug here would leave the run without samples: fail it
                    sampler_failed.append(exc)
                    return
                if time.monotonic() - last_said > 10:
                    last_said = time.monotonic()
                    progress(f"version {latest}/{config.num_versions}, {samples[-1]['keys']} etcd keys")

        sampler = threading.Thread(target=sample, name="soak-sampler", daemon=True)
        sampler.start()
        reports: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + config.timeout_s
        try:
            while len(reports) < len(procs) and time.monotonic() < deadline:
                if sampler_failed:
                    raise RuntimeError(f"the soak's sampler failed: {sampler_failed[0]!r}") from sampler_failed[0]
                with contextlib.suppress(queue.Empty):
                    report = results.get(timeout=1.0)
                    reports[report["member_id"]] = report
                if not release.is_set() and (samples and samples[-1]["version"] >= config.num_versions):
                    requests["run"] = sum(etcd_requests(endpoints[0]).values())
                    idle.update(_measure_idle(endpoints[0], config.idle_s, paused, len(procs)))
                    release.set()
                if any(not p.is_alive() and m not in reports for m, p in procs.items()):
                    with contextlib.suppress(queue.Empty):  # a report may still be in the pipe
                        report = results.get(timeout=5.0)
                        reports[report["member_id"]] = report
                    dead = [m for m, p in procs.items() if not p.is_alive() and m not in reports]
                    if dead:
                        raise RuntimeError(f"members {dead} died without a report")
            final_keys = client.count_prefix(prefix)
        finally:
            release.set()
            stop.set()
            sampler.join(10)
            for p in procs.values():
                if p.is_alive():
                    p.kill()
                p.join(10)
            client.close()
    missing = sorted(set(procs) - set(reports))
    errors = {m: r["error"] for m, r in reports.items() if "error" in r}
    if missing or errors:
        raise RuntimeError(f"soak failed: members {missing} did not report; errors {errors}")
    figures = summarize(config, reports, samples, final_keys, idle)
    if "run" in requests:  # everything of the run (start-up, the sampler's reads) over its versions
        figures["etcd_requests_per_version"] = (requests["run"] - requests["start"]) / config.num_versions
    return figures


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


def _machine_speed(samples: list[dict[str, Any]], first: tuple[int, int], last: tuple[int, int],
                   overhead_ratio: float) -> dict[str, Any]:
    """How much slower the machine itself ran in the last window than in the first: the mean
    calibration CPU seconds of the samples taken in each (pure), and the overhead ratio
    divided by it (``None`` where a window has no calibrated sample)."""
    def mean(lo: int, hi: int) -> float | None:
        values = [s["calibration_s"] for s in samples if lo <= s["version"] <= hi and s.get("calibration_s")]
        return sum(values) / len(values) if values else None

    before, after = mean(*first), mean(*last)
    slowdown = after / before if before and after is not None else None
    return {"machine_slowdown": slowdown,
            "overhead_ratio_machine_adjusted": overhead_ratio / slowdown if slowdown else None}


def _cpu_per_version(samples: list[dict[str, Any]], first: tuple[int, int], last: tuple[int, int]) -> dict[str, Any]:
    """CPU seconds (members and etcd together) per version over the versions ``first`` and
    ``last`` (inclusive bounds), from the samples that bracket each range (pure). ``None``
    where no two samples bracket it."""
    points = [(s["version"], s["cpu_s"]) for s in samples if s.get("cpu_s") is not None]

    def rate(lo: int, hi: int) -> float | None:
        before = [p for p in points if p[0] <= lo]
        after = [p for p in points if p[0] >= hi]
        if not before or not after or after[0][0] <= before[-1][0]:
            return None
        (v0, c0), (v1, c1) = before[-1], after[0]
        return (c1 - c0) / (v1 - v0)

    first_rate, last_rate = rate(*first), rate(*last)
    return {"first_cpu_s_per_version": first_rate, "last_cpu_s_per_version": last_rate,
            "cpu_ratio": last_rate / first_rate if first_rate and last_rate is not None else None}


def _window(config: SoakConfig) -> int:
    return min(config.window, config.num_versions // 2)


def summarize(config: SoakConfig, reports: dict[str, dict[str, Any]], samples: list[dict[str, Any]],
              final_keys: int, idle: dict[str, Any] | None = None) -> dict[str, Any]:
    """The soak's figures from the members' reports (``CommitRecord.report`` fields, first
    and last ``window`` versions kept) and the sampler's readings (pure)."""
    window = _window(config)
    kept = reports[TRAINERS[0]]["committed"]
    seconds = np.array([c["seconds"] for c in kept], dtype=np.float64)
    # Every version committed as itself (a trainer blocks on each), verified by every rank's
    # digests before the commit, and checked byte for byte by every rank that served it.
    committed_as_published = all(
        reports[t]["num_committed"] == config.num_versions and reports[t]["committed_consecutive"]
        and reports[t]["committed_span"] == [1, config.num_versions] for t in TRAINERS)
    problems = sum(len(reports[i]["problems"]) for i in INFERENCE)
    served = min(reports[i]["num_committed"] for i in INFERENCE)
    warm = [s for s in samples if s["version"] >= window // 10]  # past start-up
    first, last = (warm[0], warm[-1]) if warm else ({"rss": {}}, {"rss": {}})
    first_overhead, last_overhead = float(seconds[:window].mean()), float(seconds[-window:].mean())
    # Version ranges of the two windows for the samplers' figures: the first one past start-up,
    # as the memory figures (joins and first plans aside).
    first_versions = (max(1, window // 10), window)
    last_versions = (config.num_versions - window + 1, config.num_versions)
    return {
        "versions": config.num_versions,
        "window": window,
        "verified": config.num_versions if committed_as_published and problems == 0 else 0,
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
        **_cpu_per_version(samples, first_versions, last_versions),
        **_machine_speed(samples, first_versions, last_versions, last_overhead / first_overhead),
        "num_samples": len(samples),
        **(idle or {}),
    }
