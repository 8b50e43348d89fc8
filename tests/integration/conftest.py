"""Fixtures for tests against a real etcd: servers, clients and member processes.

Every etcd and every member process started here is stopped by pid in teardown, and
teardown fails the test if one of them is still alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from elastic_refit.membership.client import EtcdClient

from elastic_refit.testing.etcd import EtcdCluster, EtcdServer

REPO_ROOT = Path(__file__).resolve().parents[2]


def _pythonpath() -> str:
    """The repository first, then whatever the caller had (a GPU machine's wheels live there)."""
    return os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes once reaped.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture
def etcd_server():
    """A fresh single-node etcd on free loopback ports (data in /dev/shm)."""
    server = EtcdServer(name="test")
    server.start()
    try:
        yield server
    finally:
        pids = server.pids
        root = server.root
        server.stop()
        assert not any(_pid_alive(p) for p in pids), f"etcd pids {pids} survived stop()"
        assert not os.path.exists(root), f"etcd data dir {root} left behind"


@pytest.fixture
def etcd_cluster():
    """A fresh 3-node etcd cluster on loopback."""
    cluster = EtcdCluster(3, name="test3")
    cluster.start()
    try:
        yield cluster
    finally:
        pids = [n.pid for n in cluster.nodes if n.pid]
        cluster.stop()
        assert not any(_pid_alive(p) for p in pids), f"etcd pids {pids} survived stop()"


@pytest.fixture
def make_client():
    clients: list[EtcdClient] = []

    def make(endpoints, **options) -> EtcdClient:
        c = EtcdClient(list(endpoints), **options)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def job() -> str:
    return "job-" + uuid.uuid4().hex[:8]


class Agent:
    """One ``python -m elastic_refit.testing.agent`` process with its JSON events collected."""

    def __init__(self, endpoints, job: str, member_id: str, *, role: str = "trainer",
                 ttl: int = 2, comm: str = "none", candidate: bool = True):
        self.member_id = member_id
        self.args = [sys.executable, "-m", "elastic_refit.testing.agent", "--endpoints", ",".join(endpoints),
                     "--job", job, "--role", role, "--member-id", member_id, "--ttl", str(ttl),
                     "--comm", comm]
        if not candidate:
            self.args.append("--no-candidate")
        self.events: list[dict] = []
        self._new = threading.Condition()
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=_pythonpath(), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     cwd=REPO_ROOT, env=env, start_new_session=True)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            try:
                event = json.loads(line)
            except ValueError:
                event = {"event": "raw", "line": line.decode(errors="replace").rstrip()}
            event["_t"] = time.time()
            event["_pid"] = proc.pid
            with self._new:
                self.events.append(event)
                self._new.notify_all()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_event(self, predicate: Callable[[dict], bool], timeout_s: float = 15.0,
                   since: float = 0.0) -> dict:
        deadline = time.monotonic() + timeout_s
        with self._new:
            while True:
                for e in self.events:
                    if e["_t"] >= since and predicate(e):
                        return e
                left = deadline - time.monotonic()
                if left <= 0:
                    tail = "\n".join(json.dumps(e)[:300] for e in self.events[-15:])
                    raise AssertionError(f"agent {self.member_id}: event not seen in "
                                         f"{timeout_s}s; last events:\n{tail}")
                self._new.wait(left)

    def find(self, name: str, **fields) -> list[dict]:
        with self._new:
            return [e for e in self.events if e.get("event") == name
                    and all(e.get(k) == v for k, v in fields.items())]

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM (clean leave) and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                os.kill(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def agents():
    """Factory of member processes; all are stopped by pid and checked gone afterwards."""
    started: list[Agent] = []
    pids: list[int] = []

    def spawn(*args, **kwargs) -> Agent:
        a = Agent(*args, **kwargs)
        started.append(a)
        pids.append(a.pid)
        orig_start = a.start

        def start_again() -> None:
            orig_start()
            pids.append(a.pid)

        a.start = start_again  # type: ignore[method-assign]
        return a

    yield spawn
    for a in started:
        if a.proc is not None and a.proc.poll() is None:
            try:
                a.stop(timeout_s=10)
            except subprocess.TimeoutExpired:
                a.kill()
    alive = [p for p in pids if _pid_alive(p)]
    assert not alive, f"member processes {alive} left behind"


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, interval: float = 0.02):
    """Poll ``predicate`` until truthy; AssertionError naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
