"""The groups of ``RefitConfig``, one frozen dataclass per concern.

Each group checks its own fields in ``__post_init__`` and turns itself into what the part
that reads it needs (``Timeouts.membership``, ``PlanSettings.options``,
``TransferSettings.executor_options``), so no part re-slices the configuration by hand.
Checks that span groups (staging against buckets, connect-ahead against the backend) are
``RefitConfig``'s.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from elastic_refit.membership.client import EtcdConfig
from elastic_refit.membership.config import MembershipConfig
from elastic_refit.plan import PlanOptions, relay_mode
from elastic_refit.transport.options import ExecutorOptions

__all__ = ["EtcdAccess", "PlanSettings", "Timeouts", "TransferSettings", "VersionSettings"]

Mode = Literal["in_place", "staged"]
ConnectAhead = Literal["auto", "on", "off"]
Relay = Literal["auto", "on", "off"]
SameHost = Literal["network", "ipc"]
MODES: tuple[str, ...] = get_args(Mode)
Detached = Literal["keep", "block"]
DETACHED: tuple[str, ...] = get_args(Detached)
CONNECT_AHEAD: tuple[str, ...] = get_args(ConnectAhead)
SAME_HOST: tuple[str, ...] = get_args(SameHost)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _check_bools(group: object, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(group, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(group, name)!r}")


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long a member waits for its peers and etcd. They must be ordered
    ``collective_timeout_s < ttl_s < epoch_deadline_s``: a stuck transfer is noticed before
    the lease of a healthy peer could expire, and a membership change settles before anyone
    gives up on the epoch."""

    ttl_s: int = 4
    """The member's etcd lease, in whole seconds (etcd grants no shorter one than 2). Its
    keepalive goes every third of it, so a lease outlives an etcd or host stall of two
    thirds of the TTL. 4 s, measured: on a loaded 2-core host (two CPU burners, etcd sharing
    the cores) the longest wait for a keepalive answer reached 2.4 s at TTL 2 (p99 1.5 s: no
    margin left), 1.7 s at TTL 4 (benchmarks/RESULTS.md, 2026-12-05, issue 34). Crashes are
    seen by the liveness ring, not the TTL, and a lost lease comes back on its own
    (``runtime.rejoin``). What it bounds: how long a frozen (not dead) member holds the job
    up, and ``transport_timeout_s`` (TTL + 1 s)."""
    collective_timeout_s: float = 1.5
    """How long a collective of the control plane (a vote, an agreement) waits."""
    epoch_deadline_s: float = 10.0
    """How long an epoch may take to form before its members give up on it."""
    poll_s: float = 0.02
    """The pause between tries of a short retried step (a rendezvous read, a backoff unit)."""
    idle_wake_s: float = 5.0
    """The agent waits for etcd watch events, not on a timer; this only bounds how long a
    lost event could delay it (the watches resume and relist on their own)."""
    agent_stuck_s: float = 120.0
    """How long one action of the member's agent may run before the member counts it as
    stuck where no deadline reaches (a GPU call that never returns) and leaves the job, so
    that its peers go on (``runtime.watchdog``; waiters raise ``AgentStuck``). Must exceed
    the epoch deadline and the longest refit; 0: never."""
    join_hold_s: float = 2.0
    """How long an inference rank that registers while a version is on its way may be kept
    out of the epoch until that version commits (``membership.admission``): a recovery's
    commit then waits for no grow. 0: newcomers join the next epoch at once."""

    def __post_init__(self) -> None:
        if not _is_int(self.ttl_s) or self.ttl_s < 2:
            raise ValueError(f"ttl_s must be an int >= 2 (etcd grants no shorter lease), got {self.ttl_s!r}")
        for name in ("collective_timeout_s", "epoch_deadline_s", "poll_s", "idle_wake_s"):
            value = getattr(self, name)
            if not _is_real(value) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        if not _is_real(self.agent_stuck_s) or not (self.agent_stuck_s == 0
                                                     or self.epoch_deadline_s < self.agent_stuck_s < math.inf):
            raise ValueError(f"agent_stuck_s must be 0 (off) or seconds above epoch_deadline_s = "
                             f"{self.epoch_deadline_s}, got {self.agent_stuck_s!r}")
        if not _is_real(self.join_hold_s) or not 0 <= self.join_hold_s <= self.epoch_deadline_s:
            raise ValueError(f"join_hold_s must be seconds in [0, epoch_deadline_s = {self.epoch_deadline_s}], "
                             f"got {self.join_hold_s!r}")
        if not 0 < self.collective_timeout_s < self.ttl_s < self.epoch_deadline_s:
            raise ValueError(
                "timeouts must be ordered collective < lease TTL < epoch deadline, got "
                f"{self.collective_timeout_s}, {self.ttl_s}, {self.epoch_deadline_s}")

    @property
    def transport_timeout_s(self) -> float:
        """How long one send/recv (a gloo connect too) waits for a peer: the lease TTL plus a
        second. Longer than a slow but live peer needs; a dead one resets its connections at
        once, and a stopped one is out of the membership within its TTL."""
        return self.ttl_s + 1.0

    def membership(self) -> MembershipConfig:
        """The membership layer's timeouts."""
        return MembershipConfig(ttl_s=self.ttl_s, collective_timeout_s=self.collective_timeout_s,
                                epoch_deadline_s=self.epoch_deadline_s, join_hold_s=self.join_hold_s)


@dataclass(frozen=True, slots=True)
class EtcdAccess:
    """A secured etcd: TLS (the CA that signed etcd's certificate; a client certificate and
    key where etcd asks for one) and a user with a role on this job's prefix. The flat
    ``RefitConfig`` keywords are ``etcd_ca_file``, ``etcd_user``, ... (``ELASTIC_REFIT_ETCD_*``)."""

    ca_file: str | None = None
    """The CA certificate that signed etcd's (turns TLS on)."""
    cert_file: str | None = None
    """This client's certificate, where etcd asks for one."""
    key_file: str | None = None
    """This client's private key (with ``cert_file``)."""
    user: str | None = None
    """The etcd user (with ``password``)."""
    password: str | None = field(default=None, repr=False)
    """The user's password (never printed)."""
    allow_plaintext_password: bool = False
    """Let a password travel without TLS, readable on the wire."""

    def __post_init__(self) -> None:
        _check_bools(self, "allow_plaintext_password")

    def config(self, endpoints: tuple[str, ...]) -> EtcdConfig:
        """How a rank reaches etcd at ``endpoints``; ``ValueError`` for a file that is not
        there, a user without a password, or a password that would travel without TLS
        (unless ``allow_plaintext_password``)."""
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"etcd_{name} {path!r} is not a file")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd_user and etcd_password go together (ELASTIC_REFIT_ETCD_USER and "
                             "ELASTIC_REFIT_ETCD_PASSWORD)")
        config = EtcdConfig(tuple(endpoints), username=self.user, password=self.password,
                            ca_cert=self.ca_file, client_cert=self.cert_file, client_key=self.key_file)
        if config.password is not None and not config.tls and not self.allow_plaintext_password:
            raise ValueError("an etcd password would travel in plain text: give etcd_ca_file (TLS), an "
                             "https:// endpoint, or set etcd_allow_plaintext_password")
        return config


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """How refits are planned. Part of the plan, so the same on every member (members that
    differ disagree on the plan and fail the attempt, never hang)."""

    bucket_bytes: int = 16 << 20
    """The most bytes one message of a transfer carries."""
    concurrent_rounds: int = 1
    """Rounds of a phase in flight at once: more keeps more peer links busy and needs up to
    4 buckets of staging per round."""
    relay: Relay = "auto"
    """Ingress balance: a domain's cross-domain regions are received by the rank whose NIC
    is least loaded and forwarded inside the domain under the transfer. ``auto`` where that
    lowers the plan's busiest NIC, ``on`` always, ``off`` never (a bool means on / off)."""
    check_replicas: bool = True
    """Refuse a version whose source replicas differ where they hold the same region."""

    def __post_init__(self) -> None:
        if not _is_int(self.bucket_bytes) or self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be an int >= 1, got {self.bucket_bytes!r}")
        if not _is_int(self.concurrent_rounds) or self.concurrent_rounds < 1:
            raise ValueError(f"concurrent_rounds must be an int >= 1, got {self.concurrent_rounds!r}")
        object.__setattr__(self, "relay", relay_mode(self.relay))
        _check_bools(self, "check_replicas")

    def options(self) -> PlanOptions:
        """The planner's options."""
        return PlanOptions(bucket_bytes=self.bucket_bytes, concurrent_rounds=self.concurrent_rounds,
                           relay=self.relay)


@dataclass(frozen=True, slots=True)
class TransferSettings:
    """How this member's bytes move."""

    staging_bytes: int = 64 << 20
    """Staging memory of the executor: at least 4 buckets per concurrent round."""
    verify: bool = True
    """Check every received region against the version's digests before acking it."""
    connect_ahead: ConnectAhead = "auto"
    """On entering an epoch, connect the pairs of the epoch's refit plan (a byte each way),
    so the first refit after a reconfiguration does not pay NCCL's lazy connection setup:
    ``auto`` on NCCL backends (gloo connects every pair when its group is built), ``on``
    everywhere, ``off`` nowhere."""
    bind_interface: str | None = None
    """The network interface the refit's communicators bind to (gloo's device; NCCL's
    ``NCCL_SOCKET_IFNAME`` where it is not set already); None: the host's default."""
    delta_base_bytes: int = 0
    """Deltas (DESIGN.md, "Deltas"): a trainer keeps a copy of what it published for the
    last committed version (its base) within this many bytes on the tensors' device, and
    sends each new version as its change against it to the inference ranks that hold it
    verified (the others get full bytes). 0: full bytes every version. Set it on every
    member of a job (inference ranks keep no copy, their executors take deltas): a member
    registers whether it takes deltas, and an attempt with one that does not goes in full.
    A relayed plan forwards the deltas (its relays pass the segments on); a domain where
    some destination rank gets full bytes (a joiner, a restarted rank) takes its relayed
    messages in full."""

    same_host: SameHost = "network"
    """How members on one host (the same ``host``: colocated ranks, or the GPUs of one
    NVLink domain) exchange bytes. ``network``: through the backend's communicator, like
    any pair. ``ipc``: over CUDA IPC, a destination reads its plan's regions straight from
    the source's mapped GPU memory (one copy, no staging; ``transport.ipc``) and the
    communicator carries the other pairs, the votes and the aborts. ``ipc`` needs a CUDA
    device; gloo may then carry the rest."""

    def executor_options(self) -> ExecutorOptions:
        """The executor's options."""
        return ExecutorOptions(staging_bytes=self.staging_bytes, verify=self.verify,
                               delta=self.delta_base_bytes > 0)

    def __post_init__(self) -> None:
        if not _is_int(self.staging_bytes) or self.staging_bytes < 1:
            raise ValueError(f"staging_bytes must be an int >= 1, got {self.staging_bytes!r}")
        if not _is_int(self.delta_base_bytes) or self.delta_base_bytes < 0:
            raise ValueError(f"delta_base_bytes must be an int >= 0, got {self.delta_base_bytes!r}")
        _check_bools(self, "verify")
        _check_choice("connect_ahead", self.connect_ahead, CONNECT_AHEAD)
        _check_choice("same_host", self.same_host, SAME_HOST)
        if self.bind_interface is not None:
            names = [name for _, name in socket.if_nameindex()]
            if self.bind_interface not in names:
                raise ValueError(f"bind_interface {self.bind_interface!r} is not an interface of this host "
                                 f"({', '.join(names)})")


@dataclass(frozen=True, slots=True)
class VersionSettings:
    """How versions are published, given up and served."""

    mode: Mode = "in_place"
    """Inference: ``in_place`` writes a version into the served parameters (readers wait
    while it lands); ``staged`` lands it beside them and switches at commit."""
    snapshot_bytes: int = 0
    """Trainer: ``publish(..., wait=False)`` copies a version into at most this many bytes of
    snapshots (on the tensors' device) and returns at once; 0: no copy, it returns once its
    sends are done."""
    max_attempts: int = 5
    """A version that fails this many consecutive attempts for one cause is given up."""
    version_timeout_s: float = 120.0
    """Bounds ``publish``, ``wait_for_version`` and ``weights`` (a cause fails them sooner)."""
    serve_when_detached: Detached = "keep"
    """Inference: while this rank is out of the job (its lease was lost; it registers again
    as a new incarnation, see ``ElasticRefit.detached``), ``keep`` serves its last committed
    version through ``weights()``, ``block`` makes ``weights()`` wait until it is back."""

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, MODES)
        _check_choice("serve_when_detached", self.serve_when_detached, DETACHED)
        if not _is_int(self.snapshot_bytes) or self.snapshot_bytes < 0:
            raise ValueError(f"snapshot_bytes must be an int >= 0, got {self.snapshot_bytes!r}")
        if not _is_int(self.max_attempts) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an int >= 1, got {self.max_attempts!r}")
        if not _is_real(self.version_timeout_s) or not 0 < self.version_timeout_s < math.inf:
            raise ValueError(f"version_timeout_s must be a finite number of seconds > 0, "
                             f"got {self.version_timeout_s!r}")
