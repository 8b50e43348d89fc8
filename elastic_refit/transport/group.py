"""The refit communicator: one process group over the ranks of one refit world.

It is separate from any training process group the user already has: it is built from
a store with an explicit rank and world size (``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` when every rank has its own GPU). Optional backends (nccl4py, the
NCCL M2N library) are probed at run time and never required.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic_refit.errors import TransportAborted


@dataclass(frozen=True, slots=True)
class GroupOptions:
    """``timeout_s`` bounds every send, receive and vote (the collective timeout)."""

    backend: str = "gloo"
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")


_VOTE_TAG = 0x7E57  # distinct from bucket tags (bucket indices)


def optional_backends() -> dict[str, bool]:
    """Which optional transports are importable here (never required)."""
    return {
        "nccl": dist.is_nccl_available() and torch.cuda.is_available(),
        "nccl4py": importlib.util.find_spec("nccl4py") is not None,
        "nccl_m2n": importlib.util.find_spec("nccl_extensions") is not None,
    }


class RefitGroup:
    """Point-to-point sends and receives plus an error vote over one process group."""

    def __init__(self, process_group: dist.ProcessGroup, rank: int, world_size: int,
                 options: GroupOptions, store: dist.Store | None = None) -> None:
        self.process_group = process_group
        self.rank = rank
        self.world_size = world_size
        self.options = options
        # Keep the store alive as long as the group: a Python store collected while C++
        # still uses it fails every call (DESIGN.md, known pitfalls).
        self._store = store
        self._aborted = False
        # cancelled(): the refit this group serves is void (e.g. a newer epoch exists); every
        # wait checks it, so a stopped or departed peer costs a lease TTL, not a timeout.
        self.cancelled: Callable[[], bool] | None = None
        self._waiter: concurrent.futures.ThreadPoolExecutor | None = None
        self.device = torch.device("cpu") if options.backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        if options.backend == "gloo":
            # Gloo applies its context timeout to collectives (the vote) whatever wait() is
            # given, and closes a pair for good when it fires: make it this group's timeout.
            with contextlib.suppress(AttributeError, RuntimeError):
                process_group._set_default_timeout(self.timeout)

    @classmethod
    def create(cls, store: dist.Store, rank: int, world_size: int,
               options: GroupOptions | None = None) -> RefitGroup:
        """Build the group; every rank of the world calls this with the same store."""
        options = options or GroupOptions()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        timeout = datetime.timedelta(seconds=options.timeout_s)
        if options.backend == "gloo":
            pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            nccl_options = dist.ProcessGroupNCCL.Options()
            nccl_options._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, world_size, nccl_options)
        return cls(pg, rank, world_size, options, store)

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.options.timeout_s)

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        return self._call("send", peer, lambda: self.process_group.send([tensor], peer, tag))

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        return self._call("recv", peer, lambda: self.process_group.recv([tensor], peer, tag))

    def wait(self, work, peer: int, what: str) -> None:
        """Wait for one send/recv; failure, timeout or cancellation -> ``TransportAborted``."""
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
        """The participants report success; True only if every one did. A dead or absent
        participant, or the timeout, raises ``TransportAborted``.

        With ``participants`` (a subset of the world) the vote runs point-to-point through
        the lowest participant, so ranks outside the refit are not involved.
        """
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
        """Wait for ``work``; with a ``cancelled`` predicate the blocking wait runs on a helper
        thread while this one checks the predicate, and a cancellation aborts the group
        (which also ends the helper's wait)."""
        if self.cancelled is None:
            if not work.wait(self.timeout):
                raise TimeoutError(f"no completion within {self.options.timeout_s} s")
            return
        if self._waiter is None:
            self._waiter = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="refit-wait")
        future = self._waiter.submit(work.wait, self.timeout)
        while True:
            try:
                if future.result(timeout=0.05) is False:
                    raise TimeoutError(f"no completion within {self.options.timeout_s} s")
                return
            except concurrent.futures.TimeoutError:
                if self.cancelled():
                    self.abort()
                    raise TransportAborted(f"rank {self.rank}: refit cancelled (a newer epoch exists)",
                                           rank=self.rank, phase="cancelled") from None

    def abort(self) -> None:
        """Tear the group down so that peers blocked on this rank fail instead of hanging."""
        if self._aborted:
            return
        self._aborted = True
        # Best effort: the group may already be broken.
        with contextlib.suppress(Exception):
            self.process_group.abort()
        if self._waiter is not None:
            self._waiter.shutdown(wait=False)

    @property
    def aborted(self) -> bool:
        """Whether the group was aborted or closed (it cannot be used again)."""
        return self._aborted

    def close(self) -> None:
        """Stop using the group and drop this object's references to the process group and
        store. Whoever built the process group destroys it (gloo closes its sockets only
        when the last reference goes); a closed group may outlive its communicator, e.g.
        in the traceback of a latched error, without keeping those sockets open."""
        self._aborted = True
        if self._waiter is not None:
            self._waiter.shutdown(wait=False)
            self._waiter = None
        self.process_group = None  # type: ignore[assignment]
        self._store = None

    def _call(self, what: str, peer: int, fn):
        if self._aborted:
            raise TransportAborted(f"rank {self.rank}: {what} on an aborted group", rank=self.rank, peer=peer)
        try:
            return fn()
        except Exception as exc:
            raise TransportAborted(
                f"rank {self.rank}: {what} with rank {peer} failed: {_first_line(exc)}",
                rank=self.rank, peer=peer, phase=what,
            ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
