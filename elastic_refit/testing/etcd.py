"""Start and stop real etcd servers on free loopback ports (tests, bench, demo).

``EtcdServer`` is one node; ``EtcdCluster`` is three (or any odd number of) nodes on
loopback forming one raft cluster. Data lives under /dev/shm (tmpfs: fsync is cheap, so
a 2-core machine keeps up) in a directory unique to the instance and removed on stop.
Processes are stopped by pid, never by name.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from elastic_refit.log import get_logger

__all__ = ["EtcdCluster", "EtcdServer", "EtcdServerError", "NodeSpec"]


class EtcdServerError(RuntimeError):
    """The etcd server binary is missing, or the server did not start or stop cleanly."""


_INSTALL_HINT = (
    "the `etcd` binary was not found on PATH (or at ETCD_BIN). Install it with "
    "`apt-get install -y etcd-server` (Debian/Ubuntu; `make etcd` does this) or point "
    "ETCD_BIN at an etcd v3.4+ binary."
)


def find_etcd_binary() -> str:
    """Path of the etcd binary (``$ETCD_BIN`` first, then PATH); clear error if absent."""
    explicit = os.environ.get("ETCD_BIN")
    if explicit:
        if os.access(explicit, os.X_OK):
            return explicit
        raise EtcdServerError(f"ETCD_BIN={explicit!r} is not an executable file; {_INSTALL_HINT}")
    found = shutil.which("etcd")
    if found is None:
        raise EtcdServerError(_INSTALL_HINT)
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (held open together while picked).

    Picked below the kernel's ephemeral range where there is room: a port handed out by
    ``bind(0)`` is an ephemeral one, which any process's outgoing connection (NCCL's
    sockets, gRPC channels of tests running beside this one) may take between the pick and
    the server's own bind; below that range only a listener that binds it explicitly can,
    and the random start keeps parallel pickers apart."""
    socks: list[socket.socket] = []
    try:
        low = _ephemeral_low()
        candidates = list(range(_FIXED_LOW, low)) if low - _FIXED_LOW >= 4 * count else []
        random.SystemRandom().shuffle(candidates)
        for port in candidates:
            if len(socks) == count:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < count:  # no room below the ephemeral range: the kernel's pick
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


_FIXED_LOW = 20000  # above the well-known and most registered service ports


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 if unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _shm_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """Ports and paths of one etcd node."""

    name: str
    client_port: int
    peer_port: int
    data_dir: str
    client_scheme: str = "http"  # "https" when clients connect over TLS

    def __post_init__(self) -> None:
        for label, port in (("client_port", self.client_port), ("peer_port", self.peer_port)):
            if not 0 < port < 65536:
                raise ValueError(f"{label} must be in 1..65535, got {port}")

    @property
    def client_url(self) -> str:
        return f"{self.client_scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"


class _Node:
    """One etcd process; restartable with the same ports and data."""

    def __init__(self, spec: NodeSpec, initial_cluster: str, cluster_token: str, binary: str,
                 log_path: str, extra_args: Sequence[str], compaction: tuple[str, str]):
        self.spec = spec
        self._initial_cluster = initial_cluster
        self._token = cluster_token
        self._binary = binary
        self._log_path = log_path
        self._extra = list(extra_args)
        self._compaction = compaction
        self.proc: subprocess.Popen | None = None
        self._started_once = False

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        s = self.spec
        args = [
            self._binary,
            "--name", s.name,
            "--data-dir", s.data_dir,
            "--listen-client-urls", s.client_url,
            "--advertise-client-urls", s.client_url,
            "--listen-peer-urls", s.peer_url,
            "--initial-advertise-peer-urls", s.peer_url,
            "--initial-cluster", self._initial_cluster,
            "--initial-cluster-token", self._token,
            "--initial-cluster-state", "new",
            # Short raft timings: loopback only, and leader loss must be noticed fast.
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            # As in production (deploy/README.md): bounded history, so a long job's db stays
            # bounded like its keys (VersionStore.prune).
            "--auto-compaction-mode", self._compaction[0],
            "--auto-compaction-retention", self._compaction[1],
            "--log-level", "warn",
            "--logger", "zap",
            *self._extra,
        ]
        log = open(self._log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        self._started_once = True

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)


class EtcdCluster:
    """``size`` etcd nodes on loopback, one raft cluster (``size=1``: a single node).

    Use as a context manager, or call :meth:`start` / :meth:`stop`. ``endpoints`` lists
    ``host:port`` of every node for :class:`membership.client.EtcdClient`. ``compaction``:
    etcd's auto-compaction ``(mode, retention)``, by default the last 10,000 revisions (etcd
    3.4 applies a revision retention every 5 minutes; ``("periodic", "10s")`` keeps ~10 s).
    """

    def __init__(self, size: int = 1, *, name: str = "er", extra_args: Sequence[str] = (),
                 startup_timeout_s: float = 20.0, tls: TlsFiles | None = None,
                 compaction: tuple[str, str] = ("revision", "10000")):
        if size < 1 or size % 2 == 0:
            raise ValueError(f"cluster size must be odd and >= 1, got {size}")
        if compaction[0] not in ("revision", "periodic") or not compaction[1]:
            raise ValueError(f"compaction must be ('revision' | 'periodic', retention), got {compaction!r}")
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        self.size = size
        self.tls = tls
        if tls is not None:  # clients connect over TLS (the peers stay on loopback http); users
            # authenticate with a password, not a client certificate (no --trusted-ca-file)
            extra_args = [*extra_args, "--cert-file", tls.server_cert, "--key-file", tls.server_key]
        self._binary = find_etcd_binary()
        self._startup_timeout_s = startup_timeout_s
        self.root = tempfile.mkdtemp(prefix=f"etcd-{name}-", dir=_shm_root())
        ports = free_ports(2 * size)
        self.specs = [
            NodeSpec(name=f"n{i}", client_port=ports[2 * i], peer_port=ports[2 * i + 1],
                     data_dir=os.path.join(self.root, f"n{i}.etcd"),
                     client_scheme="https" if tls is not None else "http")
            for i in range(size)
        ]
        initial = ",".join(f"{s.name}={s.peer_url}" for s in self.specs)
        token = os.path.basename(self.root)
        self.nodes = [
            _Node(s, initial, token, self._binary, os.path.join(self.root, f"{s.name}.log"),
                  extra_args, compaction)
            for s in self.specs
        ]
        self._log = get_logger(component="etcd-server")

    @property
    def endpoints(self) -> list[str]:
        return [s.endpoint for s in self.specs]

    @property
    def pids(self) -> list[int]:
        return [n.pid for n in self.nodes if n.running() and n.pid is not None]

    def start(self) -> EtcdCluster:
        """Start every node and wait until each serves requests."""
        t0 = time.monotonic()
        for node in self.nodes:
            node.start()
        for i in range(self.size):
            self.wait_ready(i)
        self._log.info("membership.etcd.started", nodes=self.size, endpoints=self.endpoints,
                       seconds=round(time.monotonic() - t0, 3), data_dir=self.root)
        return self

    def wait_ready(self, index: int, timeout_s: float | None = None) -> None:
        """Block until node ``index`` answers ``/health`` as healthy."""
        import ssl
        import urllib.request

        context = ssl.create_default_context(cafile=self.tls.ca) if self.tls is not None else None
        deadline = time.monotonic() + (timeout_s or self._startup_timeout_s)
        node = self.nodes[index]
        url = node.spec.client_url + "/health"
        last = ""
        while time.monotonic() < deadline:
            if node.proc is not None and node.proc.poll() is not None:
                raise EtcdServerError(
                    f"etcd node {node.spec.name} exited with {node.proc.returncode}; "
                    f"log: {self.log_tail(index)}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0, context=context) as resp:
                    body = resp.read().decode()
                    if '"health":"true"' in body.replace(" ", ""):
                        return
                    last = body
            except OSError as exc:
                last = str(exc)
            time.sleep(0.05)
        raise EtcdServerError(
            f"etcd node {node.spec.name} at {node.spec.endpoint} not healthy after "
            f"{timeout_s or self._startup_timeout_s}s (last: {last}); log: {self.log_tail(index)}"
        )

    def log_tail(self, index: int, num_bytes: int = 2000) -> str:
        path = Path(self.root) / f"{self.specs[index].name}.log"
        try:
            return path.read_bytes()[-num_bytes:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def stop_node(self, index: int, sig: int = signal.SIGTERM) -> None:
        """Stop one node (SIGTERM, or SIGKILL to simulate a crash); data is kept."""
        self.nodes[index].stop(sig)
        self._log.info("membership.etcd.node_stopped", node=self.specs[index].name,
                       signal=int(sig))

    def restart_node(self, index: int) -> None:
        """Start a stopped node again with the same ports and data, and wait for health."""
        self.nodes[index].start()
        self.wait_ready(index)
        self._log.info("membership.etcd.node_restarted", node=self.specs[index].name)

    def wipe(self) -> None:
        """Crash every node (SIGKILL), delete its data and start the cluster again, empty:
        an etcd restored from an empty data directory (what a job's members must detect)."""
        for node in self.nodes:
            node.stop(signal.SIGKILL)
        for spec in self.specs:
            shutil.rmtree(spec.data_dir, ignore_errors=True)
        for node in self.nodes:
            node.start()
        for index in range(len(self.nodes)):
            self.wait_ready(index)
        self._log.info("membership.etcd.wiped", nodes=len(self.nodes))

    def copy_data(self) -> str:
        """A crash-consistent copy of every node's data directory, taken while the nodes are
        paused (SIGSTOP, tens of milliseconds: no lease notices); returns the copy's folder,
        for :meth:`restore_data`. What a disk snapshot or a backup of the data directory is."""
        backup = tempfile.mkdtemp(prefix="etcd-copy-", dir=os.path.dirname(self.specs[0].data_dir))
        pids = [p for p in self.pids if p is not None]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            for index, spec in enumerate(self.specs):
                shutil.copytree(spec.data_dir, os.path.join(backup, str(index)))
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        self._log.info("membership.etcd.data_copied", nodes=len(self.nodes), to=backup)
        return backup

    def restore_data(self, backup: str) -> None:
        """Crash every node and start it again on the data of :meth:`copy_data`: etcd
        restored from an older state (what a job's members must detect)."""
        for node in self.nodes:
            node.stop(signal.SIGKILL)
        for index, spec in enumerate(self.specs):
            shutil.rmtree(spec.data_dir, ignore_errors=True)
            shutil.copytree(os.path.join(backup, str(index)), spec.data_dir)
        for node in self.nodes:
            node.start()
        for index in range(len(self.nodes)):
            self.wait_ready(index)
        self._log.info("membership.etcd.data_restored", nodes=len(self.nodes), source=backup)

    def leader_index(self, timeout_s: float = 10.0) -> int:
        """Index of the node that is the raft leader (via each node's /v3 status)."""
        import json
        import ssl
        import urllib.request

        context = ssl.create_default_context(cafile=self.tls.ca) if self.tls is not None else None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ids = {}
            leader_id = None
            for i, node in enumerate(self.nodes):
                if not node.running():
                    continue
                try:
                    req = urllib.request.Request(
                        node.spec.client_url + "/v3/maintenance/status", data=b"{}",
                        headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=1.0, context=context) as resp:
                        status = json.loads(resp.read())
                except OSError:
                    continue
                ids[status["header"]["member_id"]] = i
                if status.get("leader") not in (None, "0"):
                    leader_id = status["leader"]
            if leader_id is not None and leader_id in ids:
                return ids[leader_id]
            time.sleep(0.05)
        raise EtcdServerError(f"no raft leader among {self.endpoints} after {timeout_s}s")

    def stop(self) -> None:
        """Stop every node by pid and remove the data directory."""
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)
        self._log.info("membership.etcd.stopped", nodes=self.size)

    def __enter__(self) -> EtcdCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


class EtcdServer(EtcdCluster):
    """A single etcd node: ``with EtcdServer() as etcd: etcd.endpoints``."""

    def __init__(self, *, name: str = "er", extra_args: Sequence[str] = (),
                 startup_timeout_s: float = 20.0, tls: TlsFiles | None = None,
                 compaction: tuple[str, str] = ("revision", "10000")):
        super().__init__(1, name=name, extra_args=extra_args, startup_timeout_s=startup_timeout_s, tls=tls,
                         compaction=compaction)

    @property
    def endpoint(self) -> str:
        return self.specs[0].endpoint

    @property
    def pid(self) -> int | None:
        return self.nodes[0].pid

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.stop_node(0, sig)

    def restart(self) -> None:
        self.restart_node(0)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of a test PKI: a CA, etcd's certificate for 127.0.0.1 and a client's."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def make_certificates(directory: str) -> TlsFiles:
    """A fresh CA and certificates signed by it (openssl; valid one day), in ``directory``."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise EtcdServerError("openssl is not installed (apt-get install -y openssl)")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=elastic-refit test CA",
        "-keyout", "ca.key", "-out", "ca.pem")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    for who in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}", "-keyout", f"{who}.key",
            "-out", f"{who}.csr")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "1", "-extfile", "san.cnf", "-out", f"{who}.pem")
    return TlsFiles(str(d / "ca.pem"), str(d / "server.pem"), str(d / "server.key"), str(d / "client.pem"),
                    str(d / "client.key"))


def enable_auth(endpoint: str, ca: str, root_password: str, users: dict[str, tuple[str, str]]) -> None:
    """Turn on etcd's authentication: a ``root`` user, and per entry of ``users``
    (``name -> (password, key prefix)``) a user whose one role may read and write only that
    prefix. What an operator does once per job with ``etcdctl user/role``."""
    import grpc
    from aetcd import rpc

    from elastic_refit.membership.client import _prefix_end

    with open(ca, "rb") as fh:
        creds = grpc.ssl_channel_credentials(fh.read())
    with grpc.secure_channel(endpoint, creds) as channel:
        auth = rpc.AuthStub(channel)
        auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=root_password), timeout=5)
        auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"), timeout=5)
        auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
        for name, (password, prefix) in users.items():
            role = f"{name}-rw"
            auth.RoleAdd(rpc.AuthRoleAddRequest(name=role), timeout=5)
            key = prefix.encode()
            auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(
                name=role, perm=rpc.Permission(permType=rpc.Permission.READWRITE, key=key,
                                               range_end=_prefix_end(key))), timeout=5)
            auth.UserAdd(rpc.AuthUserAddRequest(name=name, password=password), timeout=5)
            auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=name, role=role), timeout=5)
        auth.AuthEnable(rpc.AuthEnableRequest(), timeout=5)
