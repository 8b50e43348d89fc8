"""The torch c10d transport: one ``ProcessGroupGloo`` or ``ProcessGroupNCCL`` per refit world.

It is separate from any training process group the user already has: it is built from a
store with an explicit rank and world size (``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` when every rank has its own GPU).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from elastic_refit.errors import TransportAborted
from elastic_refit.transport.protocol import Backend, Capabilities, P2POp

__all__ = ["C10dTransport"]

_VOTE_TAG = 0x7E57  # distinct from bucket tags (bucket indices)


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


class C10dTransport:
    """A :class:`~elastic_refit.transport.protocol.Transport` over one c10d process group.

    ``timeout_s`` bounds every wait and the vote (the collective timeout).
    """

    def __init__(self, process_group: dist.ProcessGroup, rank: int, world_size: int, *,
                 backend: Backend | str = Backend.GLOO, timeout_s: float = 30.0,
                 store: dist.Store | None = None, can_shrink: bool = False) -> None:
        backend = Backend.parse(backend)
        if backend is Backend.NCCL4PY:
            raise ValueError("C10dTransport runs gloo or nccl process groups, not nccl4py communicators")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.process_group = process_group
        self._rank = rank
        self._world_size = world_size
        self.timeout_s = float(timeout_s)
        # Keep the store alive as long as the group: a Python store collected while C++
        # still uses it fails every call (DESIGN.md, known pitfalls).
        self._store = store
        self._aborted = False
        device = (torch.device("cpu") if backend is Backend.GLOO
                  else torch.device("cuda", torch.cuda.current_device()))
        self._capabilities = Capabilities(backend, device, can_shrink=can_shrink, can_grow=False)
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
            nccl_options = dist.ProcessGroupNCCL.Options()
            nccl_options._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, world_size, nccl_options)
        else:
            raise ValueError("C10dTransport runs gloo or nccl process groups, not nccl4py communicators")
        return cls(pg, rank, world_size, backend=backend, timeout_s=timeout_s, store=store)

    # ---- the protocol ------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @property
    def device(self) -> torch.device:
        return self._capabilities.device

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    @property
    def aborted(self) -> bool:
        return self._aborted

    def post(self, ops: Sequence[P2POp]) -> _Works:
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
                    f"rank {self.rank}: {op.op} with rank {op.peer} failed: {_first_line(exc)}",
                    rank=self.rank, peer=op.peer, phase=op.op,
                ) from exc
        return _Works(works)

    def wait(self, work, peer: int, what: str) -> None:
        try:
            self._wait_raw(work)
        except TransportAborted:
            raise
        except Exception as exc:  # c10d raises RuntimeError/DistBackendError subclasses
            raise TransportAborted(
                f"rank {self.rank}: {what} with rank {peer} failed: {_first_line(exc)}",
                rank=self.rank, peer=peer, phase=what,
            ) from exc

    def vote(self, ok: bool, participants: Sequence[int] | None = None) -> bool:
        """With ``participants`` (a subset of the world) the vote runs point-to-point through
        the lowest participant, so ranks outside the refit are not involved."""
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=self.device)
        try:
            if participants is None or len(set(participants)) == self.world_size:
                self._wait_raw(self.process_group.allreduce([flag]))
            else:
                members = sorted(set(participants))
                root = members[0]
                if self.rank == root:
                    others = [torch.zeros_like(flag) for _ in members[1:]]
                    for peer, buf in zip(members[1:], others, strict=True):
                        self._wait_raw(self.process_group.recv([buf], peer, _VOTE_TAG))
                    flag += sum(int(b.item()) for b in others)
                    for peer in members[1:]:
                        self._wait_raw(self.process_group.send([flag], peer, _VOTE_TAG))
                else:
                    self._wait_raw(self.process_group.send([flag], root, _VOTE_TAG))
                    self._wait_raw(self.process_group.recv([flag], root, _VOTE_TAG))
        except Exception as exc:
            raise TransportAborted(
                f"rank {self.rank}: completion vote failed: {_first_line(exc)}", rank=self.rank, phase="vote"
            ) from exc
        return int(flag.item()) == 0

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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
