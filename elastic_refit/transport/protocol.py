"""The transport seam: what the executor, the baseline and the runtime need of a communicator.

A :class:`Transport` moves flat byte buffers between the ranks of one refit world. It
posts batches of point-to-point operations (:meth:`Transport.post`), waits for them with
a bound (:meth:`Transport.wait`), runs the end-of-refit vote, and can be aborted (peers
blocked on this rank fail instead of hanging) and closed. Capability flags say what the
communicator behind it can do when membership changes.

Implementations: :mod:`elastic_refit.transport.c10d` (torch ProcessGroupGloo /
ProcessGroupNCCL) and :mod:`elastic_refit.transport.nccl` (nccl4py), made by
:mod:`elastic_refit.transport.factory` (callers never name a concrete transport). The test toolkit wraps any transport to inject faults
(the test toolkit's ``FaultyTransport``); nothing patches a transport.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from elastic_refit.errors import TransportAborted
from elastic_refit.transport.backend import Backend

__all__ = ["Backend", "Capabilities", "P2POp", "Transport", "TransportBase", "Work", "post_recv", "post_send"]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What the communicator behind a transport can do."""

    backend: Backend
    device: torch.device
    can_shrink: bool = False
    can_grow: bool = False


@dataclass(frozen=True, slots=True)
class P2POp:
    """One send or receive of a flat buffer to or from ``peer``; ``tag`` orders messages
    between one pair (gloo matches on it, NCCL on posting order)."""

    op: str
    tensor: torch.Tensor
    peer: int
    tag: int = 0

    def __post_init__(self) -> None:
        if self.op not in ("send", "recv"):
            raise ValueError(f"op must be 'send' or 'recv', got {self.op!r}")
        if self.peer < 0:
            raise ValueError(f"peer must be >= 0, got {self.peer}")


class Work(Protocol):
    """A handle of posted operations."""

    def wait(self, timeout: object = ...) -> bool | None: ...


@runtime_checkable
class Transport(Protocol):
    """Point-to-point byte movement plus a vote over one refit world."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def aborted(self) -> bool:
        """Whether the transport was aborted or closed (it cannot be used again)."""
        ...

    def post(self, ops: Sequence[P2POp]) -> tuple[Work, ...]:
        """Post ``ops`` together (one group where the backend batches) and return a handle
        per operation (the handles of one group may complete together).
        A send sees every write the caller queued on its current CUDA stream before the call
        (no synchronisation needed); raises ``TransportAborted`` on an aborted transport or
        a failed post."""
        ...

    def wait(self, work: Work, peer: int, what: str) -> None:
        """Wait for ``work``: afterwards a sent buffer may be reused and the caller's current
        CUDA stream sees what arrived. Failure or timeout raise ``TransportAborted`` naming
        ``what`` and ``peer``."""
        ...

    def vote(self, ok: bool, participants: Sequence[int] | None = None) -> bool:
        """True only if every participant (default: every rank) reports ``ok``; a dead or
        absent participant, or the timeout, raises ``TransportAborted``."""
        ...

    def abort(self) -> None:
        """Tear the communicator down so that peers blocked on this rank fail fast."""
        ...

    def interrupt(self) -> None:
        """From any thread: make this rank's waits in flight end now with
        ``TransportAborted`` (the thread that runs the transfer then aborts as usual).
        Never releases memory that thread may still read (IPC mappings stay)."""
        ...

    def close(self) -> None:
        """Stop using the transport and drop its references to the communicator."""
        ...


VOTE_TAG = 0x7E57  # distinct from bucket tags (bucket indices)


class TransportBase:
    """What the implementations share: identity, capabilities, the aborted flag, and the
    vote. Subclasses implement ``post``, ``wait``, ``abort``, ``close`` and
    ``_allreduce_flag`` (the whole-world vote)."""

    def __init__(self, rank: int, world_size: int, capabilities: Capabilities, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self._rank = rank
        self._world_size = world_size
        self._capabilities = capabilities
        self.timeout_s = float(timeout_s)
        self._aborted = False

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
    def aborted(self) -> bool:
        return self._aborted

    def interrupt(self) -> None:
        """See :meth:`Transport.interrupt`: here an abort, which holds no memory of its own
        (nccl4py: a flag every wait checks; c10d: the group's abort, made for this)."""
        self.abort()  # type: ignore[attr-defined]

    def vote(self, ok: bool, participants: Sequence[int] | None = None) -> bool:
        """With ``participants`` (a subset of the world) the vote runs point-to-point through
        the lowest participant, so ranks outside the refit are not involved."""
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=self.device)
        what = "completion vote"
        try:
            if participants is None or len(set(participants)) == self.world_size:
                self._allreduce_flag(flag)
            else:
                members = sorted(set(participants))
                root = members[0]
                if self.rank == root:
                    others = [torch.zeros_like(flag) for _ in members[1:]]
                    for peer, buf in zip(members[1:], others, strict=True):
                        self.wait(post_recv(self, buf, peer, VOTE_TAG), peer, what)  # type: ignore[arg-type]
                    flag += sum(int(b.item()) for b in others)
                    for peer in members[1:]:
                        self.wait(post_send(self, flag, peer, VOTE_TAG), peer, what)  # type: ignore[arg-type]
                else:
                    self.wait(post_send(self, flag, root, VOTE_TAG), root, what)  # type: ignore[arg-type]
                    self.wait(post_recv(self, flag, root, VOTE_TAG), root, what)  # type: ignore[arg-type]
        except TransportAborted:
            raise
        except Exception as exc:
            raise TransportAborted(f"rank {self.rank}: {what} failed: {first_line(exc)}", rank=self.rank,
                                   phase="vote") from exc
        return int(flag.item()) == 0

    def _allreduce_flag(self, flag: torch.Tensor) -> None:
        raise NotImplementedError


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (C++ errors carry whole backtraces)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def post_send(transport: Transport, tensor: torch.Tensor, peer: int, tag: int = 0) -> Work:
    """Post one send."""
    return transport.post((P2POp("send", tensor, peer, tag),))[0]


def post_recv(transport: Transport, tensor: torch.Tensor, peer: int, tag: int = 0) -> Work:
    """Post one receive."""
    return transport.post((P2POp("recv", tensor, peer, tag),))[0]


def abort_with_watchdog(pg: Any, timeout_s: float, log, what: str = "abort",
                        reaping: list[threading.Thread] | None = None) -> float:
    """Abort ``pg`` on a helper thread; stop waiting for it after ``timeout_s``. With
    ``reaping`` (a list the caller joins later) do not wait at all: the thread is appended
    there and the abort runs beside whatever the caller does next.

    The helper holds the last reference, so the backend's destructor, which may join
    threads stuck on a dead peer, runs on the helper once the abort returns: never on the
    caller's thread, and never kept alive for good (that would leak its sockets).
    """
    box = [pg]
    done = threading.Event()
    errors: list[BaseException] = []

    def _run() -> None:
        try:
            obj = box.pop()
            fn = getattr(obj, "abort", None)
            if fn is not None:
                fn()
            del obj
        except BaseException as exc:  # reported, never raised into the runtime
            errors.append(exc)
        finally:
            done.set()

    t0 = time.monotonic()
    thread = threading.Thread(target=_run, name=f"comm-{what}", daemon=True)
    thread.start()
    del pg  # from here on only the helper owns it
    if reaping is not None:
        reaping.append(thread)
        return 0.0
    if not done.wait(timeout_s):
        log.error("comm.abort.timed_out", what=what, timeout_s=timeout_s)
    elif errors:
        log.warning("comm.abort.failed", what=what, error=repr(errors[0])[:300])
    return time.monotonic() - t0
