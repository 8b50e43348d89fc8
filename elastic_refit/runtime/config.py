"""Runtime configuration: a frozen dataclass, also read from ELASTIC_REFIT_* variables."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from elastic_refit.layout import Layout

ROLES = ("trainer", "inference")
MODES = ("in_place", "staged")


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
    change settles before anyone gives up on the epoch.
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
    poll_s: float = 0.02

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not self.job or not self.member_id:
            raise ValueError(f"job and member_id must be non-empty, got {self.job!r} and {self.member_id!r}")
        if self.layout_rank < 0:
            raise ValueError(f"layout_rank must be >= 0, got {self.layout_rank}")
        etcd = (self.etcd,) if isinstance(self.etcd, str) else tuple(self.etcd)
        if not etcd:
            raise ValueError("etcd needs at least one endpoint (host:port)")
        object.__setattr__(self, "etcd", etcd)
        if not 0 < self.collective_timeout_s < self.ttl_s < self.epoch_deadline_s:
            raise ValueError(
                "timeouts must be ordered collective < lease TTL < epoch deadline, got "
                f"{self.collective_timeout_s}, {self.ttl_s}, {self.epoch_deadline_s}")
        if self.staging_bytes < 4 * self.bucket_bytes:
            raise ValueError(f"staging_bytes {self.staging_bytes} must hold 4 buckets of {self.bucket_bytes}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> RefitConfig:
        """Fields from ``ELASTIC_REFIT_<FIELD>`` (e.g. ``ELASTIC_REFIT_MEMBER_ID``); ``etcd``
        is a comma-separated list; explicit keyword arguments win."""
        environ = dict(os.environ if environ is None else environ)
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(f"ELASTIC_REFIT_{f.name.upper()}")
            if raw is None:
                continue
            if f.name == "etcd":
                values[f.name] = tuple(e.strip() for e in raw.split(",") if e.strip())
            elif f.type in ("int", int):
                values[f.name] = int(raw)
            elif f.type in ("float", float):
                values[f.name] = float(raw)
            elif f.type in ("bool", bool):
                values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
            else:
                values[f.name] = raw
        values.update(overrides)
        missing = [n for n in ("job", "role", "member_id", "layout_rank", "etcd") if n not in values]
        if missing:
            raise ValueError("missing configuration: " + ", ".join(f"ELASTIC_REFIT_{n.upper()}" for n in missing))
        return cls(**values)
