"""Trainers and inference ranks as Ray actors (deploy/ray/refit_actors.py) refit every
version bit-exactly, and a trainer killed mid-refit is restarted by Ray as a new incarnation
of the same member while the job goes on.

A local Ray cluster (started once for the module, few resources, logs in a temp dir), a
real etcd, 2 Megatron-style tp=2 trainers and 2 vLLM-style tp=2 inference ranks.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from elastic_refit.membership import EtcdClient, JobKeys
from elastic_refit.membership.versions import VersionStore

from elastic_refit.testing.etcd import EtcdServer

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.etcd, pytest.mark.timeout(240)]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "ray"
VERSIONS = 5
CRASH_AT = 3  # trainer-1 is SIGKILLed as it starts sending version 3
# Leases a little longer than the 2 s default: four actors and Ray itself on two cores.
TIMEOUTS = {"ttl_s": 4, "collective_timeout_s": 3.0, "epoch_deadline_s": 20.0}


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): tells a pid from a reused one.
    None once it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _descendants(root: int) -> dict[int, str]:
    """pid -> start time of every live descendant of ``root``."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parent[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in found:
                started = _start_time(child)
                if started is not None:
                    found[child] = started
                    frontier.append(child)
    return found


def _alive(processes: dict[int, str]) -> dict[int, str]:
    return {pid: started for pid, started in processes.items() if _start_time(pid) == started}


def _wait_gone(processes: dict[int, str], timeout_s: float) -> dict[int, str]:
    deadline = time.monotonic() + timeout_s
    while (left := _alive(processes)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _worker_logs(temp_dir: str, lines: int = 15) -> str:
    """The last lines of every actor's stderr (its JSON events), for a failure message."""
    out = []
    for path in sorted(Path(temp_dir).glob("session_*/logs/worker-*.err")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        if tail:
            out.append(f"--- {path.name}\n" + "\n".join(tail))
    return "\n".join(out)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


@pytest.fixture(scope="module")
def etcd():
    server = EtcdServer(name="actors")
    server.start()
    pids = {pid: _start_time(pid) for pid in server.pids}
    try:
        yield server
    finally:
        server.stop()
        left = _wait_gone(pids, 10)
        assert not left, f"etcd {sorted(left)} survived stop()"
        assert not os.path.exists(server.root), f"etcd data dir {server.root} left behind"


class Cluster:
    def __init__(self, temp_dir: str) -> None:
        self.temp_dir = temp_dir
        self.processes: dict[int, str] = {}  # pid -> start time; the test adds its actors'


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of our own; shut down by the API, and none of its processes left."""
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths live here
    before = set(_descendants(os.getpid()))
    with pytest.MonkeyPatch.context() as env:
        # Workers import refit_actors by name (they inherit the raylet's environment, ours).
        env.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(DEPLOY), os.environ.get("PYTHONPATH")) if p))
        env.syspath_prepend(str(DEPLOY))
        # Token auth, as a local Ray 2.60 cluster has by default, but from a token of our own
        # rather than one Ray writes into ~/.ray/auth_token. RAY_AUTH_MODE stays unset: Ray
        # sets it (to "token") itself, and only then rereads its config (read at import).
        env.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
        env.delenv("RAY_AUTH_MODE", raising=False)  # restored to what it was on exit
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        cluster = Cluster(temp_dir)
        ray_started = False
        try:
            started = time.monotonic()
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir,
                     object_store_memory=96 << 20)
            ray_started = True
            print(f"ray.init: {time.monotonic() - started:.1f} s", file=sys.stderr)
            yield cluster
        finally:
            # Ray's processes: gcs_server, raylet, dashboard, agents, monitors, workers (ray::...).
            found = {pid: t for pid, t in _descendants(os.getpid()).items()
                     if pid not in before and "ray" in _cmdline(pid).lower()}
            cluster.processes.update(found)
            names = [_cmdline(pid) for pid in found]
            started = time.monotonic()
            ray.shutdown()
            left = _wait_gone(cluster.processes, 20)
            print(f"ray.shutdown: {time.monotonic() - started:.1f} s", file=sys.stderr)
            shutil.rmtree(temp_dir, ignore_errors=True)
            assert not left, "Ray processes survived ray.shutdown(): " + "; ".join(
                f"{pid} {_cmdline(pid)}" for pid in sorted(left))
            if ray_started:  # the scan sees Ray's processes (else the check above proves nothing)
                assert any("raylet" in name for name in names), names


def test_ray_actors_refit_every_version_through_a_trainer_restart(ray_cluster, etcd):
    import refit_actors as ra

    job = f"ray-{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    trainers, inference = ra.start_members(job, etcd.endpoint, trainers=2, inference=2, **TIMEOUTS)
    actors = trainers + inference
    processes = ray_cluster.processes
    try:
        before = {s["member_id"]: s for s in ray.get([a.status.remote() for a in actors], timeout=90)}
        processes.update({s["pid"]: _start_time(s["pid"]) for s in before.values()})
        print(f"actors up: {time.monotonic() - started:.1f} s", file=sys.stderr)
        records = ra.run_steps(trainers, inference, VERSIONS, crash=(trainers[1], CRASH_AT), timeout_s=90)
        after = {s["member_id"]: s for s in ray.get([a.status.remote() for a in actors], timeout=30)}
        processes.update({s["pid"]: _start_time(s["pid"]) for s in after.values()})
        closed = ra.stop_members(actors)
    except Exception as exc:  # the actors' own view of what went wrong
        raise AssertionError(f"{exc!r}\n{_worker_logs(ray_cluster.temp_dir)}") from exc
    print(f"job ({VERSIONS} versions, one restart): {time.monotonic() - started:.1f} s", file=sys.stderr)

    # Every version committed (each trainer's step returned its commit) and every inference
    # rank served exactly that version, every byte as published.
    assert [r["version"] for r in records] == list(range(1, VERSIONS + 1))
    for r in records:
        assert [(s["member_id"], s["version"]) for s in r["steps"]] == [
            ("trainer-0", r["version"]), ("trainer-1", r["version"])], r
        assert [(c["member_id"], c["version"], c["problems"]) for c in r["checks"]] == [
            ("inference-0", r["version"], []), ("inference-1", r["version"], [])], r
    with EtcdClient(etcd.endpoints) as client:
        state = VersionStore(client, job).snapshot()
        members_left = client.get_prefix(JobKeys(job).members_prefix).kvs
    assert state.latest_committed == VERSIONS and not state.failed
    assert not members_left, "every actor left the job cleanly (its lease revoked)"

    # trainer-1 came back as a new process, a new incarnation of the same member; Ray retried
    # the step it had in flight on it, and the version it died in committed in a later epoch.
    old, new = before["trainer-1"], after["trainer-1"]
    assert new["member_id"] == old["member_id"] == "trainer-1"
    assert new["incarnation"] != old["incarnation"] and new["pid"] != old["pid"]
    assert new["restarted"] and not old["restarted"]
    assert _start_time(old["pid"]) != processes[old["pid"]], "the killed process is gone"
    incarnations = [r["steps"][1]["incarnation"] for r in records]
    assert incarnations == [old["incarnation"]] * (CRASH_AT - 1) + [new["incarnation"]] * (VERSIONS - CRASH_AT + 1)
    epochs = [r["steps"][0]["epoch"] for r in records]
    assert epochs[CRASH_AT - 1] > epochs[CRASH_AT - 2], epochs
    for member in ("trainer-0", "inference-0", "inference-1"):  # nobody else restarted
        assert (after[member]["incarnation"], after[member]["pid"], after[member]["restarted"]) == (
            before[member]["incarnation"], before[member]["pid"], False)
    assert [c["member_id"] for c in closed] == ["trainer-0", "trainer-1", "inference-0", "inference-1"]
    assert closed[1]["incarnation"] == new["incarnation"]
