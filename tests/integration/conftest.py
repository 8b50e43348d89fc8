"""Fixtures for tests against a real etcd: servers, clients and member processes.

Every etcd and every member process started here is stopped by pid in teardown, and
teardown fails the test if one of them is still alive.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from elastic_refit.membership.client import EtcdClient

from elastic_refit.testing.agent import AgentProcess
from elastic_refit.testing.etcd import EtcdCluster, EtcdServer

REPO_ROOT = Path(__file__).resolve().parents[2]


def _pythonpath() -> str:
    """The caller's PYTHONPATH (a GPU machine's wheels live there), without the repository:
    the package is installed, and on the path the top-level ``kernels/`` folder would shadow
    the ``kernels`` package that transformers 5.25 imports when it is installed."""
    return os.environ.get("PYTHONPATH", "")


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


@pytest.fixture
def agents():
    """Factory of agent processes; all are stopped by pid and checked gone afterwards."""
    started: list[AgentProcess] = []

    def spawn(*args, **kwargs) -> AgentProcess:
        agent = AgentProcess(*args, **kwargs)
        started.append(agent)
        return agent

    yield spawn
    for agent in started:
        agent.stop(timeout_s=10)
    alive = [p for agent in started for p in agent.pids if _pid_alive(p)]
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
