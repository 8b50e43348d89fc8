"""A new user's first job: `elastic-refit etcd`, README's quickstart commands, as written."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.etcd


@contextlib.contextmanager
def local_etcd(*args: str) -> Iterator[tuple[subprocess.Popen, str, int, list[str]]]:
    """`elastic-refit etcd ARGS` running; yields the process, the endpoint it printed, etcd's
    pid and its stdout lines; stops it (SIGTERM) if the test did not."""
    proc = subprocess.Popen([sys.executable, "-m", "elastic_refit.cli", "etcd", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 30
        while not any(line.startswith("Ctrl-C") for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, (lines, proc.poll())
            lines.append(proc.stdout.readline())
        endpoint = next(line.split("=", 1)[1].strip() for line in lines if "export ELASTIC_REFIT_ETCD=" in line)
        etcd_pid = int(re.search(r"\(pid (\d+)", lines[0]).group(1))
        yield proc, endpoint, etcd_pid, lines
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    return True


def test_etcd_command_serves_until_ctrl_c_and_keeps_its_data(tmp_path):
    from elastic_refit.membership import EtcdClient

    data = tmp_path / "etcd-data"
    with local_etcd("--port", "0", "--data-dir", str(data)) as (proc, endpoint, etcd_pid, lines):
        assert re.fullmatch(r"127\.0\.0\.1:\d+", endpoint), lines
        assert "Ctrl-C stops it." in "".join(lines)
        with EtcdClient([endpoint]) as client:
            client.put("/quickstart/k", b"kept")
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert proc.wait(timeout=20) == 0
        err = proc.stderr.read()
        assert f"etcd at {endpoint} stopped" in err and "Traceback" not in err, err
    assert _gone(etcd_pid)
    assert (data / "etcd.log").is_file()
    with local_etcd("--port", "0", "--data-dir", str(data)) as (proc, endpoint, etcd_pid, _):
        with EtcdClient([endpoint]) as client:
            assert client.get("/quickstart/k").value == b"kept"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    assert _gone(etcd_pid)


def test_etcd_command_without_a_data_dir_removes_its_folder_and_refuses_a_busy_port():
    with local_etcd("--port", "0") as (proc, endpoint, etcd_pid, lines):
        folder = re.search(r"data in (\S+),", lines[0]).group(1)
        assert Path(folder).is_dir()
        port = endpoint.rsplit(":", 1)[1]
        busy = subprocess.run([sys.executable, "-m", "elastic_refit.cli", "etcd", "--port", port],
                              capture_output=True, text=True, timeout=60)
        assert busy.returncode == 2 and busy.stdout == ""
        assert busy.stderr.startswith(f"elastic-refit: error: port {port} on 127.0.0.1 is in use"), busy.stderr
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    assert _gone(etcd_pid) and not Path(folder).exists()
