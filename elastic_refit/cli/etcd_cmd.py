"""`elastic-refit etcd [--data-dir D] [--port P]`: a local etcd for development.

One etcd node on loopback, started with the settings the tests use (short raft timings,
bounded history), its endpoint and the variable to export printed on stdout; it runs until
Ctrl-C (or SIGTERM), then stops etcd by its pid and waits for it. Production etcd is
deploy/'s business (TLS, users, a cluster): this is for a first job on one machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LocalEtcd", "register", "run"]

ENDPOINT_VARIABLE = "ELASTIC_REFIT_ETCD"
DEFAULT_PORT = 2379


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "etcd", help="run a local etcd for development (Ctrl-C stops it)",
        description="Run one etcd node on 127.0.0.1 for a local job: prints its endpoint and the variable "
                    f"to export ({ENDPOINT_VARIABLE}), then serves until Ctrl-C or SIGTERM, which stop it "
                    "cleanly. Needs the etcd binary (apt-get install etcd-server, or $ETCD_BIN).")
    parser.add_argument("--data-dir", default=None,
                        help="keep etcd's data in this folder (DIR/etcd; its log in DIR/etcd.log) across runs "
                             "(default: a temporary folder, removed when it stops)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"client port on 127.0.0.1 (default {DEFAULT_PORT}; 0 picks a free one)")
    parser.add_argument("--history", default="5m",
                        help="etcd history kept before compaction, as etcd's periodic retention (default 5m: "
                             "deploy/README.md, compaction)")
    parser.set_defaults(handler=run)


@dataclass(frozen=True, slots=True)
class LocalEtcd:
    """Where a local etcd listens and keeps its files."""

    client_port: int
    peer_port: int
    root: str  # our folder: etcd's data in root/etcd, its log in root/etcd.log
    history: str = "5m"

    def __post_init__(self) -> None:
        for label, port in (("client port", self.client_port), ("peer port", self.peer_port)):
            if not 0 < port < 65536:
                raise ValueError(f"the {label} must be in 1..65535, got {port}")
        if self.client_port == self.peer_port:
            raise ValueError(f"the client and peer ports must differ, got {self.client_port} twice")
        if not self.history or not self.history[0].isdigit():
            raise ValueError(f"--history must be an etcd retention such as 5m or 1h, got {self.history!r}")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def log_path(self) -> Path:
        return Path(self.root) / "etcd.log"

    def command(self, binary: str) -> list[str]:
        """etcd's command line: one node, loopback only, history bounded as in production."""
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        return [binary, "--name", "local", "--data-dir", str(Path(self.root) / "etcd"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"local={peer}", "--initial-cluster-state", "new",
                "--heartbeat-interval", "50", "--election-timeout", "500",
                "--auto-compaction-mode", "periodic", "--auto-compaction-retention", self.history,
                "--log-level", "warn", "--logger", "zap"]


def _port_in_use(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _log_tail(path: Path, num_bytes: int = 1500) -> str:
    try:
        return path.read_bytes()[-num_bytes:].decode(errors="replace").strip() or "(empty log)"
    except OSError:
        return "(no log)"


def _wait_healthy(proc: subprocess.Popen, etcd: LocalEtcd, timeout_s: float = 20.0) -> None:
    """Until etcd answers /health; ``RuntimeError`` with its log when it exits or never answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"etcd exited with status {proc.returncode}: {_log_tail(etcd.log_path)}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"http://{etcd.endpoint}/health",
                                                                  timeout=1.0) as resp:
            if b'"health":"true"' in resp.read().replace(b" ", b""):
                return
        time.sleep(0.05)
    raise RuntimeError(f"etcd at {etcd.endpoint} not healthy after {timeout_s:.0f} s: {_log_tail(etcd.log_path)}")


def _stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout_s)


def _local_etcd(args: argparse.Namespace) -> tuple[LocalEtcd, bool]:
    """The LocalEtcd the arguments describe, and whether its folder is ours to remove."""
    from elastic_refit.testing.etcd import free_ports

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.port and _port_in_use(args.port):
        raise ValueError(f"port {args.port} on 127.0.0.1 is in use (another etcd?); --port 0 picks a free one")
    ports = [p for p in free_ports(3) if p != args.port]
    client = args.port or ports.pop()
    temporary = args.data_dir is None
    root = tempfile.mkdtemp(prefix="elastic-refit-etcd-") if temporary else os.path.abspath(args.data_dir)
    if not temporary:
        if Path(root).exists() and not Path(root).is_dir():
            raise ValueError(f"--data-dir {args.data_dir!r} is not a folder")
        Path(root).mkdir(parents=True, exist_ok=True)
    return LocalEtcd(client, ports.pop(), root, args.history), temporary


def run(args: argparse.Namespace) -> int:
    """Start etcd, print where it is, serve until Ctrl-C or SIGTERM, stop it."""
    from elastic_refit.testing.etcd import find_etcd_binary

    binary = find_etcd_binary()
    etcd, temporary = _local_etcd(args)
    # Started with `&` from a script, a process inherits SIGINT ignored: Ctrl-C / kill -INT
    # must still stop etcd cleanly.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        with open(etcd.log_path, "ab") as log:
            # A session of its own: Ctrl-C in the terminal reaches us only, and we stop etcd.
            proc = subprocess.Popen(etcd.command(binary), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            _wait_healthy(proc, etcd)
            kept = "removed when it stops" if temporary else "kept"
            print(f"etcd serving at {etcd.endpoint} (pid {proc.pid}; data in {etcd.root}, {kept}; "
                  f"log {etcd.log_path})")
            print("in the shells of your job's processes:")
            print(f"  export {ENDPOINT_VARIABLE}={etcd.endpoint}")
            print("Ctrl-C stops it.", flush=True)
            status = proc.wait()
            raise RuntimeError(f"etcd exited on its own with status {status}: {_log_tail(etcd.log_path)}")
        except KeyboardInterrupt:
            _stop(proc)
            print(f"etcd at {etcd.endpoint} stopped", file=sys.stderr, flush=True)
            return 0
        finally:
            _stop(proc)
    finally:
        if temporary:
            shutil.rmtree(etcd.root, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
