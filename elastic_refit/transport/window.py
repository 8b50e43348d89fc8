"""A window of the executor: the rounds whose messages are in flight together, and the
records of one window's messages, forwards and posted operations while it runs.

Per step (a round of a phase) a rank sends at most one message and receives at most one;
the plan's ``concurrent_rounds`` consecutive rounds of a phase form a window
(:func:`cut_windows`). While a window runs, the executor keeps one record per message
(:class:`WindowMessage`) and per forward (:class:`WindowForward`), and one per posted send or
receive (:class:`Posted`): what it waits for is read off the records, never off lists
kept in step by position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from elastic_refit.transport.bucket_io import BucketIO, ForwardIn
from elastic_refit.transport.protocol import P2POp, Transport, Work
from elastic_refit.transport.schedule import Forward, ForwardPart, Message, Step

__all__ = ["Posted", "Window", "WindowForward", "WindowMessage", "cut_windows"]


@dataclass(slots=True, eq=False)
class Posted:
    """One send or receive of a window's batch: the operation, what its wait is called
    (``"send (phase ... round ...)"``), the bucket it carries when it is a message's (None
    for a forward's span or digests), and its handle while it is in flight."""

    op: P2POp
    what: str
    io: BucketIO | None = None
    work: Work | None = None

    @property
    def pending(self) -> bool:
        """Posted and not waited for yet."""
        return self.work is not None

    def wait(self, transport: Transport) -> None:
        transport.wait(self.work, self.op.peer, self.what)  # type: ignore[arg-type]
        self.work = None


@dataclass(slots=True, eq=False)
class WindowMessage:
    """A message this rank sends or receives in a window: bucket ``i`` travels in batch
    ``i`` through slot ``i % 2``; ``slots`` holds the operation last posted in each (a
    received bucket's bytes are read there after its wait, by a relay's forwards).
    ``first_slot``: its first staging buffer, when any of its buckets packs."""

    msg: Message
    place: str
    first_slot: int | None
    slots: list[Posted | None] = field(default_factory=lambda: [None, None])


@dataclass(slots=True, eq=False)
class WindowForward:
    """A forward this rank sends (from ``source``, the message it relays) or receives in a
    window: its parts by network bucket, the operations of the part in flight, and (a
    needer's) where that part lands (its ``ForwardIn`` and staging, None when nothing is
    staged). ``first_slot``: its staging buffer, when it gathers into one."""

    forward: Forward
    place: str
    parts: dict[int, ForwardPart]
    first_slot: int | None = None
    source: WindowMessage | None = None
    ops: list[Posted] = field(default_factory=list)
    landing: tuple[ForwardIn, torch.Tensor | None] | None = None


@dataclass(frozen=True, slots=True)
class Window:
    """The records of one window's messages and forwards, in the order their operations
    are posted in each batch (sends, receives, forwards sent, forwards received)."""

    sends: list[WindowMessage]
    recvs: list[WindowMessage]
    forward_sends: list[WindowForward]
    forward_recvs: list[WindowForward]

    @classmethod
    def of(cls, window: tuple[Step, ...], slots: dict[int, int]) -> Window:
        """The records of ``window``'s steps; ``slots``: the first staging buffer of each
        packing message and gathering forward, by the id of its schedule object."""
        def place(s: Step) -> str:
            return f"phase {s.phase.name} round {s.round}"

        sends = [WindowMessage(s.send, place(s), slots.get(id(s.send))) for s in window if s.send is not None]
        recvs = [WindowMessage(s.recv, place(s), slots.get(id(s.recv))) for s in window if s.recv is not None]
        received = {id(m.msg): m for m in recvs}
        forward_sends = [WindowForward(f, f"forward to rank {f.peer} of round {s.round}", {p.bucket: p for p in f.parts},
                                       source=received[id(s.recv)])
                         for s in window for f in s.forward_sends]
        forward_recvs = [WindowForward(f, f"forward from rank {f.peer} of round {s.round}",
                                       {p.bucket: p for p in f.parts}, slots.get(id(f)))
                         for s in window for f in s.forward_recvs]
        return cls(sends, recvs, forward_sends, forward_recvs)

    @property
    def relayed(self) -> list[WindowMessage]:
        """The received messages this rank forwards from, in receive order."""
        return [m for m in self.recvs if any(f.source is m for f in self.forward_sends)]

    @property
    def num_batches(self) -> int:
        """Batches of the window: one per bucket index, plus one for the last forwards."""
        return 1 + max([len(m.msg.buckets) for m in self.sends + self.recvs]
                       + [p.bucket + 1 for f in self.forward_recvs + self.forward_sends for p in f.forward.parts])


def cut_windows(steps: tuple[Step, ...], concurrent_rounds: int) -> tuple[tuple[Step, ...], ...]:
    """This rank's steps cut into the plan's windows: ``concurrent_rounds`` consecutive rounds
    of one phase (numbered alike on every rank, so every rank opens the same windows)."""
    windows: dict[tuple[int, int], list[Step]] = {}
    for step in steps:
        windows.setdefault((int(step.phase), step.round // concurrent_rounds), []).append(step)
    return tuple(tuple(w) for _, w in sorted(windows.items()))
