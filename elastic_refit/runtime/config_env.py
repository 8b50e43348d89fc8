"""``RefitConfig.from_env``'s reading of the environment (pure: the environment is passed in).

Each setting is an ``ELASTIC_REFIT_<NAME>`` variable, parsed strictly; a variable that
configures nothing is an error (with the closest name), and torchrun's variables give the
defaults of a rank it started.
"""

from __future__ import annotations

import difflib
import math
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from elastic_refit.plan import RELAY_MODES

__all__ = ["torchrun_defaults", "values_from_env"]

_REQUIRED = ("job", "role", "member_id", "layout_rank", "etcd")


def values_from_env(environ: Mapping[str, str], overrides: Mapping[str, Any], names: tuple[str, ...],
                    types: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The keyword arguments of a ``RefitConfig`` from ``environ`` and ``overrides`` (which
    win), and where each value read from the environment came from (name -> ``VAR='raw'``)."""
    _check_variables(environ, names)
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    password_file = environ.get("ELASTIC_REFIT_ETCD_PASSWORD_FILE")
    if password_file is not None and "etcd_password" not in overrides:
        if "ELASTIC_REFIT_ETCD_PASSWORD" in environ:
            raise ValueError("give ELASTIC_REFIT_ETCD_PASSWORD or ELASTIC_REFIT_ETCD_PASSWORD_FILE, not both")
        try:
            values["etcd_password"] = Path(password_file).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"ELASTIC_REFIT_ETCD_PASSWORD_FILE={password_file!r}: {exc.strerror}") from None
        origin["etcd_password"] = f"ELASTIC_REFIT_ETCD_PASSWORD_FILE={password_file!r}"
    for name in names:
        variable = f"ELASTIC_REFIT_{name.upper()}"
        raw = environ.get(variable)
        if raw is None or name in overrides:
            continue
        values[name] = _parse_env(variable, name, types[name], raw)
        origin[name] = f"{variable}={raw!r}"
    if "role" in values or "role" in overrides:
        for name, (value, where) in torchrun_defaults(environ, overrides.get("role", values.get("role")),
                                                      overrides.get("backend", values.get("backend"))).items():
            if name not in values and name not in overrides:
                values[name], origin[name] = value, where
    values.update(overrides)
    missing = [n for n in _REQUIRED if n not in values]
    if missing:
        raise ValueError("missing configuration: " + ", ".join(f"ELASTIC_REFIT_{n.upper()}" for n in missing))
    return values, origin


# Variables a Kubernetes service link defines for a Service whose name starts with
# "elastic-refit" (ELASTIC_REFIT_ETCD_SERVICE_HOST, ..._PORT_2379_TCP_ADDR): not ours.
_SERVICE_LINK = re.compile(r"_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)?)$")
_EXTRA_VARIABLES = ("ELASTIC_REFIT_ETCD_PASSWORD_FILE",
                    # the test harness's own (elastic_refit.testing, benchmarks), not configuration
                    "ELASTIC_REFIT_CUDA_DEVICE", "ELASTIC_REFIT_CHAOS_RESULTS")


def _check_variables(environ: Mapping[str, str], field_names: tuple[str, ...]) -> None:
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
        raise ValueError(f"unknown variable {variable}={environ[variable]!r}{hint}: no RefitConfig "
                         "field of that name")


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
