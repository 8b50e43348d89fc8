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


REPO_ROOT = Path(__file__).resolve().parents[2]


def readme_quickstart() -> list[str]:
    """The commands of README's quickstart block, as written."""
    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("## Quickstart"):]
    block = section[section.index("```\n") + 4:]
    return [line for line in block[:block.index("```")].splitlines() if line.strip()]


def test_readme_quickstart_runs_as_written(tmp_path):
    """README's quickstart, line by line in one shell (the install line aside: this checkout is
    installed already; etcd's port made free for the test), then its output checked."""
    from elastic_refit.testing.etcd import free_ports

    commands = readme_quickstart()
    assert commands[0].startswith("pip install -e") and "[examples]" in commands[0]
    assert any(c.startswith("elastic-refit etcd") for c in commands)
    assert any(c.startswith("python examples/hf_quickstart.py") for c in commands)
    assert any(c.startswith("elastic-refit status") for c in commands)
    port = str(free_ports(1)[0])
    bin_dir = Path(sys.executable).parent
    script = "set -e\n" + "\n".join(c.replace("2379", port) for c in commands[1:]) + "\nwait\n"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env=env)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert f"export ELASTIC_REFIT_ETCD=127.0.0.1:{port}" in out
    assert "every engine's weights equal the trainer's bit for bit" in out
    assert "job first-job" in out and "latest committed 3" in out, out
    assert f"etcd at 127.0.0.1:{port} stopped" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
