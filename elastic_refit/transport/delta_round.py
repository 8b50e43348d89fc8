"""One refit's deltas on one rank (``transport.delta``): what the caller gives
(:class:`DeltaInputs`) and what the coder learns and keeps for the refit
(:class:`DeltaRound`: its delta buckets, messages and forward parts)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from elastic_refit.errors import VerificationFailed
from elastic_refit.kernels.delta import HEADER_BYTES
from elastic_refit.transport.bucket_io import BucketIO, aligned
from elastic_refit.transport.protocol import P2POp, Transport
from elastic_refit.transport.schedule import ForwardPart

__all__ = ["FORWARD_SIZES_TAG", "FULL", "SIZES_TAG", "DeltaInputs", "DeltaRound", "exchange"]

FULL = -1  # a bucket's (or a forward part's) first size entry: it travels in full
SIZES_TAG = 1 << 21  # + the step's (round, phase): apart from buckets' and forwards' tags
FORWARD_SIZES_TAG = SIZES_TAG + (1 << 20)  # a relay's sizes to its needers (second batch)


@dataclass(frozen=True, slots=True)
class DeltaInputs:
    """What one refit's deltas need on this rank. ``base``: a sender's source buffers (by
    name) as published for the base version (empty: it has none, it sends in full);
    ``receivers``: the communicator ranks that hold the base, verified, and may be sent a
    delta (the same on every rank); ``version`` and ``base_version``: the versions (a
    quantized plan compares what it quantizes, kept per version)."""

    base: Mapping[str, torch.Tensor] = field(default_factory=dict)
    receivers: frozenset[int] = frozenset()
    # A quantized plan's senders keep what they quantized per version (``version``: this
    # refit's) and compare with the kept ``base_version`` (none kept: full bytes).
    version: int | None = None
    base_version: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "receivers", frozenset(int(r) for r in self.receivers))
        bad = sorted(r for r in self.receivers if r < 0)
        if bad:
            raise ValueError(f"receivers must be ranks >= 0, got {bad}")


@dataclass(slots=True)
class _Bucket:
    """A delta bucket of one refit: its message, the range of its boxes there and of their
    segments in the message's coded bytes, its payload's header and size."""

    message: int
    boxes: tuple[int, int]
    segments: tuple[int, int]
    header: tuple[int, int]  # (entries, value bytes)
    size: int
    # Consecutive delta buckets of a message travel as one operation, the first's: it
    # carries their payloads back to back (``group``); the others post nothing.
    group: list[_Bucket] = field(default_factory=list)
    follows: bool = False
    offset: int = 0  # a sender's: where its payload starts in its message's ``stream``


@dataclass(slots=True)
class _Message:
    """One message's deltas in one refit, over all its boxes in stream order: per box its
    entries and value bytes (0 for boxes of buckets that go in full), the segments back to
    back and the digest moves (a sender's coded in :meth:`DeltaCoder.prepare`, a
    receiver's gathered as its delta buckets arrive: ``pending`` still to come)."""

    entries: torch.Tensor
    value_bytes: torch.Tensor
    coded: torch.Tensor
    moves: torch.Tensor
    starts: list[int]  # each box's segment in ``coded``
    pending: int = 0
    # A receiver's arrived headers (views of the kept payloads) and what the sizes said of
    # each, checked with every received message's at the round's flush: one read back from
    # the device in all (:func:`check_headers`), not one per bucket.
    headers: list[tuple[torch.Tensor, tuple[int, int]]] = field(default_factory=list)
    # A receiver's arrived delta buckets: (segments, boxes, payload), views of one copy
    # per operation, assembled into ``coded`` and ``moves`` once all are in.
    arrived: list[tuple[tuple[int, int], tuple[int, int], torch.Tensor]] = field(default_factory=list)
    # A sender's: its delta buckets' payloads back to back, built in one concatenation (a
    # run of them travels as one slice of it; a few copies per message, not three per bucket).
    stream: torch.Tensor | None = None

    def assemble(self, num_boxes: int, verify: bool) -> None:
        """A receiver's ``coded`` (every box's segment, box after box: those of buckets that
        came in full are empty) and ``moves`` (zero for those boxes), each in one
        concatenation of views of the arrived payloads."""
        arrived = sorted(self.arrived, key=lambda a: a[0][0])
        device = arrived[0][2].device
        zeros = torch.zeros(num_boxes, dtype=torch.int64, device=device)
        coded, moves, box = [], [], 0
        for (s0, s1), (b0, b1), payload in arrived:
            coded.append(payload[HEADER_BYTES : HEADER_BYTES + s1 - s0])
            if verify:
                moves += [zeros[box:b0], payload[aligned(HEADER_BYTES + s1 - s0) :].view(torch.int64)]
                box = b1
        self.coded, self.moves = torch.cat(coded), torch.cat([*moves, zeros[box:]])
        self.arrived = []

    def own_segments(self, own: list[int], device: torch.device) -> torch.Tensor:
        """A relay's own boxes' segments, back to back (the others are its needers')."""
        lengths = (self.entries + self.value_bytes)[own].to(device)
        first = torch.tensor([self.starts[i] for i in own], dtype=torch.int64, device=device)
        total = int(lengths.sum())
        shift = torch.repeat_interleave(first - (torch.cumsum(lengths, 0) - lengths), lengths, output_size=total)
        return self.coded[torch.arange(total, device=device) + shift]  # built where the bytes are


def check_headers(messages: list[tuple[_Message, str]]) -> None:
    """Every arrived delta header of ``messages`` (each with where it was received) against
    what the sizes said, with one read back for all of them: ``VerificationFailed`` naming
    the first that differs."""
    pairs = [(where, k, want) for m, where in messages for k, (_, want) in enumerate(m.headers)]
    if not pairs:
        return
    got = torch.stack([h for m, _ in messages for h, _ in m.headers]).view(torch.int64).cpu().tolist()
    for header, (where, k, want) in zip(got, pairs, strict=True):
        if tuple(header) != want:
            raise VerificationFailed(f"{where}: the header of its delta bucket {k} says {tuple(header)}, its "
                                     f"sizes said {want}")


@dataclass(slots=True)
class _Part:
    """A needer's delta forward part: per box its entries and value bytes, the bytes of each
    run, and where they land (segments, then the digest moves)."""

    entries: torch.Tensor
    value_bytes: torch.Tensor
    runs: list[int]
    buffer: torch.Tensor


class DeltaRound:
    """One refit's deltas on this rank: its delta buckets (by the id of their ``BucketIO``),
    messages and needer parts (by the id of their ``ForwardPart``), the base buffers by ref,
    and what was saved."""

    def __init__(self, base: Mapping | None = None) -> None:
        self.coded: dict[int, _Bucket] = {}
        self.messages: dict[int, _Message] = {}
        self.parts: dict[int, _Part] = {}
        self.base = dict(base or {})
        self.receivers: frozenset[int] = frozenset()
        self.num_buckets = 0
        self.saved_bytes = {"network": 0, "intra": 0}
        # Wall seconds of the delta work by part (code: compare and code, with the sizes'
        # exchange; late: fan-outs sized at their window; accept: check and write), so a
        # refit's report says where a delta's time went beside the transfer's.
        self.seconds = {"code": 0.0, "late": 0.0, "accept": 0.0}
        # Received messages whose last delta bucket is in (index, where received), checked
        # and written together at :meth:`flush` by ``writer`` (the coder's); the boxes checked.
        self._received: list[tuple[int, str]] = []
        self.writer: Callable[[list[tuple[int, str]]], int] | None = None
        self.verified_boxes = 0

    def defer(self, message: tuple[int, str]) -> None:
        """A received message (its index, where it was received), whole: checked and
        written at the next :meth:`flush`."""
        self._received.append(message)

    def flush(self) -> None:
        """Every received message not yet written checked and written, in one call (the
        executor flushes once the exchange is over, and before fan-outs send what this
        refit wrote); a failed check raises ``VerificationFailed`` and the refit fails."""
        if not self._received:
            return
        received, self._received = self._received, []
        with self.timed("accept"):
            self.verified_boxes += self.writer(received)  # type: ignore[misc]

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Add the wall time of the block to ``seconds[part]``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - start

    def size(self, io: BucketIO) -> int | None:
        """The payload size of a delta bucket (with the buckets it carries), None for a
        full one."""
        coded = self.coded.get(id(io))
        return None if coded is None else sum(b.size for b in coded.group) or coded.size

    def skips(self, io: BucketIO) -> bool:
        """A delta bucket whose payload travels with an earlier one's: nothing to post."""
        coded = self.coded.get(id(io))
        return coded is not None and coded.follows

    def part(self, part: ForwardPart) -> _Part | None:
        """A needer's forward part when it comes as a delta."""
        return self.parts.get(id(part))


def exchange(transport: Transport, ops: list[P2POp], what: str) -> None:
    """Post ``ops`` (sizes) in one batch and wait for all of them."""
    if ops:
        for op, work in zip(ops, transport.post(ops), strict=True):
            transport.wait(work, op.peer, f"{op.op} of {what}")
