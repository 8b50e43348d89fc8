"""What a chaos run holds across its trials: warm worker processes, its etcd, CPU burners,
and the helpers that tell a trial's leftover processes from those.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic_refit.chaos.inject import Killer
from elastic_refit.chaos.worker import worker_main

from elastic_refit.testing.processes import pid_alive

__all__ = ["RunEtcd", "Worker", "WorkerPool", "burn", "children_of", "is_mp_helper"]


@dataclass
class Worker:
    """One warm worker process and the parent's end of its pipe."""

    proc: Any
    conn: Any
    pid: int
    task: tuple[str, int] | None = None  # (member_id, life) it runs now
    ready: bool = False  # it said "ready": torch and the runtime are imported


class WorkerPool:
    """Warm worker processes; keeps ``spares`` idle ones ready for restarts, so a victim's
    new incarnation starts at once (inside its old lease's TTL), not after an import."""

    def __init__(self, killer: Killer, spares: int = 2, gpu: bool = False) -> None:
        self.ctx = mp.get_context("spawn")
        self.killer = killer
        self.spares = spares
        self.gpu = gpu
        self.workers: list[Worker] = []
        self.started_pids: list[int] = []

    def _spawn(self) -> Worker:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=worker_main, args=(child, self.gpu), daemon=True, name="chaos-worker")
        proc.start()
        child.close()
        w = Worker(proc, parent, proc.pid)
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
            if w.ready:
                continue
            left = max(0.1, deadline - time.monotonic())
            if not w.conn.poll(left):
                raise RuntimeError(f"chaos worker {w.pid} not ready within {timeout_s} s")
            _kind, _ = w.conn.recv()
            w.ready = True

    def acquire(self) -> Worker:
        for w in self.workers:
            if w.task is None and w.ready and w.proc.is_alive():
                return w
        self.ensure(1)
        return self.acquire()

    def drop(self, w: Worker) -> None:
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


class RunEtcd:
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

    def stall(self, down_s: float, then: Callable[[], None]) -> threading.Thread:
        """SIGSTOP every node, call ``then``, SIGCONT them after ``down_s``."""

        def run() -> None:
            pids = list(self.cluster.pids)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                then()
                time.sleep(down_s)
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)

        t = threading.Thread(target=run, name="etcd-stall", daemon=True)
        t.start()
        return t

    def wipe(self, down_s: float, then: Callable[[], None]) -> threading.Thread:
        """SIGKILL every node, call ``then``, after ``down_s`` start them again empty."""

        def run() -> None:
            for index in range(self.cluster.size):
                self.cluster.stop_node(index, signal.SIGKILL)
            then()
            time.sleep(down_s)
            self.cluster.wipe()

        t = threading.Thread(target=run, name="etcd-wipe", daemon=True)
        t.start()
        return t

    @property
    def pids(self) -> set[int]:
        return set(self.cluster.pids)

    def stop(self) -> None:
        self.cluster.stop()


def children_of(pids: set[int]) -> list[int]:
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


def is_mp_helper(pid: int) -> bool:
    """multiprocessing's resource tracker (started by spawn) or fork server (started by the
    harness's local worlds, elastic_refit.testing.processes), identified by their pids."""
    with contextlib.suppress(Exception):
        from multiprocessing import forkserver, resource_tracker

        return pid in (resource_tracker._resource_tracker._pid, forkserver._forkserver._forkserver_pid)
    return False


def burn() -> None:
    """A CPU burner: spin until terminated."""
    while True:
        pass
