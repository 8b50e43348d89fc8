"""`elastic-refit status` against a real etcd: a live job's members, leader, epoch and
committed versions, as a table and as JSON."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from elastic_refit.cli import main
from elastic_refit.cli.status_cmd import job_status
from elastic_refit.testing.job import MemberSpec

from .runtime_job import LocalJob
from .test_runtime import SPEC

pytestmark = pytest.mark.etcd


def _member(etcd: str, role: str, member_id: str, rank: int, **kw) -> MemberSpec:
    return MemberSpec("job", role, member_id, rank, (etcd,), "d0" if role == "trainer" else "d1",
                      spec_json=SPEC, **{"versions": (1, 2), **kw})


def test_status_of_a_running_job(etcd_server, capsys):
    etcd = etcd_server.endpoint
    job = LocalJob()
    try:
        # Trainers publish two versions; inference ranks stay until we stop them, so the
        # job is alive while status reads it.
        for m in (_member(etcd, "trainer", "t0", 0), _member(etcd, "trainer", "t1", 1),
                  _member(etcd, "inference", "i0", 2, incarnation="i0-a"),
                  _member(etcd, "inference", "i1", 3, incarnation="i1-a", versions=(1, 2, 3))):
            job.start(m)
        deadline = time.monotonic() + 60
        while True:
            try:
                data = job_status([etcd], "job")
            except ValueError:  # nothing of the job in etcd yet
                data = {"latest_committed": None}
            if data["latest_committed"] == 2:
                break
            assert time.monotonic() < deadline, f"version 2 never committed: {data}"
            time.sleep(0.2)
        reports = job.collect(["t0", "t1", "i0"], timeout_s=60)  # i0 exits after v2; i1 waits for v3
        assert all("error" not in r for r in reports.values()), reports
        deadline = time.monotonic() + 15
        while True:  # the finished members left (leases revoked); a new epoch names i1 only
            data = job_status([etcd], "job")
            if data["epoch_members"] == ["i1"]:
                break
            assert time.monotonic() < deadline, f"epoch never settled: {data}"
            time.sleep(0.2)

        assert [m["member_id"] for m in data["members"]["inference"]] == ["i1"]
        assert data["members"]["trainer"] == []
        i1 = data["members"]["inference"][0]
        assert (i1["incarnation"], i1["layout_rank"], i1["domain"], i1["state"], i1["rank"]) == ("i1-a", 3, "d1",
                                                                                                 "ready", 0)
        assert (i1["serving"], i1["lag"]) == (2, 0)  # what it serves, verified, and how far behind
        assert len(i1["layout"]) == 32  # the fingerprint of the layout i1 described its side with
        assert data["leader"]["member_id"] == "i1" and data["leader"]["token"] > 0
        assert [c["version"] for c in data["committed"]] == [2, 1]
        assert data["committed"][0]["epoch"] >= data["committed"][1]["epoch"]
        assert {a["member_id"] for a in data["latest_acks"]} == {"i0", "i1"}
        assert all(len(a["digest"]) == 32 for a in data["latest_acks"])

        # As a user runs it: its stdout is the JSON object alone (this process's stdout may
        # also carry log lines of other threads).
        proc = subprocess.run([sys.executable, "-m", "elastic_refit.cli", "status", "--etcd", etcd, "--job", "job",
                               "--json"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        printed = json.loads(proc.stdout)
        assert printed["latest_committed"] == 2 and printed["epoch"] == data["epoch"]
        assert main(["status", "--etcd", etcd, "--job", "job"]) == 0
        table = capsys.readouterr().out
        assert "inference ranks (1)" in table and "i1-a" in table and "v2" in table and "acks of v2" in table
        assert i1["layout"][:12] in table
        assert "serving" in table and "rank in epoch" in table
    finally:
        job.stop()


def test_status_of_an_unknown_job_is_one_error_line_and_exit_2(etcd_server, capsys):
    """It printed empty tables and exited 0, as if the job existed and had nobody."""
    with pytest.raises(ValueError, match="no job 'nobody'"):
        job_status([etcd_server.endpoint], "nobody")
    assert main(["status", "--etcd", etcd_server.endpoint, "--job", "nobody"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"elastic-refit: error: no job 'nobody' in the etcd at {etcd_server.endpoint}"), err


def test_status_rejects_bad_input(etcd_server, capsys):
    assert main(["status", "--etcd", etcd_server.endpoint, "--job", "bad/name"]) == 2
    assert "job must match" in capsys.readouterr().err


@pytest.mark.parametrize("json_flag", [["--json"], []], ids=["json", "table"])
def test_status_of_an_unreachable_etcd_is_one_line_and_exit_1(capsys, json_flag):
    """A runtime fault (no etcd at the endpoint): one line naming the endpoint, exit 1,
    nothing on stdout (logs, if any, go to stderr)."""
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["status", "--etcd", f"127.0.0.1:{port}", "--job", "job", *json_flag]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    errors = [line for line in err.splitlines() if line.startswith("elastic-refit: error: ")]
    assert len(errors) == 1 and f"etcd unreachable at 127.0.0.1:{port}" in errors[0], err
    assert "Traceback" not in err


def test_status_watch_redraws_in_place_until_ctrl_c(etcd_server):
    """--watch redraws the table (cursor home, clear) until Ctrl-C, then exits 0."""
    import signal

    from elastic_refit.membership import EtcdClient, JobKeys

    with EtcdClient([etcd_server.endpoint]) as client:  # the job exists once anything is under its prefix
        client.put(JobKeys("watched").prefix + "run", b"{}")
    proc = subprocess.Popen([sys.executable, "-m", "elastic_refit.cli", "status", "--etcd", etcd_server.endpoint,
                             "--job", "watched", "--watch", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    # Read as it draws; Ctrl-C once two tables are out (start-up takes seconds on 2 cores).
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    while "".join(seen).count("job watched") < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    reader.join(10)  # stdout's reader ends at EOF; stderr (a few lines) is read once it exited
    out, err = "".join(seen), proc.stderr.read()
    assert proc.returncode == 0, err[-2000:]
    assert out.count("\x1b[H\x1b[J") >= 2 and out.count("job watched") >= 2, out[-2000:]
    assert "Traceback" not in err
    assert main(["status", "--etcd", etcd_server.endpoint, "--job", "watched", "--watch", "0"]) == 2
