"""Which threads of a process hold its GIL, and for how long (benchmarks): py-spy samples the
process with ``--gil`` (a sample is kept only when a thread holds the GIL) at a known rate,
so each thread's samples over the rate are the seconds it held the GIL.

Why: an engine generates from its main thread while the runtime's threads (the agent, the
etcd client's loop, a transport's waits) run in the same interpreter. How much of the time
weights move those threads hold the GIL bounds what a refit can take from generation
through it (``testing.rl_run``'s ``gil``). py-spy is a separate program (``pip install
py-spy``, a static binary) that attaches with ptrace, which a container may refuse. Its
samples carry no time of their own (its Chrome trace merges a thread's equal stacks across
samples where it did not hold the GIL), so the split between refits and the rest is left
to the caller's windows.
"""

from __future__ import annotations

import re
import subprocess
import time

__all__ = ["GilSampler", "dump_stacks", "gil_seconds"]

_THREAD = re.compile(r"^thread \(\d+\): ([^;]*)")


class GilSampler:
    """``py-spy record --gil`` on ``pid`` at ``rate`` samples a second for up to
    ``duration_s`` (it ends with the process), started at once; :meth:`result` waits."""

    def __init__(self, pyspy: str, pid: int, out: str, *, duration_s: float = 600.0, rate: int = 200) -> None:
        if duration_s <= 0 or rate <= 0:
            raise ValueError(f"duration_s and rate must be > 0, got {duration_s}, {rate}")
        self.out, self.rate = out, rate
        self.started = time.time()
        self._proc = subprocess.Popen(
            [pyspy, "record", "--pid", str(pid), "--gil", "--threads", "--nonblocking", "--rate", str(rate),
             "--duration", str(max(1, round(duration_s))), "--format", "raw", "-o", out],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def result(self, timeout_s: float = 30.0) -> tuple[dict[str, float], str | None]:
        """(seconds each thread name held the GIL, None) or ({}, why there are none)."""
        try:
            _, err = self._proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, err = self._proc.communicate()
        try:
            with open(self.out) as fh:
                return gil_seconds(fh.read(), self.rate), None
        except OSError as exc:
            lines = (err or "").strip().splitlines()
            return {}, lines[-1] if lines else f"no samples: {exc}"


def gil_seconds(raw: str, rate: float) -> dict[str, float]:
    """Seconds per thread name in py-spy's raw output (``thread (tid): name;frame;... count``
    per line, with ``--threads``) sampled at ``rate`` a second."""
    out: dict[str, float] = {}
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        m = _THREAD.match(stack)
        if m is None or not count.isdigit():
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + int(count) / rate
    return out


def dump_stacks(pyspy: str, pid: int, out: str, *, timeout_s: float = 20.0) -> str | None:
    """Every thread's Python stack of process ``pid`` now (``py-spy dump``), written to
    ``out``: where a hung member waits. None once written, else why not (py-spy's last
    line: it could not attach, the process is gone, it timed out)."""
    try:
        done = subprocess.run([pyspy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"py-spy dump of {pid} timed out after {timeout_s} s"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout or "").strip().splitlines()
        return lines[-1] if lines else f"py-spy dump of {pid} exited {done.returncode}"
    with open(out, "w") as fh:
        fh.write(done.stdout)
    return None
