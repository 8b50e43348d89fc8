"""Runtime configuration: a frozen dataclass of the rank's identity and its settings grouped
by concern, also read from ``ELASTIC_REFIT_*`` variables."""

from __future__ import annotations

import difflib
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from elastic_refit.layout import Layout
from elastic_refit.membership.client import EtcdConfig
from elastic_refit.membership.config import MembershipConfig
from elastic_refit.membership.keys import check_name
from elastic_refit.runtime.config_env import values_from_env
from elastic_refit.runtime.settings import (
    EtcdAccess,
    PlanSettings,
    Timeouts,
    TransferSettings,
    VersionSettings,
)
from elastic_refit.transport.backend import Backend

__all__ = ["RefitConfig", "RefitLayouts"]

ROLES = ("trainer", "inference")


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


# The flat keywords (and ELASTIC_REFIT_* variables) of the grouped settings: name -> (group, field).
_GROUPS: dict[str, type] = {"timeouts": Timeouts, "etcd_access": EtcdAccess, "plan": PlanSettings,
                            "transfer": TransferSettings, "versions": VersionSettings}
FLAT: dict[str, tuple[str, str]] = {
    **{f.name: ("timeouts", f.name) for f in fields(Timeouts)},
    **{f"etcd_{f.name}": ("etcd_access", f.name) for f in fields(EtcdAccess)},
    **{f.name: ("plan", f.name) for f in fields(PlanSettings)},
    **{f.name: ("transfer", f.name) for f in fields(TransferSettings)},
    **{f.name: ("versions", f.name) for f in fields(VersionSettings)},
}
IDENTITY = ("job", "role", "member_id", "layout_rank", "etcd", "domain", "host", "device", "backend", "incarnation",
            "run_id")


@dataclass(frozen=True, slots=True, init=False)
class RefitConfig:
    """One rank's runtime configuration: who it is (the identity fields) and, grouped by
    concern, its ``timeouts``, ``etcd_access``, ``plan``, ``transfer`` and ``versions``
    settings (see :mod:`elastic_refit.runtime.settings`).

    Every grouped setting is also a flat keyword and attribute (``RefitConfig(...,
    ttl_s=3, bucket_bytes=...)``, ``config.ttl_s``; ``etcd_ca_file`` is
    ``etcd_access.ca_file``), and an ``ELASTIC_REFIT_<NAME>`` variable for
    :meth:`from_env`. Flat keywords override the group given beside them, so
    ``dataclasses.replace(config, ttl_s=3)`` works too.
    """

    job: str
    """The job's name (its etcd prefix); every member of one job gives the same."""
    role: str
    """``trainer`` (publishes versions) or ``inference`` (serves them)."""
    member_id: str
    """A stable name of this rank in the job (a restarted rank comes back under it)."""
    layout_rank: int
    """This rank's place in its side's layout."""
    etcd: tuple[str, ...]
    """etcd's endpoints (host:port, or a comma-separated string)."""
    domain: str = "domain-0"
    """The NVLink domain (host) this rank is in: intersections cross each domain once."""
    host: str = field(default_factory=socket.gethostname)
    """This rank's host name."""
    device: str = "cpu"
    """Where this rank's tensors live (``cpu``, ``cuda:N``)."""
    backend: str = "gloo"
    """The transport of the refit's communicators (``gloo``, ``nccl``, ``nccl4py``)."""
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """This life of the member: a restart is a new incarnation."""
    run_id: str | None = None
    """This run's id, the same on every member of the run (``ELASTIC_REFIT_RUN_ID``): a member
    that finds its job's name held by another run id is refused at start (``RunClash``,
    naming both runs) instead of joining it. None (the default): the member joins whatever
    run holds the job's name, under a random run id if it is the first. Never defaulted from
    a launcher's id (``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``): trainers and inference ranks
    are often started by different launchers, and such a default would refuse a legitimate
    job; give the same id to every member (e.g. an experiment's id) or none."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    """Leases, collectives, epochs (``Timeouts``)."""
    etcd_access: EtcdAccess = field(default_factory=EtcdAccess)
    """TLS and credentials of a secured etcd (``EtcdAccess``)."""
    plan: PlanSettings = field(default_factory=PlanSettings)
    """How refits are planned: the same on every member (``PlanSettings``)."""
    transfer: TransferSettings = field(default_factory=TransferSettings)
    """How this member's bytes move (``TransferSettings``)."""
    versions: VersionSettings = field(default_factory=VersionSettings)
    """How versions are published, given up and served (``VersionSettings``)."""

    def __init__(self, job: str, role: str, member_id: str, layout_rank: int, etcd: str | tuple[str, ...],
                 domain: str = "domain-0", host: str | None = None, device: str = "cpu", backend: str = "gloo",
                 incarnation: str | None = None, *, run_id: str | None = None, timeouts: Timeouts | None = None,
                 etcd_access: EtcdAccess | None = None, plan: PlanSettings | None = None,
                 transfer: TransferSettings | None = None, versions: VersionSettings | None = None,
                 **settings: Any) -> None:
        unknown = sorted(set(settings) - set(FLAT))
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(FLAT), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"RefitConfig got an unexpected keyword argument {unknown[0]!r}{hint}")
        given = {"timeouts": timeouts, "etcd_access": etcd_access, "plan": plan, "transfer": transfer,
                 "versions": versions}
        for name, group in given.items():
            if group is not None and not isinstance(group, _GROUPS[name]):
                raise ValueError(f"{name} must be a {_GROUPS[name].__name__}, got {type(group).__name__}")
            flat = {f: settings[k] for k, (g, f) in FLAT.items() if g == name and k in settings}
            base = group if group is not None else _GROUPS[name]()
            given[name] = replace(base, **flat) if flat else base
        values = {"job": job, "role": role, "member_id": member_id, "layout_rank": layout_rank, "etcd": etcd,
                  "domain": domain, "host": socket.gethostname() if host is None else host, "device": device,
                  "backend": backend, "incarnation": uuid.uuid4().hex[:12] if incarnation is None else incarnation,
                  "run_id": run_id, **given}
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        check_name("job", self.job)
        check_name("member_id", self.member_id)
        if self.run_id is not None:
            check_name("run_id", self.run_id)
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
        ipc = self.transfer.same_host == "ipc"
        if ipc and device_type != "cuda":
            raise ValueError(f"same_host 'ipc' maps peers' GPU memory: device must be a CUDA device (cuda:N), "
                             f"got {self.device!r}")
        # With CUDA IPC for the ranks of one host, gloo may carry the rest (through host memory).
        if device_type != backend.device_type and not (ipc and backend is Backend.GLOO):
            raise ValueError(f"backend {backend.value!r} moves {backend.device_type} tensors, but device is "
                             f"{self.device!r}; use device={'cpu' if backend is Backend.GLOO else 'cuda:0'!r}")
        self.etcd_config()  # every etcd setting checked here, not at the first connection
        rounds, bucket = self.plan.concurrent_rounds, self.plan.bucket_bytes
        if self.transfer.staging_bytes < 4 * bucket * rounds:
            raise ValueError(f"staging_bytes {self.transfer.staging_bytes!r} must hold 4 buckets of {bucket} "
                             f"per concurrent round ({rounds})")

    def __getattr__(self, name: str) -> Any:
        # The flat names of the grouped settings (config.ttl_s is config.timeouts.ttl_s).
        where = FLAT.get(name)
        if where is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, where[0]), where[1])

    @property
    def transport_timeout_s(self) -> float:
        """How long one send/recv waits for a peer (``Timeouts.transport_timeout_s``)."""
        return self.timeouts.transport_timeout_s

    @property
    def connects_ahead(self) -> bool:
        """Whether entering an epoch connects the plan's pairs (``connect_ahead``)."""
        mode = self.transfer.connect_ahead
        return mode == "on" or (mode == "auto" and self.backend != Backend.GLOO)

    def membership_config(self) -> MembershipConfig:
        """The membership layer's settings: the ``timeouts`` and the ``run_id``."""
        return replace(self.timeouts.membership(), run_id=self.run_id)

    def etcd_config(self) -> EtcdConfig:
        """How this rank reaches etcd (``EtcdAccess.config``)."""
        return self.etcd_access.config(self.etcd)

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """Every keyword (and ``ELASTIC_REFIT_<NAME>`` variable) of the configuration."""
        return IDENTITY + tuple(FLAT)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> RefitConfig:
        """Fields from ``ELASTIC_REFIT_<NAME>`` (e.g. ``ELASTIC_REFIT_MEMBER_ID``,
        ``ELASTIC_REFIT_TTL_S``); ``etcd`` is a comma-separated list; explicit keyword
        arguments win. Every variable is parsed strictly (booleans from a fixed set, numbers
        finite): ``ValueError`` naming the variable and its value, never a silent default.

        Under torchrun (``TORCHELASTIC_RUN_ID`` set) the member id, layout rank, domain,
        incarnation and device default to what torchrun's environment says (see
        :func:`~elastic_refit.runtime.config_env.torchrun_defaults`), so trainers started by
        torchrun need only the job, the role and etcd."""
        values, origin = values_from_env(dict(os.environ if environ is None else environ), overrides,
                                         cls.setting_names(), _types())
        try:
            return cls(**values)
        except ValueError as exc:
            # The variable the error is about: the one it starts with, else any it names.
            named = [where for name, where in origin.items() if str(exc).startswith(name)] or \
                [where for name, where in origin.items() if name in str(exc)]
            raise ValueError(f"{exc} (from {', '.join(named)})" if named else str(exc)) from None


def _types() -> dict[str, Any]:
    """The declared type of every setting (how its variable is parsed)."""
    types: dict[str, Any] = {f.name: f.type for f in fields(RefitConfig) if f.name in IDENTITY}
    for flat, (group, name) in FLAT.items():
        types[flat] = next(f.type for f in fields(_GROUPS[group]) if f.name == name)
    return types


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
