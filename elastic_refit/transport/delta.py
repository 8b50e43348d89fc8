"""Deltas in the executor: a bucket sent as its change against a base (DESIGN.md, "Deltas").

Routes stay the plan's. Per refit, a sender that holds the base (its source buffers as it
published them for the base version) sends each bucket of a message to a destination that
holds the same base, verified (``DeltaInputs.receivers``, the coordinator's choice), as the
change (:mod:`elastic_refit.kernels.delta`) when that is smaller than the bucket.

Work is proportional to what changed, past one comparison. A sender compares each box with
its base where it lies (the only pass over the weights) and codes the whole message before
the first window (its payloads are a few percent of the bytes). Each box is coded on its
own: a segment of gap entries counted from the box's first element, then the changed
elements' values. So sizes follow from per-box counts (entries, value bytes), which travel
in one batch before the first window, one vector per message (:data:`FULL` for a bucket
that goes in full); a bucket's payload (a header, its boxes' segments back to back, with
verification on the digest moves) is a slice of its message's stream, built once per refit,
and lands in the staging the bucket would have used (it is never larger). A receiver writes the changed elements straight into its buffers,
every message it received at once when the exchange is over (before fan-outs send them on):
on a GPU a delta's cost is its operations, not its few elements (:mod:`.delta_many`; a
sender likewise codes all its messages in one call).

Relayed plans (:mod:`.delta_relay`): the relay forwards each needer its boxes' segments
straight from the payload, and the needer learns their sizes from its relay in a second
batch. A relayed message carries deltas only when every destination rank of its domain may
receive them (the sender cannot tell the relay's boxes from its needers').

Verification (``ExecutorOptions.verify``): a bucket's digest trailer carries, per box, how
far the box's digest moves (the digest is a weighted sum of words mod 2**64: the change's
own words give it, ``kernels.delta.delta_digests``), computed by the sender from its base
and by the receiver from its buffers' old elements, checked for every box before anything
is written. So a delta that arrived damaged, or a receiver whose elements at the changed
positions differ from the sender's base, fails the refit with nothing written; the rest of
the base is the runtime's fact (the receiver acked it verified and nothing wrote its buffers
since: ``runtime.deltas``), not re-read here.

Fan-out inside a domain (a destination rank sends what it received this refit): when both
ends hold the base, the sender keeps the base of those boxes before the refit writes them,
and the message is sized and coded when its window comes (:meth:`DeltaCoder.late`: a batch
of sizes at that window's start), like any other.

A plan that quantizes on the way compares what its senders quantize (FP8 bytes and scales)
with what they quantized for the base version, kept by the executor per version (a block
whose scale moved changes all its bytes: they travel as values). A plan that casts, and
catch-ups from holders, go in full; so does a bucket whose change is not smaller.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from elastic_refit.errors import VerificationFailed
from elastic_refit.kernels.delta import (
    HEADER_BYTES,
)
from elastic_refit.plan import SourceSide, TransferKind
from elastic_refit.transport.bucket_io import DIGEST_BYTES, BucketIO, aligned
from elastic_refit.transport.delta_boxes import Boxes, Segments, compare_ahead
from elastic_refit.transport.delta_many import Together, join_segments, split_segments
from elastic_refit.transport.delta_relay import RelayedDeltas
from elastic_refit.transport.delta_round import (
    FULL,
    SIZES_TAG,
    DeltaInputs,
    DeltaRound,
    _Bucket,
    _Message,
    check_headers,
    exchange,
)
from elastic_refit.transport.protocol import P2POp, Transport
from elastic_refit.transport.schedule import STAGED, Message, RankSchedule

__all__ = ["FULL", "SIZES_TAG", "DeltaCoder", "DeltaInputs", "DeltaRound"]



@dataclass(frozen=True, slots=True)
class _Shape:
    """One message's boxes on this rank: all of them (stream order), per bucket its range,
    which are this rank's own (a relay's others are staged for its needers) and where those
    sit (``geometry``)."""

    boxes: tuple
    ranges: list[tuple[int, int]]
    own: list[int]
    geometry: Boxes


class DeltaCoder(RelayedDeltas):
    """The delta part of one executor (one plan, one rank): which messages may carry
    deltas and where their boxes sit, and per refit :meth:`prepare` (sizes and a sender's
    payloads, the sizes exchanged), :meth:`payload` (a sender's bucket), :meth:`accept`
    (a receiver's), :meth:`forward` and :meth:`landing` (a relay's and a needer's forward
    parts) and :meth:`apply_part`."""

    def __init__(self, schedule: RankSchedule, io: Mapping[int, BucketIO], *, quantized: bool, verify: bool,
                 device: torch.device, domains: tuple[int, ...] = (), destinations: frozenset[int] = frozenset()) -> None:
        self.schedule = schedule
        self._io = io
        self.verify = verify
        self.device = device
        self.rank = schedule.rank
        self._domains = domains
        self._destinations = destinations
        self.messages = [] if quantized else [
            (step, msg, msg is step.recv) for step in schedule.steps for msg in (step.send, step.recv)
            if msg is not None and (not msg.relayed or domains)]
        self._shapes = [self._shape(msg) for _step, msg, _receiving in self.messages]
        self._together = Together([tuple(s.boxes[i] for i in s.own) for s in self._shapes], schedule, device)
        # A relay's forwards and a needer's, from steps whose network message may carry deltas.
        self._forward_sends = [(step, f) for step, msg, receiving in self.messages if receiving and msg.relayed
                               for f in step.forward_sends]
        self._forward_recvs = [(step, f) for step in schedule.steps for f in step.forward_recvs
                               if not quantized and domains]
        self._part_boxes = {id(p): Boxes(p.boxes.boxes, schedule, device)  # type: ignore[union-attr]
                            for _step, f in self._forward_recvs for p in f.parts}

    def _shape(self, msg: Message) -> _Shape:
        boxes = tuple(b for bucket in msg.buckets for b in bucket.boxes)
        starts = [0]
        for bucket in msg.buckets:
            starts.append(starts[-1] + len(bucket.boxes))
        own = [i for i, b in enumerate(boxes) if b.buffer != STAGED]
        return _Shape(boxes, list(itertools.pairwise(starts)), own,
                      Boxes(tuple(boxes[i] for i in own), self.schedule, self.device))

    @staticmethod
    def may_carry(msg: Message) -> bool:
        return True

    def _relayed_ok(self, rank: int, receivers: frozenset[int]) -> bool:
        """A relayed message into ``rank``'s domain may carry deltas: every destination rank
        there may receive them (the same answer on the sender, the relay and its needers)."""
        domain = self._domains[rank]
        return all(r in receivers for r in self._destinations if self._domains[r] == domain)

    # ---- per refit ------------------------------------------------------------------------
    def prepare(self, inputs: DeltaInputs, tensors: Mapping, transport: Transport) -> DeltaRound:
        """Size and code every message this rank sends to a receiver, then exchange the sizes
        of every message that may carry deltas (one batch), then a relay's sizes to its
        needers (a second). Messages from the sender's destination buffers (fan-out) are
        sized when their window comes (:meth:`late`): their sender keeps the base of
        their boxes now, before this refit writes them. Returns the refit's round."""
        rnd = DeltaRound(self._base_tensors(inputs.base))
        rnd.receivers = inputs.receivers
        if not inputs.receivers or not (self.messages or self._forward_recvs):
            return rnd
        rnd.writer = lambda received: self._write_messages(rnd, received, tensors)
        ops, received, coded = [], [], {}  # coded: boxes compared in this refit
        segments = self._code_together([
            i for i, (_step, msg, receiving) in enumerate(self.messages)
            if not receiving and not msg.from_destination and self._gets(msg, False, inputs.receivers)
            and self._codable(i, rnd)], tensors, rnd, coded)
        for index, (step, msg, receiving) in enumerate(self.messages):
            if msg.from_destination:
                if not receiving and self._fans_out(msg, inputs.receivers):
                    self._keep_base(index, tensors, rnd)
                continue
            gets = self._gets(msg, receiving, inputs.receivers)
            self._size_op(index, step, msg, receiving, gets, segments, rnd, ops, received)
        exchange(transport, ops, "delta sizes")
        for index, sizes in received:
            self._take_sizes(index, sizes.cpu(), rnd)
        self._exchange_part_sizes(inputs, rnd, transport)
        return rnd

    def _gets(self, msg: Message, receiving: bool, receivers: frozenset[int]) -> bool:
        """Whether message ``msg`` (from the network phase) may carry deltas this refit."""
        end = self.rank if receiving else msg.peer
        return self._relayed_ok(end, receivers) if msg.relayed else end in receivers

    def _code_together(self, indices: list[int], tensors: Mapping, rnd: DeltaRound, cache: dict) -> dict:
        """The segments of messages ``indices`` (a sender's, codable), coded in one call
        over all their boxes (:mod:`~elastic_refit.transport.delta_many`), by message."""
        if not indices:
            return {}
        boxes = self._together.of(indices)
        compare_ahead([boxes], tensors, rnd.base, cache)
        seg = boxes.segments(tensors, rnd.base, self.verify, cache)
        return dict(zip(indices, split_segments(seg, self._together.counts(indices)), strict=True))

    def _size_op(self, index, step, msg, receiving, gets, segments, rnd, ops, received) -> None:
        """The sizes operation of message ``index`` (when it may carry deltas); ``segments``:
        the coded messages this rank sends, by index."""
        if not gets:
            return
        tag = SIZES_TAG + (step.round << 2) + int(step.phase)
        if receiving:
            sizes = torch.empty(2 * len(self._shapes[index].boxes), dtype=torch.int64, device=self.device)
            ops.append(P2POp("recv", sizes, msg.peer, tag))
            received.append((index, sizes))
        else:
            ops.append(P2POp("send", self._sizes_of(index, segments.get(index), rnd).to(self.device), msg.peer, tag))

    def _fans_out(self, msg: Message, receivers: frozenset[int]) -> bool:
        """A message from the sender's destination buffers carries deltas when both ends
        hold the base (the sender writes its own change first, then sends from there)."""
        return self.rank in receivers and msg.peer in receivers

    def _keep_base(self, index: int, tensors: Mapping, rnd: DeltaRound) -> None:
        """A fan-out sender's base of the boxes it sends from its destination buffers, copied
        before this refit writes them (into buffer-shaped tensors: only the boxes' pages)."""
        for box in self._shapes[index].boxes:
            ref = box.buffer
            if ref[0] != int(SourceSide.DESTINATION):  # a colocated rank's sources: the published base
                continue
            if ref not in rnd.base:
                rnd.base[ref] = torch.empty_like(tensors[ref])
            region = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))
            rnd.base[ref][region] = tensors[ref][region]

    def late(self, rnd: DeltaRound, window, tensors: Mapping, transport: Transport) -> None:
        """At the start of ``window``: size and exchange its fan-out messages (their senders
        hold this refit's version of the boxes by now, and the base kept in prepare)."""
        if not rnd.receivers:
            return
        steps = {id(step) for step in window}
        now = [i for i, (step, msg, _receiving) in enumerate(self.messages) if msg.from_destination and id(step) in steps]
        if now:
            rnd.flush()  # they send what this refit wrote
        ops, received = [], []
        gets = {i: self.rank in rnd.receivers and self.messages[i][1].peer in rnd.receivers for i in now}
        segments = self._code_together([i for i in now if gets[i] and not self.messages[i][2] and self._codable(i, rnd)],
                                       tensors, rnd, {})
        for index in now:
            step, msg, receiving = self.messages[index]
            self._size_op(index, step, msg, receiving, gets[index], segments, rnd, ops, received)
        exchange(transport, ops, "delta sizes of fan-out")
        for index, sizes in received:
            self._take_sizes(index, sizes.cpu(), rnd)

    def _bucket_nbytes(self, coded: int, num_boxes: int) -> int:
        data = HEADER_BYTES + coded
        return aligned(data) + DIGEST_BYTES * num_boxes if self.verify else data

    def _buckets(self, index: int, entries: torch.Tensor, value_bytes: torch.Tensor):
        """Per bucket of message ``index``: (bucket, its boxes, segments, header, payload
        size), from per-box sizes; and each box's segment start."""
        lengths = (entries + value_bytes).tolist()
        starts = [0] + list(itertools.accumulate(lengths))
        e, v = entries.tolist(), value_bytes.tolist()
        msg = self.messages[index][1]
        out = [(bucket, (b0, b1), (starts[b0], starts[b1]), (sum(e[b0:b1]), sum(v[b0:b1])),
                self._bucket_nbytes(starts[b1] - starts[b0], b1 - b0))
               for bucket, (b0, b1) in zip(msg.buckets, self._shapes[index].ranges, strict=True)]
        return out, starts[:-1]

    def _take_sizes(self, index: int, sizes: torch.Tensor, rnd: DeltaRound) -> None:
        """A receiver's (or relay's) sizes of message ``index``: its delta buckets, and the
        bytes their payloads gather in."""
        shape = self._shapes[index]
        n = len(shape.boxes)
        entries, value_bytes = sizes[:n].clone(), sizes[n:].clone()
        full = {b for b, (b0, b1) in enumerate(shape.ranges) if b1 == b0 or int(entries[b0]) == FULL}
        for b in full:
            b0, b1 = shape.ranges[b]
            entries[b0:b1], value_bytes[b0:b1] = 0, 0
        if (entries < 0).any() or (value_bytes < 0).any():
            raise ValueError(f"rank {self.rank}: delta sizes that cannot be: {sizes.tolist()}")
        buckets, starts = self._buckets(index, entries, value_bytes)
        pending = 0
        for b, (bucket, boxes, segments, header, size) in enumerate(buckets):
            io = self._io[id(bucket)]
            if b in full:
                continue
            if not 0 < size < io.wire_bytes:
                raise ValueError(f"rank {self.rank}: a delta of {size} bytes announced for a bucket of {io.wire_bytes}")
            rnd.coded[id(io)] = _Bucket(index, boxes, segments, header, size)
            pending += 1
        if pending:  # its coded bytes and moves are assembled from the payloads once all are in
            empty = torch.empty(0, dtype=torch.uint8, device=self.device)
            rnd.messages[index] = _Message(entries, value_bytes, empty, empty.view(torch.int64), starts, pending)
        self._group(index, rnd)

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

    def _codable(self, index: int, rnd: DeltaRound) -> bool:
        """Whether message ``index``'s boxes can be coded against this refit's base: all
        from this rank's sources (none from the destination side), each with its base."""
        shape = self._shapes[index]
        n = len(shape.boxes)
        return bool(n) and len(shape.own) == n and all(r in rnd.base for r in shape.geometry.refs)

    def _sizes_of(self, index: int, seg: Segments | None, rnd: DeltaRound) -> torch.Tensor:
        """A sender's message ``index`` coded as ``seg`` (None: it goes in full): which
        buckets go as deltas (their sizes, the vector sent) and their payloads."""
        shape, msg = self._shapes[index], self.messages[index][1]
        n = len(shape.boxes)
        sizes = torch.full((2 * n,), FULL, dtype=torch.int64)
        if seg is None:
            return sizes  # from the destination side (fan-out, holders) or without a base: in full
        entries, value_bytes = seg.entries.cpu(), seg.value_bytes.cpu()
        buckets, starts = self._buckets(index, entries, value_bytes)
        coded: list[_Bucket] = []
        for bucket, (b0, b1), segments, header, size in buckets:
            io = self._io[id(bucket)]
            if b1 == b0 or size >= io.wire_bytes:
                continue
            sizes[b0:b1], sizes[n + b0 : n + b1] = entries[b0:b1], value_bytes[b0:b1]
            rnd.coded[id(io)] = _Bucket(index, (b0, b1), segments, header, size)
            coded.append(rnd.coded[id(io)])
            rnd.num_buckets += 1
            rnd.saved_bytes["network" if msg.kind == TransferKind.NETWORK else "intra"] += io.wire_bytes - size
        if coded:
            m = rnd.messages[index] = _Message(entries, value_bytes, seg.coded.to(self.device),
                                               seg.moves.to(self.device), starts)
            m.stream = self._stream(m, coded)
        self._group(index, rnd)
        return sizes

    def _group(self, index: int, rnd: DeltaRound) -> None:
        """Runs of consecutive delta buckets of message ``index`` that fit the first's
        staging travel as one operation (both ends derive the same runs from the sizes).
        A relayed message keeps one per bucket: its relay forwards bucket by bucket."""
        msg = self.messages[index][1]
        if msg.relayed:
            return
        leader: _Bucket | None = None
        leader_room = 0
        for bucket in msg.buckets:
            io = self._io[id(bucket)]
            b = rnd.coded.get(id(io))
            if b is None:
                leader = None
            elif leader is not None and leader_room >= sum(x.size for x in leader.group) + b.size:
                leader.group.append(b)
                b.follows = True
            else:
                leader, leader_room = b, io.wire_bytes
                b.group = [b]

    def _stream(self, m: _Message, buckets: list[_Bucket]) -> torch.Tensor:
        """A sender's delta buckets of message ``m`` as their payloads back to back (each a
        header, its boxes' segments, then with verification on their digest moves), in one
        concatenation of views; each bucket's ``offset`` set."""
        headers = torch.tensor([b.header for b in buckets], dtype=torch.int64).view(torch.uint8).reshape(-1).to(self.device)
        pad, moves = torch.zeros(8, dtype=torch.uint8, device=self.device), m.moves.view(torch.uint8)
        pieces, at = [], 0
        for k, b in enumerate(buckets):
            (s0, s1), (b0, b1), data = b.segments, b.boxes, HEADER_BYTES + b.segments[1] - b.segments[0]
            pieces += [headers[k * HEADER_BYTES : (k + 1) * HEADER_BYTES], m.coded[s0:s1]]
            if self.verify:
                pieces += [pad[: aligned(data) - data], moves[b0 * DIGEST_BYTES : b1 * DIGEST_BYTES]]
            b.offset, at = at, at + b.size
        return torch.cat(pieces)

    def payload(self, rnd: DeltaRound, io: BucketIO) -> torch.Tensor | None:
        """What a sender sends for a delta bucket and the delta buckets that travel with it
        (None: the bucket goes in full): their slice of the message's ``stream``."""
        first = rnd.coded.get(id(io))
        if first is None:
            return None
        m = rnd.messages[first.message]
        return m.stream[first.offset : first.offset + sum(b.size for b in first.group or [first])]  # type: ignore[index]

    def accept(self, rnd: DeltaRound, io: BucketIO, payload: torch.Tensor, where: str) -> None:
        """A receiver's (or relay's) delta bucket: its segments gathered with its message's;
        once the message's last delta bucket is in, the message is deferred to the round
        (:meth:`DeltaRound.defer`): at its next flush every changed element of this rank's
        boxes is written into its buffers, after (verification on) every box's digest move
        was checked against the sender's. The payload stays where it arrived (a relay
        forwards from there); one copy of it is kept (the staging serves later windows)."""
        first, at = rnd.coded[id(io)], 0
        group = first.group or [first]
        kept = payload[: sum(b.size for b in group)].clone()
        m = rnd.messages[first.message]
        for b in group:
            m.headers.append((kept[at : at + HEADER_BYTES], b.header))  # checked with the others at the flush
            m.arrived.append((b.segments, b.boxes, kept[at : at + b.size]))
            at += b.size
        m.pending -= len(group)
        if not m.pending:  # the whole message is in: checked and written with the others at the round's flush
            rnd.defer((first.message, where))

    def _write_messages(self, rnd: DeltaRound, received: list[tuple[int, str]], tensors: Mapping) -> int:
        """Received messages (index, where), whole: their headers and digest moves checked,
        then their changes written, all in one call over their boxes. Returns the boxes checked."""
        check_headers([(rnd.messages[i], where) for i, where in received])
        parts = []
        for index, _where in received:
            m, own = rnd.messages[index], self._shapes[index].own
            m.assemble(len(self._shapes[index].boxes), self.verify)
            coded = m.coded if len(own) == len(self._shapes[index].boxes) else m.own_segments(own, self.device)
            parts.append(Segments(m.entries[own], m.value_bytes[own], coded, m.moves[own]))
        seg, firsts = join_segments(parts)
        return self._apply(self._together.of([i for i, _ in received]), seg, tensors,
                           lambda box: received[bisect.bisect_right(firsts, box) - 1][1])

    def _apply(self, boxes: Boxes, seg: Segments, tensors: Mapping, where: Callable[[int], str]) -> int:
        """Write the change of ``boxes`` (their segments) after checking its digest moves;
        ``where(box)`` names the place of a box that fails."""
        if not boxes.boxes:
            return 0
        moves = seg.moves
        got, written = boxes.apply_segments(tensors, seg, self.verify)
        if self.verify:
            bad = (got.to(self.device) != moves).nonzero().flatten().tolist()
            if bad:
                written.finish(False)  # nothing of a bad message stays written
                b = boxes.boxes[bad[0]]
                raise VerificationFailed(
                    f"{where(bad[0])}: box {b.offsets}+{b.lengths} of buffer {b.buffer[1]!r} (and {len(bad) - 1} more): its "
                    f"digest moved by {int(got[bad[0]]):#x} under the delta, the sender's by {int(moves[bad[0]]):#x} "
                    "(the delta was damaged, or this rank's base differs from the sender's)")
        written.finish(True)
        return len(boxes.boxes) if self.verify else 0
