"""The communicator lifecycle across epochs: build, shrink, grow, abort-and-rebuild.

One communicator spans every rank of an epoch, ranked in the view's member order.
On a new epoch :meth:`CommunicatorManager.reconfigure` picks the cheapest path the
installed runtime supports:

- removals only, NCCL >= 2.27 with a backend that can shrink -> ``shrink``
  (``shrink_abort`` when a peer died: in-flight work on the parent is aborted first);
  afterwards the parent is aborted, not destroyed;
- additions only, NCCL >= 2.29.2 with nccl4py's grow -> ``grow`` (existing ranks keep
  their numbers, newcomers get the unique id through the epoch's etcd store);
- anything else, and always for gloo -> ``rebuild``: abort the old communicator and
  rendezvous a new one under ``store/{epoch}/``.

On NCCL every rank takes the path rank 0 of the epoch picked (``path-{backend}/`` in the
epoch's store), and rank 0 picks a path that keeps the communicator only when every survivor
reported it ready (:func:`agree_fast_path`): NCCL will not shrink a communicator whose
state is an error unless a revoke brings it back, and torch's ``ProcessGroupNCCL.shrink``
needs a store it can clone, which the etcd store is not.

Every path is timed and logged as ``comm.reconfigured`` with the epoch the rank's previous
communicator belonged to (``from_epoch``): "build" is an incarnation's first communicator
only, and a rank whose communicator was torn down before the new epoch came (a broken gloo
transport, a formation that failed) rebuilds from its epoch. Aborts run under a watchdog
thread so a wedged backend cannot hang the runtime; a communicator whose abort times out
is parked (never destroyed on the caller's thread) and logged as ``comm.abort.timed_out``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from elastic_refit.membership.client import Compare, Delete, EtcdClient
from elastic_refit.membership.config import MembershipConfig
from elastic_refit.membership.errors import CommunicatorError, MembershipLost, StoreTimeout
from elastic_refit.membership.store import EtcdStore
from elastic_refit.membership.view import MembershipView, diff

from elastic_refit.errors import brief
from elastic_refit.log import get_logger
from elastic_refit.transport.factory import (
    grow_nccl4py,
    init_nccl4py,
    make_transport,
    probe_nccl4py,
    revive_nccl4py,
    shrink_nccl4py,
)
from elastic_refit.transport.protocol import Backend, Transport, abort_with_watchdog

BACKENDS: tuple[str, ...] = tuple(b.value for b in Backend)
PATHS: tuple[str, ...] = ("build", "unchanged", "shrink", "shrink_abort", "grow", "rebuild")
NCCL_MIN_SHRINK = (2, 27, 0)
NCCL_MIN_GROW = (2, 29, 2)
# gloo's connect (torch 2.13 and 2.11) waits for a peer that is to connect to it (the passive
# side of a pair) five times its context timeout, whatever that peer does meanwhile: measured
# 3 s -> 15 s, 4 s -> 20 s, 6 s -> 30 s, and gloo leaves the listener's timeout a "TODO". A
# build therefore gives gloo a fifth of the connect bound, and its rendezvous store keeps the
# whole bound for the address keys (see _GlooRendezvousStore).
_GLOO_PASSIVE_CONNECT_FACTOR = 5
# etcd allows 128 operations per transaction by default (--max-txn-ops): a barrier of more
# ranks cannot be read in one transaction, and falls back to leaving by a plain delete.
_MAX_BARRIER_COMPARES = 100


# --------------------------------------------------------------------- probing
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
    # torch's ProcessGroupNCCL.shrink clones the group's store (c10d::Store::clone), which a
    # store written in Python, like EtcdStore, cannot give: on torch 2.11 it fails with "Tried
    # to call pure virtual function c10d::Store::clone". Groups built on such a store rebuild.
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
    error (a transfer with the dead peer failed on it) unless a revoke brought it back to
    success, and the survivors must all take part: one unready parent means a rebuild for
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


# ---------------------------------------------------------------- communicator
class _GlooRendezvousStore(EtcdStore):
    """The store a gloo group is built with: its waits keep this store's own timeout. gloo
    passes its context timeout to every wait for a peer's address key, and a build sets that
    to a fifth of the connect bound (``_GLOO_PASSIVE_CONNECT_FACTOR``): an address written a
    moment late by a slow but live peer must not fail the build."""

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        super().wait(keys)


@dataclass(slots=True)
class Communicator:
    """One epoch's communicator, owned by the manager. ``pg`` is a torch c10d backend (or
    an nccl4py comm); everything above membership sees it only as a :class:`Transport`.

    ``store`` is the epoch's rendezvous store (``store/{epoch}/``), fresh every epoch so that
    keys of an earlier epoch (its attempts) are never read as this one's. ``pg_store`` is the
    store ``pg`` was built with, kept here on purpose: a process group must never outlive
    the Python half of its store, and a shrunk group lives on in later epochs.
    """

    epoch: int
    backend: str
    rank: int
    size: int
    member_ids: tuple[str, ...]
    pg: Any
    store: EtcdStore | None
    device: torch.device
    path: str
    transport: Transport | None = None
    pg_store: EtcdStore | None = None


@dataclass(frozen=True, slots=True)
class ReconfigureResult:
    """Which path ran and how long each part took (seconds)."""

    path: str
    epoch: int
    seconds: float
    abort_seconds: float
    build_seconds: float
    transport: Transport
    rank: int
    num_ranks: int


class CommunicatorManager:
    """Owns this rank's communicator and moves it from epoch to epoch.

    >>> mgr = CommunicatorManager(client, "job", "t0", backend="gloo")  # doctest: +SKIP
    >>> mgr.reconfigure(None, view1)      # build
    >>> mgr.reconfigure(view1, view2)     # shrink / grow / rebuild, timed and logged
    """

    def __init__(self, client: EtcdClient, job: str, member_id: str, *, backend: str = "gloo",
                 config: MembershipConfig | None = None, device: torch.device | str | None = None,
                 support: RuntimeSupport | None = None,
                 superseded: Callable[[int], bool] | None = None,
                 transport_timeout_s: float | None = None, bind_interface: str | None = None,
                 latest_view: Callable[[], MembershipView | None] | None = None):
        backend = Backend.parse(backend).value
        self.client = client
        self.job = job
        self.member_id = member_id
        self.backend = backend
        self.config = config or MembershipConfig()
        # One send/recv may wait a lease TTL plus a second: longer than a slow but live peer
        # needs, and a dead one resets its connections at once (a stopped one is out of the
        # membership within its TTL).
        self.transport_timeout_s = (self.config.ttl_s + 1.0 if transport_timeout_s is None
                                    else float(transport_timeout_s))
        self.support = support or probe_runtime()
        if device is None:
            device = "cpu" if backend == "gloo" else f"cuda:{torch.cuda.current_device()}"
        self.device = torch.device(device)
        self.current: Communicator | None = None
        # The epoch of the last communicator this rank formed (None before its first). A
        # rank whose communicator was torn down meanwhile (a transport that broke, a
        # formation that failed) still rebuilds from it: "build" is a rank's first only.
        self.formed_epoch: int | None = None
        # Aborts of spent parents (after a shrink) run beside the next epoch's first work;
        # close() joins them.
        self._reaping: list[threading.Thread] = []
        # superseded(epoch): a newer epoch exists, so a rendezvous for `epoch` is futile.
        self.superseded = superseded
        # latest_view(): the newest epoch's view this member knows of. An NCCL build past its
        # arrival barrier is given up only when that view dropped one of its participants
        # (build_stranded); without it such a build is bounded by the epoch deadline only.
        self.latest_view = latest_view
        self.bind_interface = bind_interface  # gloo's device binds here (None: the default)
        self.log = get_logger(job=job, member_id=member_id, backend=backend)
        self.log.info("comm.runtime.probed", **self.support.to_json())

    # ------------------------------------------------------------------ public
    def reconfigure(self, old_view: MembershipView | None, new_view: MembershipView, *,
                    peer_died: bool = True, broken: bool = False) -> ReconfigureResult:
        """Move this rank's communicator from ``old_view`` to ``new_view``; ``broken``: an
        operation failed on the current one (a c10d group is then rebuilt, never reused).

        Raises :class:`MembershipLost` if this member is not in ``new_view`` (its old
        communicator is aborted first) and :class:`CommunicatorError` if the new
        communicator could not be formed before the epoch deadline.
        """
        t0 = time.monotonic()
        self._close_transport()
        if self.member_id not in new_view:
            self._abort_current("not_a_member")
            raise MembershipLost(f"member {self.member_id!r} is not in epoch {new_view.epoch}")
        came_from = old_view.epoch if old_view is not None else self.formed_epoch
        if self.current is None:
            old_view = None
        path = rebuild_if_formed(choose_path(old_view, new_view, self.backend, self.support, peer_died=peer_died),
                                 came_from)
        # gloo always rebuilds (each rank gets there on its own, and an agreement round would
        # only widen the window in which a newer epoch strands a rendezvous half done).
        if self.backend != Backend.GLOO:
            try:
                path = self._agree_path(old_view, new_view, path, broken=broken, came_from=came_from)
            except StoreTimeout as exc:
                raise CommunicatorError(f"no reconfiguration path agreed for epoch {new_view.epoch} on "
                                        f"{self.member_id}: {exc}") from exc
        abort_s = build_s = 0.0
        try:
            if path == "unchanged":
                # The communicator stays; its store does not: attempts, plan and done keys of
                # this epoch live under store/{epoch}/, where the runtime's epoch watch looks.
                self.current.epoch = new_view.epoch  # type: ignore[union-attr]
                self.current.store = self._store(new_view, f"comm-{self.backend}")  # type: ignore[union-attr]
            elif path in ("shrink", "shrink_abort"):
                abort_s, build_s = self._shrink(old_view, new_view, abort=path == "shrink_abort")
            elif path == "grow":
                build_s = self._grow(old_view, new_view)
            else:
                abort_s = self._abort_current("rebuild") if self.current is not None else 0.0
                t1 = time.monotonic()
                self.current = self._build(new_view, path)
                build_s = time.monotonic() - t1
        except (CommunicatorError, MembershipLost):
            raise
        except Exception as exc:
            # A fast path that fails (peer gone mid-shrink, API mismatch) falls back once.
            if path in ("shrink", "shrink_abort", "grow"):
                self.log.warning("comm.fast_path.failed", path=path, epoch=new_view.epoch,
                                 error=repr(exc)[:300])
                abort_s += self._abort_current("fallback")
                t1 = time.monotonic()
                self.current = self._build(new_view, "rebuild")
                build_s = time.monotonic() - t1
                path = "rebuild"
            else:
                raise CommunicatorError(
                    f"{path} of epoch {new_view.epoch} failed on {self.member_id}: {exc}") from exc
        assert self.current is not None
        self.current.transport = self._transport_of(self.current)
        seconds = time.monotonic() - t0
        self.formed_epoch = new_view.epoch
        self.log.info("comm.reconfigured", path=path, epoch=new_view.epoch, from_epoch=came_from,
                      num_ranks=new_view.num_ranks, rank=new_view.rank_of(self.member_id),
                      seconds=round(seconds, 4), abort_seconds=round(abort_s, 4),
                      build_seconds=round(build_s, 4))
        return ReconfigureResult(path, new_view.epoch, seconds, abort_s, build_s, self.current.transport,
                                 self.current.rank, self.current.size)

    @property
    def store(self) -> EtcdStore | None:
        """The current epoch's rendezvous store (``store/{epoch}/`` in etcd)."""
        return self.current.store if self.current is not None else None

    def close(self) -> None:
        """Abort the current communicator (bounded by the watchdog)."""
        self._close_transport()
        if self.current is not None:
            self._abort_current("close")
        deadline = time.monotonic() + self.config.abort_timeout_s
        for thread in self._reaping:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._reaping):
            self.log.error("comm.abort.timed_out", what="shrink_parent", timeout_s=self.config.abort_timeout_s)
        self._reaping.clear()

    # --------------------------------------------------------------- internals
    def _agree_path(self, old: MembershipView | None, view: MembershipView, mine: str, *,
                    broken: bool = False, came_from: int | None = None) -> str:
        """Every rank takes the path rank 0 of the epoch chose: a newcomer has no previous
        view (it would build while the others grow), and ranks whose probes differ must not
        split between a fast path and a rebuild. Rank 0 of a grow or shrink is a survivor;
        before it picks one it hears from every survivor whether its communicator is ready
        (:func:`agree_fast_path`)."""
        store = self._store(view, f"path-{self.backend}")
        # Every rank answers (a newcomer or a rank whose communicator is gone with "0"), so
        # rank 0 never waits for a report that is not coming.
        store.set(f"ready/{self.member_id}", "1" if self._parent_ready(broken) else "0")
        if view.rank_of(self.member_id) == 0:
            if mine in FAST_PATHS and old is not None:
                survivors = [m.member_id for m in view.members if m.identity in old.identities]
                mine = agree_fast_path(mine, {m: store.get(f"ready/{m}") == b"1" for m in survivors})
            store.set("path", mine)
            agreed = mine
        else:
            agreed = store.get("path").decode()
        if agreed in ("shrink", "shrink_abort", "unchanged") and self.current is None:
            raise CommunicatorError(f"epoch {view.epoch} takes the {agreed} path, but {self.member_id} has no "
                                    "communicator to take it from")
        if agreed in ("build", "rebuild"):  # each rank says which it is: a newcomer builds
            return rebuild_if_formed("build", came_from)
        return agreed

    def _parent_ready(self, broken: bool) -> bool:
        """Whether the current communicator can be kept, shrunk or grown from. A c10d group
        that failed an operation cannot. An nccl4py one whose state is an error (a peer died
        under a transfer) is revoked first: once quiescent, a revoked communicator is back
        at success and management calls may proceed."""
        comm = self.current
        if comm is None or comm.backend != Backend.NCCL4PY:
            return comm is not None and not broken
        state, revoked = revive_nccl4py(comm.pg, self.config.abort_timeout_s)
        if revoked:
            self.log.info("comm.parent.revoked", epoch=comm.epoch, state=state)
        return state == 0

    def _transport_of(self, comm: Communicator) -> Transport:
        """The epoch's transport over ``comm`` (a new one per epoch: the previous epoch's
        was closed, and with it every reference outside this manager)."""
        if comm.backend == Backend.NCCL4PY:
            return make_transport(comm.backend, comm.pg, comm.rank, comm.size, timeout_s=self.transport_timeout_s,
                                  device=self.device, can_shrink=self.support.nccl4py_can_shrink,
                                  can_grow=self.support.nccl_grow)
        return make_transport(comm.backend, comm.pg, comm.rank, comm.size, timeout_s=self.transport_timeout_s,
                              store=comm.pg_store,
                              can_shrink=comm.backend == Backend.NCCL and self.support.nccl_shrink)

    def _close_transport(self) -> None:
        # The watchdog must hold the last reference to an old process group, so that its
        # destructor never runs (and blocks) on the runtime's thread.
        if self.current is not None and self.current.transport is not None:
            self.current.transport.close()
            self.current.transport = None

    def _abort_current(self, why: str, *, wait: bool = True) -> float:
        self._close_transport()
        comm, self.current = self.current, None
        if comm is None:
            return 0.0
        pg, comm.pg = comm.pg, None
        self._reaping = [t for t in self._reaping if t.is_alive()]
        return abort_with_watchdog(pg, self.config.abort_timeout_s, self.log, what=why,
                                   reaping=None if wait else self._reaping)

    def _store(self, view: MembershipView, namespace: str, *, cancellable: bool = True,
               timeout_s: float | None = None, cancel: Callable[[], bool] | None = None) -> EtcdStore:
        """``cancel``: when waits give up early (default: once a newer epoch exists;
        nothing but the timeout when ``cancellable`` is False)."""
        # Rendezvous may take up to the epoch deadline (peers learn of the epoch at
        # slightly different times); collectives afterwards use the collective timeout.
        if cancel is None and cancellable:
            cancel = self._futile(view.epoch)
        seconds = self.config.epoch_deadline_s if timeout_s is None else timeout_s
        return EtcdStore(self.client, self.job, view.epoch, namespace=namespace,
                         timeout=timedelta(seconds=seconds), cancel=cancel)

    def _arrive(self, view: MembershipView, namespace: str) -> None:
        """Mark this rank's arrival at the epoch's rendezvous and wait until every rank of
        the epoch is there (up to the epoch deadline; given up at once when a newer epoch
        supersedes this one). gloo's connect cannot be cancelled: a rank that left it half
        done (it had written its address, then gave up for a newer epoch) stranded a peer
        in connect for the whole rendezvous timeout, and every later epoch waited for that
        peer. Past this barrier every peer is here and connects within moments."""
        store = self._store(view, namespace)
        mine = f"arrived/{self.member_id}/{view.member(self.member_id).incarnation}"
        keys = [f"arrived/{m.member_id}/{m.incarnation}" for m in view.members]
        store.set(mine, "1")
        consistent = len(keys) <= _MAX_BARRIER_COMPARES
        while True:
            try:
                store.wait(keys)
            except StoreTimeout:
                if consistent and self._barrier_complete(store, keys, leave=mine):
                    return  # everyone arrived before we could leave: a peer may be connecting
                if not consistent:  # peers still waiting must not count this rank as arrived
                    with contextlib.suppress(Exception):
                        store.delete_key(mine)
                raise
            # The wait read the keys one by one: a peer may have left between two reads.
            # Pass only on one consistent read, so that a peer's leave (below) and our pass
            # can never both happen.
            if not consistent or self._barrier_complete(store, keys):
                return

    def _barrier_complete(self, store: EtcdStore, keys: list[str], *, leave: str | None = None) -> bool:
        """One transaction: are all ``keys`` there (at one revision)? With ``leave``, delete
        that key in the same transaction when they are not: a rank leaves the barrier only
        when no peer can have seen it complete, so nobody is stranded in gloo's connect (a
        peer that passed it waits there for the whole connect timeout)."""
        res = self.client.txn([Compare(store._k(k), "create", ">", 0) for k in keys], [],
                              [Delete(store._k(leave))] if leave is not None else [])
        return res.succeeded

    def _build(self, view: MembershipView, path: str) -> Communicator:
        rank = view.rank_of(self.member_id)
        store = pg_store = self._store(view, f"comm-{self.backend}")
        collective = timedelta(seconds=self.config.collective_timeout_s)
        try:
            if self.backend == "gloo":
                self._arrive(view, f"comm-{self.backend}")
                # Every peer has arrived: the connect is bounded like one transfer (a peer
                # that vanishes now fails it in seconds) and is no longer cancelled, since
                # leaving it half done would strand the peers that already read our address.
                # gloo waits five times its timeout for a peer that is to connect to us: a
                # peer that gave up (its address key came too late for it) held every rank
                # that had read its address for 15 s (restart+kill, 15.7 s, 2026-12-03).
                connect = self.transport_timeout_s
                pg_store = _GlooRendezvousStore(self.client, self.job, view.epoch, namespace=f"comm-{self.backend}",
                                                timeout=timedelta(seconds=connect))
                options = dist.ProcessGroupGloo._Options()
                options._timeout = timedelta(seconds=connect / _GLOO_PASSIVE_CONNECT_FACTOR)
                options._devices = [dist.ProcessGroupGloo.create_device(interface=self.bind_interface)
                                    if self.bind_interface else dist.ProcessGroupGloo.create_default_device()]
                try:
                    pg = dist.ProcessGroupGloo(pg_store, rank, view.num_ranks, options)
                except BaseException:
                    self._built(view, ok=False)  # peers waiting for this rank go on at once
                    raise
                pg._set_default_timeout(collective)
                self._built(view, ok=True)
            elif self.backend == "nccl":
                self._arrive(view, f"comm-{self.backend}")
                pg = self._build_nccl(store, rank, view.num_ranks, collective)
            else:
                # Only once every rank is here: a rank that dies before it arrives (killed as
                # it rejoins) must not leave NCCL's bootstrap (the unique id's root thread,
                # each rank's listening sockets) waiting for it for good.
                self._arrive(view, f"comm-{self.backend}")
                pg = self._build_nccl4py(view, rank)
        except StoreTimeout as exc:
            raise CommunicatorError(
                f"rendezvous of epoch {view.epoch} timed out on {self.member_id}: {exc}") from exc
        except RuntimeError as exc:
            raise CommunicatorError(
                f"building the {self.backend} communicator of epoch {view.epoch} failed on "
                f"{self.member_id}: {exc}") from exc
        return Communicator(view.epoch, self.backend, rank, view.num_ranks, view.member_ids,
                            pg, store, self.device, path, pg_store=pg_store)

    def _built(self, view: MembershipView, *, ok: bool) -> None:
        """After this rank's gloo connect: say so, and (when it succeeded) wait until every
        rank of the epoch is through its own, before anyone may tear the group down.

        A rank that finished gloo's connectFullMesh and moved on to a newer epoch at once
        (aborting the group) stranded a peer still inside it: gloo's connect retries a
        vanished listener for ~15 s, past the timeout it was given and uncancellable, and
        every later epoch's rendezvous waited for that peer (restart<ttl and restart+kill
        trials recovered in 15.3-15.6 s, 2026-12-02/03). The wait is bounded by the
        transport timeout and given up once a newer epoch dropped a participant (it will
        never say it is through); a rank whose connect failed says so too ("0"), so nobody
        waits for it. Past this point the group is complete on every rank."""
        stranded = self._stranded(view)
        store = self._store(view, f"comm-{self.backend}", cancellable=stranded is not None, cancel=stranded,
                            timeout_s=self.transport_timeout_s)
        keys = [f"built/{m.member_id}/{m.incarnation}" for m in view.members]
        try:
            store.set(keys[view.rank_of(self.member_id)], "1" if ok else "0")
            if ok:
                store.wait(keys)
        except Exception as exc:  # the group itself is fine: peers that never finish re-form later
            self.log.warning("comm.build.unconfirmed", epoch=view.epoch, error=brief(exc)
                             if str(exc) else type(exc).__name__)

    def _build_nccl(self, store, rank: int, size: int, timeout: timedelta):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        with contextlib.suppress(AttributeError):
            opts.config.blocking = 0  # non-blocking comms can be aborted mid-init
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        # Eager init binds the device now, so a broken peer shows up here, not in a refit.
        if hasattr(pg, "eager_connect_single_device"):
            pg.eager_connect_single_device(self.device)
        return pg

    def _build_nccl4py(self, view: MembershipView, rank: int):
        """Past the arrival barrier: NCCL's bootstrap starts (rank 0's root thread, every
        rank's listeners), so the unique id's read and the init give up only when a
        participant is gone (:func:`build_stranded`), never merely because a newer epoch
        exists: a build every participant is in completes, and is then freed whole."""
        torch.cuda.set_device(self.device)
        stranded = self._stranded(view)
        store = self._store(view, f"comm-{self.backend}", cancellable=stranded is not None, cancel=stranded)
        return init_nccl4py(store, rank, view.num_ranks, self.config.epoch_deadline_s, stranded)

    def _futile(self, epoch: int) -> Callable[[], bool] | None:
        """``cancel`` for waits of ``epoch``'s rendezvous: true once a newer epoch exists."""
        return (lambda: self.superseded(epoch)) if self.superseded is not None else None

    def _stranded(self, view: MembershipView) -> Callable[[], bool] | None:
        """``cancel`` for an NCCL bootstrap of ``view``'s epoch: true once a newer epoch
        dropped one of its participants (see :func:`build_stranded`)."""
        latest = self.latest_view
        return (lambda: build_stranded(view, latest())) if latest is not None else None

    def _shrink(self, old: MembershipView, new: MembershipView, *, abort: bool) -> tuple[float, float]:
        parent = self.current
        assert parent is not None
        excluded = sorted(old.rank_of(m.member_id) for m in diff(old, new).removed)
        t0 = time.monotonic()
        if self.backend == "nccl":
            flags = dist.distributed_c10d.SHRINK_ABORT if abort else 0
            child = parent.pg.shrink(excluded, flags)
        else:
            # A child that never settles is aborted there (it would leak NCCL's bootstrap
            # sockets and proxy thread) before the error reaches the fallback.
            child = shrink_nccl4py(parent.pg, excluded, abort=abort, timeout_s=self.config.epoch_deadline_s,
                                   abort_timeout_s=self.config.abort_timeout_s, cancel=self._futile(new.epoch),
                                   logger=self.log)
        build_s = time.monotonic() - t0
        # The parent is aborted, never destroyed: destroy would wait on the dead peer. The
        # child shares nothing with it (no shrink_share), so the abort (about 0.5 s on NCCL
        # 2.28.9) runs beside the new epoch's first operations instead of before them.
        abort_s = self._abort_current("shrink_parent", wait=False)
        self.current = Communicator(new.epoch, self.backend, new.rank_of(self.member_id),
                                    new.num_ranks, new.member_ids, child, self._store(new, f"comm-{self.backend}"),
                                    self.device, "shrink_abort" if abort else "shrink", pg_store=parent.pg_store)
        return abort_s, build_s

    def _grow(self, old: MembershipView | None, new: MembershipView) -> float:
        """Existing ranks keep their numbers; the grow root (rank 0, a survivor) publishes
        the communicator's grow id in the epoch's store, newcomers join with it."""
        t0 = time.monotonic()
        # The grow root's bootstrap thread waits for every rank of the new communicator
        # (newcomers too) and nothing but their check-in ends it: start it only once all of
        # them are here, and from then on give up only when one of them is gone.
        self._arrive(new, "grow")
        stranded = self._stranded(new)
        store = self._store(new, "grow")  # the epoch's store from here on (its waits: superseded)
        rank = new.rank_of(self.member_id)
        existing = self.current is not None and old is not None and self.member_id in old
        if existing:
            parent, id_store = self.current.pg, store  # type: ignore[union-attr]
        else:
            # A newcomer reads the grow root's id; it gives up only when a participant is gone.
            torch.cuda.set_device(self.device)
            parent, id_store = None, self._store(new, "grow", cancellable=stranded is not None, cancel=stranded)
        comm = grow_nccl4py(parent, new.num_ranks, rank, id_store, timeout_s=self.config.epoch_deadline_s,
                            abort_timeout_s=self.config.abort_timeout_s, cancel=stranded, logger=self.log)
        if existing:
            # The parent is spent once the child exists.
            self._abort_current("grow_parent")
        self.current = Communicator(new.epoch, self.backend, rank, new.num_ranks,
                                    new.member_ids, comm, store, self.device, "grow", pg_store=store)
        return time.monotonic() - t0
