"""The communicator lifecycle across epochs: build, shrink, grow, abort-and-rebuild.

One communicator spans every rank of an epoch, ranked in the view's member order. On a new
epoch :meth:`CommunicatorManager.reconfigure` takes the cheapest path the installed runtime
supports (:mod:`elastic_refit.membership.comm_paths`: shrink on removals, grow on additions,
otherwise, and always for gloo, rebuild under ``store/{epoch}/``). On NCCL every rank takes
the path rank 0 of the epoch picked (``path-{backend}/`` in the epoch's store), and rank 0
keeps the communicator only when every survivor reported it ready. Transports, and the
nccl4py calls of the lifecycle, come from the transport package's factory
(:mod:`elastic_refit.transport.factory`); this module names no concrete transport.

Every path is timed and logged as ``comm.reconfigured`` with the epoch the rank's previous
communicator belonged to (``from_epoch``): "build" is an incarnation's first communicator
only, and a rank whose communicator was torn down before the new epoch came (a broken gloo
transport, a formation that failed) rebuilds from its epoch. Aborts run under a watchdog
thread so a wedged backend cannot hang the runtime; a communicator whose abort times out
is parked (never destroyed on the caller's thread) and logged as ``comm.abort.timed_out``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from elastic_refit.membership.client import EtcdClient
from elastic_refit.membership.comm_paths import (
    FAST_PATHS,
    NCCL_MIN_SHRINK,
    RuntimeSupport,
    agree_fast_path,
    build_stranded,
    choose_path,
    probe_runtime,
    rebuild_if_formed,
)
from elastic_refit.membership.config import MembershipConfig
from elastic_refit.membership.errors import CommunicatorError, MembershipLost, StoreTimeout
from elastic_refit.membership.rendezvous import (
    GLOO_PASSIVE_CONNECT_FACTOR,
    GlooRendezvousStore,
    arrive,
    confirm_built,
)
from elastic_refit.membership.store import EtcdStore
from elastic_refit.membership.view import MembershipView, diff

from elastic_refit.errors import drop_frames
from elastic_refit.log import get_logger
from elastic_refit.transport.factory import (
    gloo_group,
    grow_nccl4py,
    init_nccl4py,
    make_transport,
    nccl4py_parent_state,
    nccl_group,
    release_deferred_mappings,
    shrink_nccl4py,
    with_direct_reads,
)
from elastic_refit.transport.protocol import Backend, Transport, abort_with_watchdog

# The path decisions are comm_paths'; they stay importable from here, where callers look.
__all__ = ["NCCL_MIN_SHRINK", "Communicator", "CommunicatorManager", "ReconfigureResult", "RuntimeSupport",
           "abort_with_watchdog", "agree_fast_path", "build_stranded", "choose_path", "probe_runtime",
           "rebuild_if_formed"]


# ---------------------------------------------------------------- communicator
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
                 latest_view: Callable[[], MembershipView | None] | None = None,
                 direct_reads_device: torch.device | str | None = None):
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
        # Members on one host read each other's memory on this CUDA device (CUDA IPC), the
        # communicator carries the rest (None: every byte through the communicator).
        self.direct_reads_device = None if direct_reads_device is None else torch.device(direct_reads_device)
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
                if self.current is not None:
                    abort_s = self._abort_current("rebuild", wait=not self._aborts_aside())
                t1 = time.monotonic()
                self.current = self._build(new_view, path)
                build_s = time.monotonic() - t1
        except (CommunicatorError, MembershipLost):
            raise
        except Exception as exc:
            if path not in ("shrink", "shrink_abort", "grow"):
                raise CommunicatorError(
                    f"{path} of epoch {new_view.epoch} failed on {self.member_id}: {exc}") from exc
            abort_s, build_s = self._fall_back(path, new_view, exc, abort_s)
            path = "rebuild"
        assert self.current is not None
        self.current.transport = self._transport_of(self.current, tuple(m.host for m in new_view.members))
        seconds = time.monotonic() - t0
        self.formed_epoch = new_view.epoch
        self.log.info("comm.reconfigured", path=path, epoch=new_view.epoch, from_epoch=came_from,
                      num_ranks=new_view.num_ranks, rank=new_view.rank_of(self.member_id),
                      seconds=round(seconds, 4), abort_seconds=round(abort_s, 4),
                      build_seconds=round(build_s, 4))
        return ReconfigureResult(path, new_view.epoch, seconds, abort_s, build_s, self.current.transport,
                                 self.current.rank, self.current.size)

    def _fall_back(self, path: str, view: MembershipView, exc: Exception, abort_s: float) -> tuple[float, float]:
        """A fast path that failed (peer gone mid-shrink, API mismatch) falls back to a
        rebuild of ``view``'s epoch once, unless a newer epoch exists (a grow's newcomer
        killed): that epoch's rebuild is the way on, and this one's rendezvous would wait for
        the dead. Returns (abort, build) seconds."""
        self.log.warning("comm.fast_path.failed", path=path, epoch=view.epoch, error=repr(exc)[:300])
        drop_frames(exc)  # handled: its frames must not keep the old communicator alive
        abort_s += self._abort_current("fallback", wait=not self._aborts_aside())
        if self.superseded is not None and self.superseded(view.epoch):
            raise CommunicatorError(f"{path} of epoch {view.epoch} failed on {self.member_id}, and a newer "
                                    f"epoch supersedes it: {exc}") from None
        t1 = time.monotonic()
        self.current = self._build(view, "rebuild")
        return abort_s, time.monotonic() - t1

    @property
    def store(self) -> EtcdStore | None:
        """The current epoch's rendezvous store (``store/{epoch}/`` in etcd)."""
        return self.current.store if self.current is not None else None

    def close(self) -> None:
        """Abort the current communicator and wait for every abort in flight up to the epoch
        deadline: a close has no recovery to hurry (the 1 s watchdog's job), and a running
        abort holds its sockets (a loaded H200's outlived 1 s in a process that lived on)."""
        self._close_transport()
        if self.current is not None:
            self._abort_current("close", wait=False)
        deadline = time.monotonic() + self.config.epoch_deadline_s
        for thread in self._reaping:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name.removeprefix("comm-") for t in self._reaping if t.is_alive()]
        if alive:
            self.log.error("comm.abort.timed_out", what=",".join(alive), timeout_s=self.config.epoch_deadline_s)
        self._reaping.clear()
        # IPC mappings a faulted transport deferred (its kernel was stuck on a dead peer):
        # the communicator is aborted now, so that work ends and they can go.
        left = release_deferred_mappings(max(0.0, deadline - time.monotonic()))
        if left:
            self.log.error("comm.ipc.release_timed_out", mappings=left, timeout_s=self.config.abort_timeout_s)

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
        under a transfer) cannot either: NCCL refuses to shrink or grow from it and a revoke
        does not clear it, so the epoch rebuilds."""
        comm = self.current
        if comm is None or comm.backend != Backend.NCCL4PY:
            return comm is not None and not broken
        state = nccl4py_parent_state(comm.pg, self.config.abort_timeout_s)
        if state != 0:
            self.log.info("comm.parent.broken", epoch=comm.epoch, state=state)
        return state == 0

    def _transport_of(self, comm: Communicator, hosts: tuple[str, ...]) -> Transport:
        """The epoch's transport over ``comm`` (a new one per epoch: the previous epoch's
        was closed, and with it every reference outside this manager, IPC mappings
        included); routed by host (``hosts``, in rank order) when direct reads are on."""
        if comm.backend == Backend.NCCL4PY:
            transport = make_transport(comm.backend, comm.pg, comm.rank, comm.size,
                                       timeout_s=self.transport_timeout_s, device=self.device,
                                       can_shrink=self.support.nccl4py_can_shrink, can_grow=self.support.nccl_grow)
        else:
            transport = make_transport(comm.backend, comm.pg, comm.rank, comm.size,
                                       timeout_s=self.transport_timeout_s, store=comm.pg_store,
                                       can_shrink=comm.backend == Backend.NCCL and self.support.nccl_shrink)
        if self.direct_reads_device is None:
            return transport
        return with_direct_reads(transport, comm.store, hosts, device=self.direct_reads_device)

    def _close_transport(self) -> None:
        # The watchdog must hold the last reference to an old process group, so that its
        # destructor never runs (and blocks) on the runtime's thread.
        if self.current is not None and self.current.transport is not None:
            self.current.transport.close()
            self.current.transport = None

    def _aborts_aside(self) -> bool:
        """Whether the current communicator's abort may run beside the next one's build: an
        nccl4py communicator's abort waits for its kernels stuck on a dead peer (~0.5 s,
        measured on the H100), and NCCL lets another communicator form meanwhile. A c10d
        group's is quick and stays in line."""
        return self.current is not None and self.current.backend == Backend.NCCL4PY

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
        the epoch is there (see :func:`~elastic_refit.membership.rendezvous.arrive`)."""
        arrive(self.client, self._store(view, namespace),
               f"arrived/{self.member_id}/{view.member(self.member_id).incarnation}",
               [f"arrived/{m.member_id}/{m.incarnation}" for m in view.members])

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
                pg_store = GlooRendezvousStore(self.client, self.job, view.epoch, namespace=f"comm-{self.backend}",
                                                timeout=timedelta(seconds=connect))
                try:
                    pg = gloo_group(pg_store, rank, view.num_ranks, timeout_s=connect / GLOO_PASSIVE_CONNECT_FACTOR,
                                    interface=self.bind_interface)
                except BaseException:
                    self._built(view, ok=False)  # peers waiting for this rank go on at once
                    raise
                pg._set_default_timeout(collective)
                self._built(view, ok=True)
            elif self.backend == "nccl":
                self._arrive(view, f"comm-{self.backend}")
                # torch's own waits (init, a group's end) bounded like a transfer
                pg = nccl_group(store, rank, view.num_ranks, timeout=collective, device=self.device,
                                wait_bound_s=self.transport_timeout_s)
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
        """After this rank's gloo connect: :func:`confirm_built`, its waits bounded by the
        transport timeout and given up once a newer epoch dropped a participant."""
        stranded = self._stranded(view)
        confirm_built(self._store(view, f"comm-{self.backend}", cancellable=stranded is not None, cancel=stranded,
                                  timeout_s=self.transport_timeout_s), view, self.member_id, ok=ok, log=self.log)

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
            # The parent is spent once the child exists, and the child shares nothing with it:
            # its abort (ncclCommAbort waits ~0.5-0.8 s for NCCL's proxy) runs beside the new
            # epoch's first operations, as a shrink's parent's does. Inline, it made an
            # existing rank's grow take p50 1.19 s against 0.39 s on the newcomer's side
            # (126 grows in the H100 kill chaos).
            self._abort_current("grow_parent", wait=False)
        self.current = Communicator(new.epoch, self.backend, rank, new.num_ranks,
                                    new.member_ids, comm, store, self.device, "grow", pg_store=store)
        return time.monotonic() - t0
