"""Deltas in the executor: a bucket sent as its change against a base (DESIGN.md, "Deltas").

Routes stay the plan's. Per refit, a sender that holds the base (its source buffers as it
published them for the base version) sends each bucket of a message to a destination that
holds the same base, verified (``DeltaInputs.receivers``, the coordinator's choice), as the
change (:mod:`elastic_refit.kernels.delta`) when that is smaller than the bucket.

Work is proportional to what changed, past one comparison. A sender compares each source
buffer with its base once per refit (the only pass over the weights), and finds each box's
changed elements among the buffer's by index arithmetic; nothing is packed or encoded ahead.
The bucket's payload codes each box on its own (positions counted from the box's start), so
its size follows from per-box counts: sizes travel before payloads move, in one batch
before the first window, one vector per message (per box: entries and changed elements, or
:data:`FULL` for a bucket that goes in full), and the payload is written straight into the
staging the bucket would have used (it is never larger), its values gathered from the
parameters. A receiver writes the changed elements straight into its buffers, nothing else.

Verification (``ExecutorOptions.verify``): a bucket's digest trailer carries, per box, how
far the box's digest moves (the digest is a weighted sum of words mod 2**64: the change's
own words give it, ``kernels.delta.delta_digests``), computed by the sender from its base
and by the receiver from its buffers' old elements, checked for every box before anything
is written. So a delta that arrived damaged, or a receiver whose elements at the changed
positions differ from the sender's base, fails the refit with nothing written; the rest of
the base is the runtime's fact (the receiver acked it verified and nothing wrote its buffers
since: ``runtime.deltas``), not re-read here.

Relayed messages (a relay forwards their bytes as they arrived), a plan that quantizes on
the way, and buckets whose bytes come from the destination side (holders, fan-out) always
go in full; so does a bucket whose change is not smaller than itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from elastic_refit.errors import VerificationFailed
from elastic_refit.kernels.delta import (
    HEADER_BYTES,
    segment_entries,
    segment_entry_counts,
    segment_positions,
)
from elastic_refit.plan import SourceSide, TransferKind
from elastic_refit.transport.bucket_io import DIGEST_BYTES, BucketIO
from elastic_refit.transport.delta_boxes import Boxes, Change
from elastic_refit.transport.protocol import P2POp, Transport
from elastic_refit.transport.schedule import STAGED, Message, RankSchedule

__all__ = ["FULL", "SIZES_TAG", "DeltaCoder", "DeltaInputs", "DeltaRound"]

FULL = -1  # a bucket's first size entry: it travels in full
SIZES_TAG = 1 << 21  # + the step's (round, phase): apart from buckets' and forwards' tags


@dataclass(frozen=True, slots=True)
class DeltaInputs:
    """What one refit's deltas need on this rank. ``base``: a sender's source buffers (by
    name) as published for the base version (empty: it has none, it sends in full);
    ``receivers``: the communicator ranks that hold the base, verified, and may be sent a
    delta (the same on every rank)."""

    base: Mapping[str, torch.Tensor] = field(default_factory=dict)
    receivers: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "receivers", frozenset(int(r) for r in self.receivers))
        bad = sorted(r for r in self.receivers if r < 0)
        if bad:
            raise ValueError(f"receivers must be ranks >= 0, got {bad}")


@dataclass(slots=True)
class _Bucket:
    """A delta bucket of one refit: its message, the range of its boxes there and of its
    entries and values in the message's arrays, its changed elements and payload size."""

    message: int
    boxes: tuple[int, int]
    entries: tuple[int, int]
    values: tuple[int, int]
    num_changed: int
    size: int


@dataclass(slots=True)
class _Message:
    """One message's deltas in one refit, over all its boxes in stream order: per box its
    entries and changed elements (0 for boxes of buckets that go in full), the entries,
    values and digest moves (a sender's coded in :meth:`DeltaCoder.prepare`, a
    receiver's gathered as its delta buckets arrive: ``pending`` still to come)."""

    entry_counts: torch.Tensor
    counts: torch.Tensor
    entries: torch.Tensor
    values: torch.Tensor
    moves: torch.Tensor
    pending: int = 0
    num_boxes: int = 0  # a receiver's: in its delta buckets


class DeltaRound:
    """One refit's deltas on this rank: its delta buckets (by the id of their ``BucketIO``)
    and messages, the base buffers by ref, and what was saved."""

    def __init__(self, base: Mapping | None = None) -> None:
        self.coded: dict[int, _Bucket] = {}
        self.messages: dict[int, _Message] = {}
        self.base = dict(base or {})
        self.num_buckets = 0
        self.saved_bytes = {"network": 0, "intra": 0}

    def size(self, io: BucketIO) -> int | None:
        """The payload size of a delta bucket, None for a full one."""
        coded = self.coded.get(id(io))
        return None if coded is None else coded.size


class DeltaCoder:
    """The delta part of one executor (one plan, one rank): which messages may carry
    deltas and where their boxes sit, and per refit :meth:`prepare` (sizes and a sender's
    payloads, the sizes exchanged), :meth:`payload` (a sender's bucket) and
    :meth:`accept` (a receiver's)."""

    def __init__(self, schedule: RankSchedule, io: Mapping[int, BucketIO], *, quantized: bool, verify: bool,
                 device: torch.device) -> None:
        self.schedule = schedule
        self._io = io
        self.verify = verify
        self.device = device
        self.rank = schedule.rank
        self.messages = [] if quantized else [
            (step, msg, msg is step.recv) for step in schedule.steps for msg in (step.send, step.recv)
            if msg is not None and eligible(msg)]
        self._boxes = [Boxes(tuple(b for bucket in msg.buckets for b in bucket.boxes), schedule, device)
                       for _step, msg, _receiving in self.messages]
        self._ranges: list[list[tuple[int, int]]] = []  # per message, per bucket: its boxes
        for _step, msg, _receiving in self.messages:
            starts = [0]
            for bucket in msg.buckets:
                starts.append(starts[-1] + len(bucket.boxes))
            self._ranges.append(list(itertools.pairwise(starts)))

    @staticmethod
    def may_carry(msg: Message) -> bool:
        return eligible(msg)

    # ---- per refit ------------------------------------------------------------------------
    def prepare(self, inputs: DeltaInputs, tensors: Mapping, transport: Transport) -> DeltaRound:
        """Size and code every message this rank sends to a receiver (from each source
        buffer's changed elements, compared once: the payloads are a few percent of the
        bytes), then exchange the sizes of every message that may carry deltas, in one
        batch. Returns the refit's round."""
        rnd = DeltaRound(self._base_tensors(inputs.base))
        if not inputs.receivers or not self.messages:
            return rnd
        changed: dict = {}
        ops, received = [], []
        for index, (step, msg, receiving) in enumerate(self.messages):
            tag = SIZES_TAG + (step.round << 2) + int(step.phase)
            num = 2 * len(self._boxes[index].boxes)
            if receiving and self.rank in inputs.receivers:
                sizes = torch.empty(num, dtype=torch.int64, device=self.device)
                ops.append(P2POp("recv", sizes, msg.peer, tag))
                received.append((index, sizes))
            elif not receiving and msg.peer in inputs.receivers:
                sizes = self._code_message(index, tensors, rnd, changed)
                ops.append(P2POp("send", sizes.to(self.device), msg.peer, tag))
        if ops:
            for op, work in zip(ops, transport.post(ops), strict=True):
                transport.wait(work, op.peer, f"{op.op} of delta sizes")
        for index, sizes in received:
            self._take_sizes(index, sizes.cpu(), rnd)
        return rnd

    def _bucket_nbytes(self, num_entries: int, value_bytes: int, num_boxes: int) -> int:
        data = HEADER_BYTES + num_entries + value_bytes
        return _aligned(data) + DIGEST_BYTES * num_boxes if self.verify else data

    def _buckets(self, index: int, entry_counts: torch.Tensor, counts: torch.Tensor):
        """Per bucket of message ``index``: (bucket, its boxes, entries, values, changed
        elements, payload size), from per-box counts."""
        boxes = self._boxes[index]
        ecum = [0] + torch.cumsum(entry_counts, 0).tolist()
        vcum = [0] + torch.cumsum(counts * boxes.itemsize.cpu(), 0).tolist()
        kcum = [0] + torch.cumsum(counts, 0).tolist()
        msg = self.messages[index][1]
        for bucket, (b0, b1) in zip(msg.buckets, self._ranges[index], strict=True):
            size = self._bucket_nbytes(ecum[b1] - ecum[b0], vcum[b1] - vcum[b0], b1 - b0)
            yield bucket, (b0, b1), (ecum[b0], ecum[b1]), (vcum[b0], vcum[b1]), kcum[b1] - kcum[b0], size

    def _take_sizes(self, index: int, sizes: torch.Tensor, rnd: DeltaRound) -> None:
        """A receiver's sizes of message ``index``: its delta buckets, and the arrays their
        payloads gather in."""
        n = len(self._boxes[index].boxes)
        entry_counts, counts = sizes[:n].clone(), sizes[n:].clone()
        firsts = entry_counts.tolist()
        for b0, b1 in self._ranges[index]:
            if b1 == b0 or firsts[b0] == FULL:
                entry_counts[b0:b1], counts[b0:b1] = 0, 0
        if (entry_counts < counts).any() or (counts < 0).any():
            raise ValueError(f"rank {self.rank}: delta sizes that cannot be: {sizes.tolist()}")
        pending = num_boxes = 0
        for bucket, b, e, v, k, size in self._buckets(index, entry_counts, counts):
            io = self._io[id(bucket)]
            if b[1] == b[0] or firsts[b[0]] == FULL:
                continue
            if not 0 < size < io.wire_bytes:
                raise ValueError(f"rank {self.rank}: a delta of {size} bytes announced for a bucket of {io.wire_bytes}")
            rnd.coded[id(io)] = _Bucket(index, b, e, v, k, size)
            pending, num_boxes = pending + 1, num_boxes + b[1] - b[0]
        if pending:
            rnd.messages[index] = _Message(
                entry_counts, counts, torch.empty(int(entry_counts.sum()), dtype=torch.uint8, device=self.device),
                torch.empty(int((counts * self._boxes[index].itemsize.cpu()).sum()), dtype=torch.uint8,
                            device=self.device),
                torch.zeros(n, dtype=torch.int64, device=self.device), pending, num_boxes)

    def _base_tensors(self, base: Mapping[str, torch.Tensor]) -> dict:
        """The base buffers by this rank's buffer refs (source side), those that match the
        layout (a base in another shape is no base)."""
        out = {}
        for ref, buffer in self.schedule.buffers.items():
            side, name = ref
            t = base.get(name) if side == int(SourceSide.SOURCE) else None
            if (t is not None and tuple(t.shape) == buffer.shape and t.dtype == getattr(torch, buffer.dtype)
                    and t.is_contiguous() and t.device.type == self.device.type):
                out[ref] = t
        return out

    def _code_message(self, index: int, tensors: Mapping, rnd: DeltaRound, changed: dict) -> torch.Tensor:
        """A sender's message ``index``: which buckets go as deltas (their sizes, the vector
        sent), and the entries, values and digest moves of all its boxes, coded once."""
        boxes, msg = self._boxes[index], self.messages[index][1]
        n = len(boxes.boxes)
        sizes = torch.full((2 * n,), FULL, dtype=torch.int64)
        if not n or not all(r in rnd.base for r in boxes.refs):
            return sizes
        change = boxes.code(tensors, rnd.base, changed, self.verify)
        counts = change.counts
        entry_counts = segment_entry_counts(change.local.cpu(), counts)
        for bucket, b, e, v, k, size in self._buckets(index, entry_counts, counts):
            io = self._io[id(bucket)]
            if b[1] == b[0] or size >= io.wire_bytes:
                continue
            sizes[b[0] : b[1]], sizes[n + b[0] : n + b[1]] = entry_counts[b[0] : b[1]], counts[b[0] : b[1]]
            rnd.coded[id(io)] = _Bucket(index, b, e, v, k, size)
            rnd.num_buckets += 1
            rnd.saved_bytes["network" if msg.kind == TransferKind.NETWORK else "intra"] += io.wire_bytes - size
        if any(id(self._io[id(bucket)]) in rnd.coded for bucket in msg.buckets):
            entries = torch.empty(int(entry_counts.sum()), dtype=torch.uint8, device=self.device)
            segment_entries(change.local.to(self.device), counts.to(self.device), entries)
            rnd.messages[index] = _Message(entry_counts, counts, entries, change.values.to(self.device),
                                           change.moves.to(self.device))
        return sizes

    def payload(self, rnd: DeltaRound, io: BucketIO, tensors: Mapping, staging: torch.Tensor) -> torch.Tensor | None:
        """What a sender sends for a delta bucket (None: the bucket goes in full), copied
        into ``staging`` from its message's coded arrays: a header (entries, changed
        elements), the entries, the values, with verification on the digest moves."""
        b = rnd.coded.get(id(io))
        if b is None:
            return None
        m, out = rnd.messages[b.message], staging[: b.size]
        (e0, e1), (v0, v1) = b.entries, b.values
        out[:HEADER_BYTES].copy_(torch.tensor([e1 - e0, b.num_changed], dtype=torch.int64).view(torch.uint8))
        out[HEADER_BYTES : HEADER_BYTES + e1 - e0].copy_(m.entries[e0:e1])
        out[HEADER_BYTES + e1 - e0 : HEADER_BYTES + e1 - e0 + v1 - v0].copy_(m.values[v0:v1])
        if self.verify:
            trailer = _aligned(HEADER_BYTES + e1 - e0 + v1 - v0)
            out[trailer:].copy_(m.moves[b.boxes[0] : b.boxes[1]].view(torch.uint8))
        return out

    def accept(self, rnd: DeltaRound, io: BucketIO, tensors: Mapping, payload: torch.Tensor, where: str) -> int:
        """A receiver's delta bucket: its parts gathered with its message's; once the
        message's last delta bucket is in, every changed element is written into the
        buffers, after (verification on) every box's digest move was checked against the
        sender's. Returns the boxes checked."""
        b = rnd.coded[id(io)]
        m = rnd.messages[b.message]
        (e0, e1), (v0, v1) = b.entries, b.values
        header = payload[:HEADER_BYTES].cpu().clone().view(torch.int64).tolist()
        if header != [e1 - e0, b.num_changed]:
            raise VerificationFailed(f"{where}: a delta's header says {header}, its sizes said "
                                     f"{[e1 - e0, b.num_changed]}")
        m.entries[e0:e1].copy_(payload[HEADER_BYTES : HEADER_BYTES + e1 - e0])
        m.values[v0:v1].copy_(payload[HEADER_BYTES + e1 - e0 : HEADER_BYTES + e1 - e0 + v1 - v0])
        if self.verify:
            m.moves[b.boxes[0] : b.boxes[1]].copy_(payload[_aligned(HEADER_BYTES + e1 - e0 + v1 - v0) :].view(torch.int64))
        m.pending -= 1
        return 0 if m.pending else self._apply(b.message, m, tensors, where)

    def _apply(self, index: int, m: _Message, tensors: Mapping, where: str) -> int:
        boxes = self._boxes[index]
        local = segment_positions(m.entries, m.entry_counts.to(self.device))
        moves, write = boxes.apply(tensors, Change(local, m.counts, m.values, m.moves), self.verify)
        if self.verify:
            bad = (moves.to(self.device) != m.moves).nonzero().flatten().tolist()
            if bad:
                b = boxes.boxes[bad[0]]
                raise VerificationFailed(
                    f"{where}: box {b.offsets}+{b.lengths} of buffer {b.buffer[1]!r} (and {len(bad) - 1} more): its "
                    f"digest moved by {int(moves[bad[0]]):#x} under the delta, the sender's by {int(m.moves[bad[0]]):#x} "
                    "(the delta was damaged, or this rank's base differs from the sender's)")
        write()  # all checked first: a bad message writes nothing
        return m.num_boxes if self.verify else 0


def eligible(msg: Message) -> bool:
    """Whether ``msg`` may carry deltas: not relayed (a relay forwards bytes as they
    arrived) and without boxes staged for others (the same answer on both ends)."""
    return not msg.relayed and not any(b.buffer == STAGED for bucket in msg.buckets for b in bucket.boxes)




def _aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8
