"""Runtime configuration: a frozen dataclass, also read from ELASTIC_REFIT_* variables."""

from __future__ import annotations

import difflib
import math
import os
import re
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from elastic_refit.layout import Layout
from elastic_refit.membership.client import EtcdConfig
from elastic_refit.membership.keys import check_name
from elastic_refit.plan import RELAY_MODES, relay_mode
from elastic_refit.transport.backend import Backend

ROLES = ("trainer", "inference")
MODES = ("in_place", "staged")
CONNECT_AHEAD = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class RefitLayouts:
    """The full training and inference layouts, in layout-rank space (every rank holds both:
    plans are computed everywhere)."""

    source: Layout
    destination: Layout

    @classmethod
    def from_preset(cls, model: Any, source: str, destination: str, *, num_layers: int | None = None) -> RefitLayouts:
        """Megatron ``source`` -> vLLM ``destination``; inference layout ranks follow the trainers'."""
        from elastic_refit.layout.refit import model_refit_spec

        spec = model_refit_spec(model, source, destination, num_layers=num_layers)
        return cls(spec.source, spec.destination)

    @classmethod
    def from_spec(cls, path: str | Path) -> RefitLayouts:
        from elastic_refit.layout import load_spec

        spec = load_spec(path)
        return cls(spec.source, spec.destination)


@dataclass(frozen=True, slots=True)
class RefitConfig:
    """One rank's runtime configuration.

    Timeouts must be ordered ``collective_timeout_s < ttl_s < epoch_deadline_s``: a stuck
    transfer is noticed before the lease of a healthy peer could expire, and a membership
    change settles before anyone gives up on the epoch. ``version_timeout_s`` bounds
    ``publish`` / ``wait_for_version`` / ``weights``; a version that fails ``max_attempts``
    consecutive attempts for the same cause is given up (``RefitFailed``) long before that.
    """

    job: str
    role: str
    member_id: str
    layout_rank: int
    etcd: tuple[str, ...]
    domain: str = "domain-0"
    host: str = field(default_factory=socket.gethostname)
    device: str = "cpu"
    backend: str = "gloo"
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    ttl_s: int = 2
    collective_timeout_s: float = 1.5
    epoch_deadline_s: float = 10.0
    version_timeout_s: float = 120.0
    mode: str = "in_place"
    verify: bool = True
    bucket_bytes: int = 16 << 20
    staging_bytes: int = 64 << 20
    # Rounds of a phase in flight at once (PlanOptions.concurrent_rounds): more keeps more
    # peer links busy and needs up to 4 buckets of staging per round. Same on every member
    # (it is part of the plan: members that differ disagree on the plan, never hang).
    concurrent_rounds: int = 1
    # Ingress balance (PlanOptions.relay): a domain's cross-domain regions are received by the
    # rank whose NIC is least loaded and forwarded inside the domain under the transfer.
    # "auto" where that lowers the plan's busiest NIC (else the plain plan), "on" always,
    # "off" never; a bool means "on" / "off". Part of the plan, so the same on every member.
    relay: str = "auto"
    # publish(..., wait=False) copies a version into at most this many bytes of snapshots (on
    # the tensors' device) and returns at once; 0: no copy, it returns once its sends are done.
    snapshot_bytes: int = 0
    poll_s: float = 0.02
    # The agent waits for etcd watch events, not on a timer; this only bounds how long a
    # lost event could delay it (the watches resume and relist on their own).
    idle_wake_s: float = 5.0
    max_attempts: int = 5
    # On entering an epoch, connect the pairs of the epoch's refit plan (a byte each way),
    # so the first refit after a reconfiguration does not pay NCCL's lazy connection setup:
    # "auto" does on NCCL backends (gloo connects every pair when its group is built),
    # "on" everywhere, "off" nowhere.
    connect_ahead: str = "auto"
    # Refuse a version whose source replicas differ where they hold the same region.
    check_replicas: bool = True
    # The network interface the refit's communicators bind to (gloo's device; NCCL's
    # NCCL_SOCKET_IFNAME where it is not set already); None: the host's default.
    bind_interface: str | None = None
    # A secured etcd: TLS (the CA that signed etcd's certificate; a client certificate and
    # key where etcd asks for one) and a user with a role on this job's prefix.
    etcd_ca_file: str | None = None
    etcd_cert_file: str | None = None
    etcd_key_file: str | None = None
    etcd_user: str | None = None
    etcd_password: str | None = field(default=None, repr=False)
    etcd_allow_plaintext_password: bool = False  # a password without TLS travels readable

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        check_name("job", self.job)
        check_name("member_id", self.member_id)
        for name in ("domain", "host", "device", "incarnation"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if not _is_int(self.layout_rank) or self.layout_rank < 0:
            raise ValueError(f"layout_rank must be an int >= 0, got {self.layout_rank!r}")
        etcd = (self.etcd,) if isinstance(self.etcd, str) else tuple(self.etcd)
        if not etcd or not all(isinstance(e, str) and e for e in etcd):
            raise ValueError(f"etcd needs at least one endpoint (host:port), got {self.etcd!r}")
        object.__setattr__(self, "etcd", etcd)
        backend = Backend.parse(self.backend)  # ValueError naming the choices
        object.__setattr__(self, "backend", backend.value)
        device_type = self.device.split(":", 1)[0] if isinstance(self.device, str) else None
        if device_type != backend.device_type:
            raise ValueError(f"backend {backend.value!r} moves {backend.device_type} tensors, but device is "
                             f"{self.device!r}; use device={'cpu' if backend is Backend.GLOO else 'cuda:0'!r}")
        if not _is_int(self.ttl_s) or self.ttl_s < 2:
            raise ValueError(f"ttl_s must be an int >= 2 (etcd grants no shorter lease), got {self.ttl_s!r}")
        for name in ("collective_timeout_s", "epoch_deadline_s", "version_timeout_s", "poll_s", "idle_wake_s"):
            value = getattr(self, name)
            if not _is_real(value) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        if not 0 < self.collective_timeout_s < self.ttl_s < self.epoch_deadline_s:
            raise ValueError(
                "timeouts must be ordered collective < lease TTL < epoch deadline, got "
                f"{self.collective_timeout_s}, {self.ttl_s}, {self.epoch_deadline_s}")
        self.etcd_config()  # every etcd setting checked here, not at the first connection
        if self.bind_interface is not None:
            names = [name for _, name in socket.if_nameindex()]
            if self.bind_interface not in names:
                raise ValueError(f"bind_interface {self.bind_interface!r} is not an interface of this host "
                                 f"({', '.join(names)})")
        if self.connect_ahead not in CONNECT_AHEAD:
            raise ValueError(f"connect_ahead must be one of {', '.join(CONNECT_AHEAD)}, got {self.connect_ahead!r}")
        object.__setattr__(self, "relay", relay_mode(self.relay))
        for name in ("verify", "check_replicas", "etcd_allow_plaintext_password"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not _is_int(self.bucket_bytes) or self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be an int >= 1, got {self.bucket_bytes!r}")
        if not _is_int(self.concurrent_rounds) or self.concurrent_rounds < 1:
            raise ValueError(f"concurrent_rounds must be an int >= 1, got {self.concurrent_rounds!r}")
        if not _is_int(self.staging_bytes) or self.staging_bytes < 4 * self.bucket_bytes * self.concurrent_rounds:
            raise ValueError(f"staging_bytes {self.staging_bytes!r} must hold 4 buckets of {self.bucket_bytes} "
                             f"per concurrent round ({self.concurrent_rounds})")
        if not _is_int(self.snapshot_bytes) or self.snapshot_bytes < 0:
            raise ValueError(f"snapshot_bytes must be an int >= 0, got {self.snapshot_bytes!r}")
        if not _is_int(self.max_attempts) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an int >= 1, got {self.max_attempts!r}")

    @property
    def transport_timeout_s(self) -> float:
        """How long one send/recv (a gloo connect too) waits for a peer: the lease TTL plus a
        second. Longer than a slow but live peer needs; a dead one resets its connections at
        once, and a stopped one is out of the membership within its TTL."""
        return self.ttl_s + 1.0

    @property
    def connects_ahead(self) -> bool:
        """Whether entering an epoch connects the plan's pairs (``connect_ahead``)."""
        return self.connect_ahead == "on" or (self.connect_ahead == "auto" and self.backend != Backend.GLOO)

    def etcd_config(self) -> EtcdConfig:
        """How this rank reaches etcd; ``ValueError`` for a file that is not there, a user
        without a password, or a password that would travel without TLS (unless
        ``etcd_allow_plaintext_password``)."""
        for name in ("etcd_ca_file", "etcd_cert_file", "etcd_key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name} {path!r} is not a file")
        if (self.etcd_user is None) != (self.etcd_password is None):
            raise ValueError("etcd_user and etcd_password go together (ELASTIC_REFIT_ETCD_USER and "
                             "ELASTIC_REFIT_ETCD_PASSWORD)")
        config = EtcdConfig(tuple(self.etcd), username=self.etcd_user, password=self.etcd_password,
                            ca_cert=self.etcd_ca_file, client_cert=self.etcd_cert_file,
                            client_key=self.etcd_key_file)
        if config.password is not None and not config.tls and not self.etcd_allow_plaintext_password:
            raise ValueError("an etcd password would travel in plain text: give etcd_ca_file (TLS), an "
                             "https:// endpoint, or set etcd_allow_plaintext_password")
        return config

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> RefitConfig:
        """Fields from ``ELASTIC_REFIT_<FIELD>`` (e.g. ``ELASTIC_REFIT_MEMBER_ID``); ``etcd``
        is a comma-separated list; explicit keyword arguments win. Every variable is parsed
        strictly (booleans from a fixed set, numbers finite): ``ValueError`` naming the
        variable and its value, never a silent default.

        Under torchrun (``TORCHELASTIC_RUN_ID`` set) the member id, layout rank, domain,
        incarnation and device default to what torchrun's environment says (see
        :func:`torchrun_defaults`), so trainers started by torchrun need only the job, the
        role and etcd."""
        environ = dict(os.environ if environ is None else environ)
        _check_variables(environ, [f.name for f in fields(cls)])
        values: dict[str, Any] = {}
        origin: dict[str, str] = {}  # field -> "VARIABLE='raw'"
        password_file = environ.get("ELASTIC_REFIT_ETCD_PASSWORD_FILE")
        if password_file is not None and "etcd_password" not in overrides:
            if "ELASTIC_REFIT_ETCD_PASSWORD" in environ:
                raise ValueError("give ELASTIC_REFIT_ETCD_PASSWORD or ELASTIC_REFIT_ETCD_PASSWORD_FILE, not both")
            try:
                values["etcd_password"] = Path(password_file).read_text().rstrip("\r\n")
            except OSError as exc:
                raise ValueError(f"ELASTIC_REFIT_ETCD_PASSWORD_FILE={password_file!r}: {exc.strerror}") from None
            origin["etcd_password"] = f"ELASTIC_REFIT_ETCD_PASSWORD_FILE={password_file!r}"
        for f in fields(cls):
            variable = f"ELASTIC_REFIT_{f.name.upper()}"
            raw = environ.get(variable)
            if raw is None or f.name in overrides:
                continue
            values[f.name] = _parse_env(variable, f.name, f.type, raw)
            origin[f.name] = f"{variable}={raw!r}"
        if "role" in values or "role" in overrides:
            for name, (value, where) in torchrun_defaults(environ, overrides.get("role", values.get("role")),
                                                          overrides.get("backend", values.get("backend"))).items():
                if name not in values and name not in overrides:
                    values[name], origin[name] = value, where
        values.update(overrides)
        missing = [n for n in ("job", "role", "member_id", "layout_rank", "etcd") if n not in values]
        if missing:
            raise ValueError("missing configuration: " + ", ".join(f"ELASTIC_REFIT_{n.upper()}" for n in missing))
        try:
            return cls(**values)
        except ValueError as exc:
            named = [where for name, where in origin.items() if name in str(exc)]
            raise ValueError(f"{exc} (from {', '.join(named)})" if named else str(exc)) from None


# Variables a Kubernetes service link defines for a Service whose name starts with
# "elastic-refit" (ELASTIC_REFIT_ETCD_SERVICE_HOST, ..._PORT_2379_TCP_ADDR): not ours.
_SERVICE_LINK = re.compile(r"_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)?)$")
_EXTRA_VARIABLES = ("ELASTIC_REFIT_ETCD_PASSWORD_FILE",
                    # the test harness's own (elastic_refit.testing, benchmarks), not configuration
                    "ELASTIC_REFIT_CUDA_DEVICE", "ELASTIC_REFIT_CHAOS_RESULTS")


def _check_variables(environ: Mapping[str, str], field_names: list[str]) -> None:
    """``ValueError`` for an ``ELASTIC_REFIT_*`` variable that configures nothing (a typo
    such as ``ELASTIC_REFIT_TTL`` would otherwise be ignored silently)."""
    known = {f"ELASTIC_REFIT_{name.upper()}" for name in field_names} | set(_EXTRA_VARIABLES)
    for variable in sorted(environ):
        if not variable.startswith("ELASTIC_REFIT_") or variable in known:
            continue
        if _SERVICE_LINK.search(variable):
            continue
        close = difflib.get_close_matches(variable, sorted(known), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"unknown variable {variable}={environ[variable]!r}{hint}: no RefitConfig field "
                         "of that name")


def torchrun_defaults(environ: Mapping[str, str], role: str, backend: str | None = None) -> dict[str, tuple[Any, str]]:
    """What a rank started by torchrun (torch.distributed.elastic) is, from its environment
    (pure): field -> (value, where it came from). Empty when ``TORCHELASTIC_RUN_ID`` is not set.

    - ``member_id``: ``{role}-{RANK}`` (stable across restarts: a restarted group rejoins as
      the same members), ``layout_rank``: ``RANK`` (its place in the trainers' world);
    - ``domain``: ``node-{GROUP_RANK}`` (one node, one NVLink domain);
    - ``incarnation``: ``r{TORCHELASTIC_RESTART_COUNT}-`` + a random id: every torchelastic
      restart of the group is a new incarnation of each member;
    - ``device``: ``cuda:{LOCAL_RANK}`` when the backend is NCCL.
    """
    if not environ.get("TORCHELASTIC_RUN_ID"):
        return {}

    def integer(variable: str) -> int | None:
        raw = environ.get(variable)
        if raw is None:
            return None
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"torchrun's {variable}={raw!r} is not an integer") from None
        if value < 0:
            raise ValueError(f"torchrun's {variable}={raw!r} is negative")
        return value

    out: dict[str, tuple[Any, str]] = {}
    rank = integer("RANK")
    if rank is not None:
        out["member_id"] = (f"{role}-{rank}", f"torchrun's RANK={rank}")
        out["layout_rank"] = (rank, f"torchrun's RANK={rank}")
    node = integer("GROUP_RANK")
    if node is not None:
        out["domain"] = (f"node-{node}", f"torchrun's GROUP_RANK={node}")
    restarts = integer("TORCHELASTIC_RESTART_COUNT")
    if restarts is not None:
        out["incarnation"] = (f"r{restarts}-{uuid.uuid4().hex[:8]}", f"torchrun's TORCHELASTIC_RESTART_COUNT={restarts}")
    local = integer("LOCAL_RANK")
    if local is not None and backend is not None and backend != "gloo":
        out["device"] = (f"cuda:{local}", f"torchrun's LOCAL_RANK={local}")
    return out


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse_env(variable: str, name: str, type_: Any, raw: str) -> Any:
    """The value of one ``ELASTIC_REFIT_*`` variable for field ``name`` (strict)."""
    text = raw.strip()
    if name == "etcd":
        return tuple(e.strip() for e in raw.split(",") if e.strip())
    if name == "relay":  # a mode, or a boolean as the field was before "auto"
        if text.lower() in RELAY_MODES:
            return text.lower()
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"{variable}={raw!r} is not a relay mode (one of {', '.join(RELAY_MODES)}, or a boolean)")
    if type_ in ("int", int):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{variable}={raw!r} is not an integer") from None
    if type_ in ("float", float):
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{variable}={raw!r} is not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"{variable}={raw!r} is not a finite number")
        return value
    if type_ in ("bool", bool):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"{variable}={raw!r} is not a boolean (one of {', '.join(_TRUE + _FALSE)})")
    return raw


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
