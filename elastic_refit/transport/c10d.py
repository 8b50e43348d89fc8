"""The torch c10d transport: one ``ProcessGroupGloo`` or ``ProcessGroupNCCL`` per refit world.

It is separate from any training process group the user already has: it is built from a
store with an explicit rank and world size (``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` when every rank has its own GPU).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from elastic_refit.errors import TransportAborted
from elastic_refit.transport.protocol import Backend, Capabilities, P2POp, TransportBase, first_line

__all__ = ["NONBLOCKING_TIMEOUT_ENV", "C10dTransport", "bound_torch_nccl_waits", "nccl_process_group"]

# torch reads this once per process, at the first wait on a non-blocking communicator.
NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"


def bound_torch_nccl_waits(seconds: float) -> int | None:
    """Bound what torch's ProcessGroupNCCL waits for on a non-blocking communicator (its
    init, the end of a group, a collective's enqueue) to about ``seconds``; returns the
    bound in force (None when it is torch's default).

    NCCL connects a pair of ranks at the first group that uses it, inside ``ncclGroupEnd``:
    a blocking communicator waits there, on the caller's thread, for a peer that may have
    failed already (aborted after a failed digest check, say), for good, and no op timeout
    covers it (the work does not exist yet). A non-blocking one returns at once and torch
    polls it for ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` seconds, 30 minutes unless set. torch
    reads the variable once per process and compares whole elapsed seconds with ``>``, so
    the value is ``ceil(seconds) - 1`` (at least 1); a value already set (by the user, or an
    earlier group of this process) is kept."""
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    os.environ.setdefault(NONBLOCKING_TIMEOUT_ENV, str(max(1, math.ceil(seconds) - 1)))
    try:
        return int(os.environ[NONBLOCKING_TIMEOUT_ENV])
    except ValueError:  # torch would refuse it too; not ours to fix
        return None


def nccl_process_group(store: dist.Store, rank: int, world_size: int, *, timeout: datetime.timedelta,
                       device: torch.device, wait_bound_s: float | None = None) -> dist.ProcessGroup:
    """A ``ProcessGroupNCCL`` of ``world_size`` ranks over ``store``: ``timeout`` its op
    timeout, non-blocking where torch lets it be (so it can be aborted mid-init and its
    waits are bounded by ``wait_bound_s``, see :func:`bound_torch_nccl_waits`), connected
    eagerly on ``device`` (a broken peer shows up here, not in a refit)."""
    if wait_bound_s is not None:
        bound_torch_nccl_waits(wait_bound_s)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    with contextlib.suppress(AttributeError):
        opts.config.blocking = 0
    pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    if hasattr(pg, "eager_connect_single_device"):
        pg.eager_connect_single_device(device)
    return pg


class _Works:
    """The handles of one batch of posted operations, waited for as one."""

    __slots__ = ("works",)

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for work in self.works:
            done = work.wait(timeout) if timeout is not None else work.wait()
            if done is False:
                return False
        return True


class C10dTransport(TransportBase):
    """A :class:`~elastic_refit.transport.protocol.Transport` over one c10d process group.

    ``timeout_s`` bounds every wait and the vote (the collective timeout).
    """

    def __init__(self, process_group: dist.ProcessGroup, rank: int, world_size: int, *,
                 backend: Backend | str = Backend.GLOO, timeout_s: float = 30.0,
                 store: dist.Store | None = None, can_shrink: bool = False) -> None:
        backend = Backend.parse(backend)
        if backend is Backend.NCCL4PY:
            raise ValueError("C10dTransport runs gloo or nccl process groups, not nccl4py communicators")
        device = torch.device("cpu") if backend is Backend.GLOO else torch.device("cuda", torch.cuda.current_device())
        super().__init__(rank, world_size, Capabilities(backend, device, can_shrink=can_shrink), timeout_s)
        self.process_group = process_group
        # Keep the store alive as long as the group: a Python store collected while C++
        # still uses it fails every call (DESIGN.md, known pitfalls).
        self._store = store
        if backend is Backend.GLOO:
            # Gloo applies its context timeout to collectives (the vote) whatever wait() is
            # given, and closes a pair for good when it fires: make it this transport's timeout.
            with contextlib.suppress(AttributeError, RuntimeError):
                process_group._set_default_timeout(self.timeout)

    @classmethod
    def create(cls, store: dist.Store, rank: int, world_size: int, *, backend: Backend | str = Backend.GLOO,
               timeout_s: float = 30.0) -> C10dTransport:
        """Build the process group; every rank of the world calls this with the same store."""
        backend = Backend.parse(backend)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend is Backend.GLOO:
            pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        elif backend is Backend.NCCL:
            # The whole group's communicator now, on every rank (eagerly): batched
            # point-to-point runs on it (see post), and a rank with nothing to move must not
            # leave it half made. Non-blocking, with torch's waits on it bounded by the
            # timeout: NCCL connects a pair at its first group, and a blocking communicator
            # waits there for good for a peer that failed meanwhile (a needer whose digest
            # check failed has aborted; read from the code as the likely cause of the
            # corrupted-forward test's hang on the H200, not yet confirmed there).
            pg = nccl_process_group(store, rank, world_size, timeout=timeout,
                                    device=torch.device("cuda", torch.cuda.current_device()), wait_bound_s=timeout_s)
        else:
            raise ValueError("C10dTransport runs gloo or nccl process groups, not nccl4py communicators")
        return cls(pg, rank, world_size, backend=backend, timeout_s=timeout_s, store=store)

    # ---- the protocol ------------------------------------------------------------------
    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def post(self, ops: Sequence[P2POp]) -> tuple[_Works, ...]:
        if self.capabilities.backend is Backend.NCCL:
            return self._post_batch(ops)
        return tuple(_Works([w]) for w in self._post_each(ops))

    def _post_batch(self, ops: Sequence[P2POp]) -> tuple[_Works, ...]:
        """NCCL: one group (coalesced) per batch, on the whole group's communicator. Posted
        one by one, ProcessGroupNCCL gives each peer pair a communicator of its own, made
        lazily at the pair's first operation, which blocks until the peer makes it too; in a
        round where ranks send to one peer and receive from another, that waits in a cycle.
        Every operation of the batch gets the batch's handle."""
        if self._aborted:
            raise TransportAborted(f"rank {self.rank}: post on an aborted transport", rank=self.rank)
        pg = self.process_group
        pg._start_coalescing()  # a Backend's binding takes no device (the group's is bound)
        try:
            self._post_each(ops)
        except BaseException:
            with contextlib.suppress(Exception):  # the group must end; the first fault is the one
                pg._end_coalescing()
            raise
        # The group's end connects pairs not used before; on a non-blocking communicator
        # torch bounds it (see create) and raises, which is a transport fault here.
        try:
            work = pg._end_coalescing()
        except Exception as exc:
            peers = sorted({op.peer for op in ops})
            raise TransportAborted(f"rank {self.rank}: posting to ranks {peers} failed: {first_line(exc)}",
                                   rank=self.rank, peer=peers[0] if peers else None, phase="post") from exc
        return tuple(_Works([work]) for _ in ops)

    def _post_each(self, ops: Sequence[P2POp]) -> list:
        works = []
        for op in ops:
            if self._aborted:
                raise TransportAborted(f"rank {self.rank}: {op.op} on an aborted transport", rank=self.rank,
                                       peer=op.peer)
            try:
                if op.op == "send":
                    works.append(self.process_group.send([op.tensor], op.peer, op.tag))
                else:
                    works.append(self.process_group.recv([op.tensor], op.peer, op.tag))
            except Exception as exc:
                raise TransportAborted(
                    f"rank {self.rank}: {op.op} with rank {op.peer} failed: {first_line(exc)}",
                    rank=self.rank, peer=op.peer, phase=op.op,
                ) from exc
        return works

    def wait(self, work, peer: int, what: str) -> None:
        try:
            self._wait_raw(work)
        except TransportAborted:
            raise
        except Exception as exc:  # c10d raises RuntimeError/DistBackendError subclasses
            raise TransportAborted(
                f"rank {self.rank}: {what} with rank {peer} failed: {first_line(exc)}",
                rank=self.rank, peer=peer, phase=what,
            ) from exc

    def _allreduce_flag(self, flag: torch.Tensor) -> None:
        self._wait_raw(self.process_group.allreduce([flag]))

    def _wait_raw(self, work) -> None:
        if not work.wait(self.timeout):
            raise TimeoutError(f"no completion within {self.timeout_s} s")

    def abort(self) -> None:
        if self._aborted:
            return
        self._aborted = True
        # Best effort: the group may already be broken.
        with contextlib.suppress(Exception):
            self.process_group.abort()

    def close(self) -> None:
        """Whoever built the process group destroys it (gloo closes its sockets only when the
        last reference goes); a closed transport may outlive its communicator, e.g. in the
        traceback of a latched error, without keeping those sockets open."""
        self._aborted = True
        self.process_group = None  # type: ignore[assignment]
        self._store = None
