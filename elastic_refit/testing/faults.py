"""The one fault seam: a fault-injecting transport and hooks at the runtime's named phases.

:class:`FaultyTransport` wraps any :class:`~elastic_refit.transport.protocol.Transport`
(in the spirit of torchft's ``FakeProcessGroupWrapper``): a test programs it to run an
action before the k-th matching operation is posted (raise a transport fault, SIGKILL the
process, ...), to delay every operation, or to corrupt what the next send puts on the
wire. Everything else goes to the wrapped transport unchanged.

A wrapped transport that reads same-host peers' memory directly (CUDA IPC) keeps doing so:
the direct-read interface is forwarded, and mapping a peer counts as a receive.

:func:`fault_hooks` makes the hooks a context is given (``ElasticRefit(..., hooks=...)``):
a phase hook, and every epoch's transport a :class:`FaultyTransport`, so that a hook firing
at ``transfer.before`` finds ``context["transport"]`` ready to be programmed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from elastic_refit.errors import TransportAborted
from elastic_refit.runtime.phases import PhaseHook, PhaseHooks
from elastic_refit.transport.protocol import Capabilities, P2POp, Transport, Work

__all__ = ["FaultyTransport", "fault_hooks", "injected_failure", "kill_self"]


def kill_self() -> None:
    """SIGKILL this process (a crash: no clean-up runs, sockets reset)."""
    os.kill(os.getpid(), signal.SIGKILL)


def injected_failure(message: str) -> Callable[[], None]:
    """An action that raises ``TransportAborted(message)``, as a broken link would."""

    def fail() -> None:
        raise TransportAborted(f"injected: {message}")

    return fail


@dataclass(slots=True)
class _Trigger:
    action: Callable[[], None]
    after: int  # matching operations posted before the action runs
    op: str | None  # "send", "recv" or None (either)
    seen: int = 0


class _KeptWork:
    """A handle that keeps a corrupted copy alive until the operation completed."""

    __slots__ = ("keep", "work")

    def __init__(self, work: Work, keep: list[torch.Tensor]) -> None:
        self.work = work
        self.keep = keep

    def wait(self, *args, **kwargs):
        return self.work.wait(*args, **kwargs)


class FaultyTransport:
    """A transport that forwards to ``inner`` and injects the faults it is programmed with."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self._triggers: list[_Trigger] = []
        self._delay_s = 0.0
        self._corrupt_sends = 0

    # ---- programming ---------------------------------------------------------------
    def inject(self, action: Callable[[], None], *, after: int = 0, op: str | None = None) -> None:
        """Run ``action`` (once) right before the operation that follows ``after`` matching
        operations (``op``: "send", "recv" or either) is posted; ``after=0`` fires on the
        next one. What the action raises is raised from :meth:`post`."""
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        if op not in (None, "send", "recv"):
            raise ValueError(f"op must be 'send', 'recv' or None, got {op!r}")
        with self._lock:
            self._triggers.append(_Trigger(action, after, op))

    def delay(self, seconds: float) -> None:
        """Sleep ``seconds`` before every later operation (a slow rank or link)."""
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        self._delay_s = seconds

    def corrupt_sends(self, count: int = 1) -> None:
        """The next ``count`` sends put a copy with its first byte flipped on the wire."""
        self._corrupt_sends += count

    # ---- the protocol ----------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def aborted(self) -> bool:
        return self.inner.aborted

    def post(self, ops: Sequence[P2POp]) -> tuple[Work, ...]:
        batch: list[P2POp] = []
        kept: list[torch.Tensor] = []
        for op in ops:
            self._before(op.op)
            if self._delay_s:
                time.sleep(self._delay_s)
            if op.op == "send" and self._corrupt_sends > 0:
                self._corrupt_sends -= 1
                wire = op.tensor.detach().clone().reshape(-1).view(torch.uint8)
                wire[0] ^= 0xFF
                kept.append(wire)
                op = P2POp("send", wire, op.peer, op.tag)
            batch.append(op)
        # One batch stays one batch: a backend that groups a batch (NCCL) must see it whole.
        works = self.inner.post(batch)
        return tuple(_KeptWork(w, kept) for w in works) if kept else works

    def wait(self, work: Work, peer: int, what: str) -> None:
        self.inner.wait(work.work if isinstance(work, _KeptWork) else work, peer, what)

    # ---- direct reads (an inner IpcTransport's; AttributeError where it has none) -----
    # Unforwarded, a wrapped rank would move its same-host messages through post() while
    # its unwrapped peers read them directly: the two ends of a message would disagree.
    @property
    def direct_peers(self) -> frozenset[int]:
        return self.inner.direct_peers  # type: ignore[attr-defined]

    @property
    def moved(self) -> dict[str, int]:
        return self.inner.moved  # type: ignore[attr-defined]

    def share(self, buffers):
        return self.inner.share(buffers)  # type: ignore[attr-defined]

    def peer_buffers(self, peer, gen, specs):
        """Mapping a peer's buffers starts reading its messages: an operation a fault may
        be programmed before (as a receive)."""
        self._before("recv")
        return self.inner.peer_buffers(peer, gen, specs)  # type: ignore[attr-defined]

    def fence_reads(self) -> None:
        self.inner.fence_reads()  # type: ignore[attr-defined]

    def vote(self, ok: bool, participants: Sequence[int] | None = None) -> bool:
        return self.inner.vote(ok, participants)

    def abort(self) -> None:
        self.inner.abort()

    def interrupt(self) -> None:
        self.inner.interrupt()

    def close(self) -> None:
        with self._lock:
            self._triggers.clear()
        self.inner.close()

    def _before(self, op: str) -> None:
        due = []
        with self._lock:
            for trigger in list(self._triggers):
                if trigger.op is not None and trigger.op != op:
                    continue
                if trigger.seen >= trigger.after:
                    self._triggers.remove(trigger)
                    due.append(trigger)
                else:
                    trigger.seen += 1
        for trigger in due:
            trigger.action()


def fault_hooks(hook: PhaseHook | None = None) -> PhaseHooks:
    """Hooks for one ``ElasticRefit``: ``hook`` (if any) runs at every runtime phase, and
    every epoch's transport is a :class:`FaultyTransport` (``context["transport"]`` at
    ``transfer.before``)."""
    return PhaseHooks(() if hook is None else (hook,), (FaultyTransport,))
