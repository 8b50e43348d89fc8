"""Which path a communicator takes from one epoch to the next (pure), and what the installed
runtime supports (probed once).

On a new epoch the communicator lifecycle (:mod:`elastic_refit.membership.comm`) takes the
cheapest path the installed runtime supports (:func:`choose_path`):

- removals only, NCCL >= 2.27 with a backend that can shrink -> ``shrink``
  (``shrink_abort`` when a peer died: in-flight work on the parent is aborted first);
  afterwards the parent is aborted, not destroyed;
- additions only, NCCL >= 2.29.2 with nccl4py's grow -> ``grow`` (existing ranks keep
  their numbers, newcomers get the unique id through the epoch's etcd store);
- anything else, and always for gloo -> ``rebuild``: abort the old communicator and
  rendezvous a new one under ``store/{epoch}/``.

On NCCL every rank takes the path rank 0 of the epoch picked, and rank 0 picks a path that
keeps the communicator only when every survivor reported it ready (:func:`agree_fast_path`):
NCCL will not shrink or grow from a communicator whose state is an error (a revoke does not
clear it: measured), and torch's ``ProcessGroupNCCL.shrink`` needs a store it can clone: the etcd store clones
where torch forwards ``Store::clone`` to a store written in Python (probed). Everything here but
:func:`probe_runtime` is a pure function of its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from elastic_refit.membership.view import MembershipView, diff

from elastic_refit.transport.factory import probe_nccl4py
from elastic_refit.transport.protocol import Backend

__all__ = ["BACKENDS", "FAST_PATHS", "NCCL_MIN_GROW", "NCCL_MIN_SHRINK", "PATHS", "RuntimeSupport",
           "agree_fast_path", "build_stranded", "choose_path", "probe_runtime", "rebuild_if_formed"]

BACKENDS: tuple[str, ...] = tuple(b.value for b in Backend)
PATHS: tuple[str, ...] = ("build", "unchanged", "shrink", "shrink_abort", "grow", "rebuild")
NCCL_MIN_SHRINK = (2, 27, 0)
NCCL_MIN_GROW = (2, 29, 2)


@dataclass(frozen=True, slots=True)
class RuntimeSupport:
    """What the installed torch / NCCL / nccl4py can do for reconfiguration."""

    torch_version: str
    num_gpus: int
    nccl_version: tuple[int, int, int] | None
    torch_shrink_group: bool
    nccl_backend_shrink: bool
    nccl4py_version: str | None
    nccl4py_shrink: bool
    nccl4py_grow: bool
    nccl4py_nccl_version: tuple[int, int, int] | None = None  # the libnccl nccl4py loaded
    # torch's ProcessGroupNCCL.shrink clones the group's store (c10d::Store::clone). Before
    # EtcdStore had a clone, that failed on torch 2.11 ("Tried to call pure virtual function
    # c10d::Store::clone"); it answers where torch forwards the call to a store written in
    # Python (torch 2.13 does: _python_store_clones); elsewhere the group rebuilds.
    store_clone: bool = False

    @property
    def nccl_shrink(self) -> bool:
        """ncclCommShrink reachable through torch's ProcessGroupNCCL."""
        return (self.nccl_version is not None and self.nccl_version >= NCCL_MIN_SHRINK
                and self.nccl_backend_shrink and self.store_clone)

    @property
    def nccl4py_can_shrink(self) -> bool:
        """ncclCommShrink reachable through nccl4py."""
        return (self.nccl4py_nccl_version is not None and self.nccl4py_nccl_version >= NCCL_MIN_SHRINK
                and self.nccl4py_shrink)

    @property
    def nccl_grow(self) -> bool:
        """ncclCommGrow reachable through nccl4py (on the libnccl nccl4py loaded)."""
        return (self.nccl4py_nccl_version is not None and self.nccl4py_nccl_version >= NCCL_MIN_GROW
                and self.nccl4py_grow)

    def to_json(self) -> dict[str, Any]:
        return {
            "torch_version": self.torch_version,
            "num_gpus": self.num_gpus,
            "nccl_version": ".".join(map(str, self.nccl_version)) if self.nccl_version else None,
            "torch_shrink_group": self.torch_shrink_group,
            "nccl_backend_shrink": self.nccl_backend_shrink,
            "nccl4py_version": self.nccl4py_version,
            "nccl4py_nccl_version": (".".join(map(str, self.nccl4py_nccl_version))
                                     if self.nccl4py_nccl_version else None),
            "nccl_shrink": self.nccl_shrink,
            "nccl4py_shrink": self.nccl4py_can_shrink,
            "nccl_grow": self.nccl_grow,
            "store_clone": self.store_clone,
            "gloo_shrink": False,
        }


def _nccl_version() -> tuple[int, int, int] | None:
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        return None
    try:
        v = torch.cuda.nccl.version()
    except Exception:
        return None
    if isinstance(v, tuple):
        return (int(v[0]), int(v[1]), int(v[2]) if len(v) > 2 else 0)
    v = int(v)  # older torch: a code like 22809 or 2809
    return (v // 10000, (v // 100) % 100, v % 100) if v >= 10000 else (v // 1000, (v // 100) % 10, v % 100)


class _CloneProbe(dist.Store):
    """A Python store whose ``clone`` only records that torch called it."""

    def __init__(self) -> None:
        super().__init__()
        self.cloned = False

    def clone(self) -> _CloneProbe:
        self.cloned = True
        return self


def _python_store_clones() -> bool:
    """Whether c10d's ``Store::clone`` reaches a Python store's override (through a
    ``PrefixStore``, as a derived group's store is built). Side-effect free."""
    probe = _CloneProbe()
    try:
        dist.PrefixStore("probe", probe).clone()
    except (RuntimeError, AttributeError):  # "Tried to call pure virtual function", or no binding
        return False
    return probe.cloned


def probe_runtime() -> RuntimeSupport:
    """Probe torch, NCCL and nccl4py once; cheap and side-effect free."""
    nccl4py = probe_nccl4py()
    pg_nccl = getattr(dist, "ProcessGroupNCCL", None)
    return RuntimeSupport(
        torch_version=torch.__version__,
        num_gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        nccl_version=_nccl_version(),
        torch_shrink_group=hasattr(dist, "shrink_group"),
        nccl_backend_shrink=pg_nccl is not None and hasattr(pg_nccl, "shrink"),
        nccl4py_version=nccl4py.version,
        nccl4py_shrink=nccl4py.shrink,
        nccl4py_grow=nccl4py.grow,
        nccl4py_nccl_version=nccl4py.nccl_version,
        store_clone=_python_store_clones(),
    )


def _order_kept(old: MembershipView, new: MembershipView) -> bool:
    """Survivors appear in the same relative order and occupy the first ranks of ``new``."""
    old_ids = old.identities
    survivors_new = [m.identity for m in new.members if m.identity in old_ids]
    survivors_old = [m.identity for m in old.members if m.identity in new.identities]
    prefix = [m.identity for m in new.members[: len(survivors_new)]]
    return survivors_new == survivors_old and prefix == survivors_new


def choose_path(old: MembershipView | None, new: MembershipView, backend: str,
                support: RuntimeSupport, *, peer_died: bool = True) -> str:
    """The reconfiguration path for ``old -> new`` (pure: no I/O)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if old is None:
        return "build"
    # A member asked for a new communicator (its old one broke): every rank rebuilds.
    old_records = {m.identity: m for m in old.members}
    if any(m.identity in old_records and m.reform != old_records[m.identity].reform for m in new.members):
        return "rebuild"
    d = diff(old, new)
    if d.unchanged and old.member_ids == new.member_ids:
        return "unchanged"
    if backend in ("nccl", "nccl4py") and _order_kept(old, new):
        can_shrink = support.nccl_shrink if backend == "nccl" else support.nccl4py_can_shrink
        if d.removals_only and can_shrink:
            return "shrink_abort" if peer_died else "shrink"
        if d.additions_only and backend == "nccl4py" and support.nccl_grow:
            return "grow"
    return "rebuild"


def rebuild_if_formed(path: str, came_from: int | None) -> str:
    """``path`` as this rank takes it (pure): a rank that formed a communicator before (in
    epoch ``came_from``) and builds a new one rebuilds, even when nothing of the old one is
    left to reuse (a transport that broke was dropped, a formation failed). "build" is a
    rank's first communicator only: a new incarnation's, never a survivor's."""
    return "rebuild" if path == "build" and came_from is not None else path


# The paths that keep (or start from) the current communicator: each survivor must be ready.
FAST_PATHS: tuple[str, ...] = ("unchanged", "shrink", "shrink_abort", "grow")


def agree_fast_path(path: str, parents_ready: dict[str, bool]) -> str:
    """The epoch's path once every surviving member reported whether its communicator can
    be shrunk or grown from (pure). NCCL refuses to shrink a communicator whose state is an
    error (a transfer with the dead peer failed on it; a revoke does not bring it back), and
    the survivors must all take part: one unready parent means a rebuild for
    everyone, decided before anyone calls into NCCL, never a shrink that waits for a rank
    that cannot join it."""
    if path in FAST_PATHS and not all(parents_ready.values()):
        return "rebuild"
    return path


def build_stranded(build: MembershipView, latest: MembershipView | None) -> bool:
    """Whether an NCCL build of ``build``'s epoch that is past its arrival barrier must be
    given up for ``latest`` (pure): only when a newer epoch no longer holds one of its
    participants (that incarnation died or left, and NCCL's bootstrap would wait for it).

    A newer epoch that keeps every participant (a newcomer joined, a member asked for a
    reform) does not strand the build: every participant is in it and it completes within
    moments, and only a completed communicator can be freed whole. An abandoned one cannot:
    ncclCommAbort reaches neither the bootstrap root thread that ``get_unique_id`` started on
    rank 0 (it waits for every rank's check-in, listening, for the life of the process) nor
    the listener each rank opened for the root's answer (NCCL keeps it on the stack of the
    init job, which returns without closing it when aborted)."""
    return latest is not None and latest.epoch > build.epoch and not build.identities <= latest.identities
