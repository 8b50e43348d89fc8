"""Where a process's CPU goes while it runs: the host's busy fraction and this process's
threads, sampled on a timer (benchmarks; Linux ``/proc``).

Why: on one GPU shared by every rank (the device tool's machine), a refit's bytes cross
NCCL's socket transport, whose proxy threads copy them through the host, while generation
with Hugging Face ``generate`` is bound by its Python thread's launches. Whether a refit
slows generation through the host (cores, the GIL) or through the GPU is read from these
samples beside the refit windows (``testing.rl_run``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["CpuSampler", "host_jiffies", "thread_seconds"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def host_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores since boot (``/proc/stat``), None where unreadable."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def thread_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads so far, summed by name: a
    Python thread's name where it has one (``threading``), else the kernel's (``comm``:
    NCCL's and torch's native threads)."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                stat = fh.read()
        except OSError:  # the thread ended meanwhile
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        rest = stat[stat.rindex(")") + 2 :].split()
        name = names.get(int(tid), comm)
        out[name] = out.get(name, 0.0) + (int(rest[11]) + int(rest[12])) / _TICK  # utime, stime
    return out


class CpuSampler:
    """Every ``interval_s``, ``report(sample)`` with the interval's end ``t`` (time.time),
    its length ``seconds``, the host's busy fraction ``host_busy`` (0-1 of all cores),
    ``host_cores`` and, per thread name, the cores it used (``threads``: CPU seconds over
    the interval's seconds). A context manager; the thread is a daemon."""

    def __init__(self, report: Callable[[dict[str, Any]], None], interval_s: float = 0.1) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._report = report
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        # The clock is read after the counters: a read slowed by the GIL then counts its time
        # too (jiffies that accrue during it are not spread over a shorter interval).
        last_host, last_threads = host_jiffies(), thread_seconds()
        last_t = time.time()
        while not self._stop.wait(self._interval_s):
            host, threads = host_jiffies(), thread_seconds()
            t = time.time()
            seconds = t - last_t
            sample: dict[str, Any] = {"t": t, "seconds": seconds, "host_cores": os.cpu_count()}
            if host is not None and last_host is not None and host[1] > last_host[1]:
                sample["host_busy"] = (host[0] - last_host[0]) / (host[1] - last_host[1])
            sample["threads"] = {name: round((s - last_threads.get(name, 0.0)) / seconds, 3)
                                 for name, s in threads.items() if s > last_threads.get(name, 0.0)}
            self._report(sample)
            last_t, last_host, last_threads = t, host, threads
