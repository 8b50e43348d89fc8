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
verification on the digest moves) is written into the staging the bucket would have used
(it is never larger). A receiver writes the changed elements straight into its buffers,
a message at a time once all of it is in, while the next window's bytes move.

Relayed plans: the relay receives the network message's payload in staging as it would
the bytes, writes its own boxes' changes, and forwards each needer its boxes' segments
straight from there (the runs the full bytes would take are runs of segments here) and their
digest moves; the needer writes them into its buffers. A needer learns the sizes of its
forwards from its relay, in a second batch after the first. A relayed message carries
deltas only when every destination rank of its domain may receive them (the sender cannot
tell the relay's boxes from its needers').

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

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from elastic_refit.errors import VerificationFailed
from elastic_refit.kernels.delta import (
    HEADER_BYTES,
)
from elastic_refit.plan import SourceSide, TransferKind
from elastic_refit.transport.bucket_io import DIGEST_BYTES, BucketIO, aligned
from elastic_refit.transport.delta_boxes import Boxes, Segments, compare_ahead
from elastic_refit.transport.delta_round import DeltaInputs, DeltaRound, _Bucket, _Message, _Part
from elastic_refit.transport.protocol import P2POp, Transport
from elastic_refit.transport.schedule import STAGED, ForwardPart, Message, RankSchedule

__all__ = ["FULL", "SIZES_TAG", "DeltaCoder", "DeltaInputs", "DeltaRound"]

FULL = -1  # a bucket's first size entry: it travels in full
SIZES_TAG = 1 << 21  # + the step's (round, phase): apart from buckets' and forwards' tags
FORWARD_SIZES_TAG = SIZES_TAG + (1 << 20)  # a relay's sizes to its needers (second batch)


@dataclass(frozen=True, slots=True)
class _Shape:
    """One message's boxes on this rank: all of them (stream order), per bucket its range,
    which are this rank's own (a relay's others are staged for its needers) and where those
    sit (``geometry``)."""

    boxes: tuple
    ranges: list[tuple[int, int]]
    own: list[int]
    geometry: Boxes


class DeltaCoder:
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
        ops, received, coded = [], [], {}  # coded: boxes compared in this refit
        coding = [self._shapes[i].geometry for i, (_step, msg, receiving) in enumerate(self.messages)
                  if not receiving and not msg.from_destination and self._gets(msg, False, inputs.receivers)
                  and self._codable(i, rnd)]
        compare_ahead(coding, tensors, rnd.base, coded)
        for index, (step, msg, receiving) in enumerate(self.messages):
            if msg.from_destination:
                if not receiving and self._fans_out(msg, inputs.receivers):
                    self._keep_base(index, tensors, rnd)
                continue
            gets = self._gets(msg, receiving, inputs.receivers)
            self._size_op(index, step, msg, receiving, gets, tensors, rnd, coded, ops, received)
        _exchange(transport, ops, "delta sizes")
        for index, sizes in received:
            self._take_sizes(index, sizes.cpu(), rnd)
        self._exchange_part_sizes(inputs, rnd, transport)
        return rnd

    def _gets(self, msg: Message, receiving: bool, receivers: frozenset[int]) -> bool:
        """Whether message ``msg`` (from the network phase) may carry deltas this refit."""
        end = self.rank if receiving else msg.peer
        return self._relayed_ok(end, receivers) if msg.relayed else end in receivers

    def _size_op(self, index, step, msg, receiving, gets, tensors, rnd, coded, ops, received) -> None:
        """The sizes operation of message ``index`` (when it may carry deltas)."""
        if not gets:
            return
        tag = SIZES_TAG + (step.round << 2) + int(step.phase)
        if receiving:
            sizes = torch.empty(2 * len(self._shapes[index].boxes), dtype=torch.int64, device=self.device)
            ops.append(P2POp("recv", sizes, msg.peer, tag))
            received.append((index, sizes))
        else:
            ops.append(P2POp("send", self._code_message(index, tensors, rnd, coded).to(self.device), msg.peer, tag))

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
        if any(msg.from_destination and id(step) in steps for step, msg, _receiving in self.messages):
            rnd.flush()  # they send what this refit wrote
        ops, received, coded = [], [], {}
        for index, (step, msg, receiving) in enumerate(self.messages):
            if msg.from_destination and id(step) in steps:
                gets = (self.rank in rnd.receivers and msg.peer in rnd.receivers)
                self._size_op(index, step, msg, receiving, gets, tensors, rnd, coded, ops, received)
        _exchange(transport, ops, "delta sizes of fan-out")
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
        if pending:
            rnd.messages[index] = _Message(
                entries, value_bytes, torch.empty(int((entries + value_bytes).sum()), dtype=torch.uint8,
                                                  device=self.device),
                torch.zeros(n, dtype=torch.int64, device=self.device), starts, pending)
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

    def _code_message(self, index: int, tensors: Mapping, rnd: DeltaRound, cache: dict) -> torch.Tensor:
        """A sender's message ``index``: which buckets go as deltas (their sizes, the vector
        sent), and the segments and digest moves of all its boxes, coded once."""
        shape, msg = self._shapes[index], self.messages[index][1]
        boxes = shape.geometry
        n = len(shape.boxes)
        sizes = torch.full((2 * n,), FULL, dtype=torch.int64)
        if not self._codable(index, rnd):
            return sizes  # from the destination side (fan-out, holders) or without a base: in full
        seg = boxes.segments(tensors, rnd.base, self.verify, cache)
        entries, value_bytes = seg.entries.cpu(), seg.value_bytes.cpu()
        buckets, starts = self._buckets(index, entries, value_bytes)
        for bucket, (b0, b1), segments, header, size in buckets:
            io = self._io[id(bucket)]
            if b1 == b0 or size >= io.wire_bytes:
                continue
            sizes[b0:b1], sizes[n + b0 : n + b1] = entries[b0:b1], value_bytes[b0:b1]
            rnd.coded[id(io)] = _Bucket(index, (b0, b1), segments, header, size)
            rnd.num_buckets += 1
            rnd.saved_bytes["network" if msg.kind == TransferKind.NETWORK else "intra"] += io.wire_bytes - size
        if any(id(self._io[id(bucket)]) in rnd.coded for bucket in msg.buckets):
            rnd.messages[index] = _Message(entries, value_bytes, seg.coded.to(self.device), seg.moves.to(self.device),
                                           starts)
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

    def payload(self, rnd: DeltaRound, io: BucketIO, tensors: Mapping, staging: torch.Tensor) -> torch.Tensor | None:
        """What a sender sends for a delta bucket (None: the bucket goes in full), copied
        into ``staging`` from its message's coded bytes: a header (entries, value bytes),
        the boxes' segments, with verification on their digest moves."""
        first = rnd.coded.get(id(io))
        if first is None:
            return None
        at = 0
        for b in first.group or [first]:
            m, out = rnd.messages[b.message], staging[at : at + b.size]
            s0, s1 = b.segments
            out[:HEADER_BYTES].copy_(torch.tensor(b.header, dtype=torch.int64).view(torch.uint8))
            out[HEADER_BYTES : HEADER_BYTES + s1 - s0].copy_(m.coded[s0:s1])
            if self.verify:
                out[aligned(HEADER_BYTES + s1 - s0) :].copy_(m.moves[b.boxes[0] : b.boxes[1]].view(torch.uint8))
            at += b.size
        return staging[:at]

    def accept(self, rnd: DeltaRound, io: BucketIO, tensors: Mapping, payload: torch.Tensor, where: str) -> None:
        """A receiver's (or relay's) delta bucket: its segments gathered with its message's;
        once the message's last delta bucket is in, the message is deferred to the round
        (:meth:`DeltaRound.defer`): at its next flush every changed element of this rank's
        boxes is written into its buffers, after (verification on) every box's digest move
        was checked against the sender's. The payload stays where it arrived (a relay
        forwards from there)."""
        first, at = rnd.coded[id(io)], 0
        for b in first.group or [first]:
            self._accept_one(rnd, b, tensors, payload[at : at + b.size], where)
            at += b.size

    def _accept_one(self, rnd: DeltaRound, b: _Bucket, tensors: Mapping, payload: torch.Tensor, where: str) -> None:
        m = rnd.messages[b.message]
        s0, s1 = b.segments
        m.headers.append((payload[:HEADER_BYTES].clone(), b.header))  # checked with the message's others
        m.coded[s0:s1].copy_(payload[HEADER_BYTES : HEADER_BYTES + s1 - s0])
        if self.verify:
            m.moves[b.boxes[0] : b.boxes[1]].copy_(payload[aligned(HEADER_BYTES + s1 - s0) :].view(torch.int64))
        m.pending -= 1
        if not m.pending:  # the whole message is in: checked and written under the next window's bytes
            rnd.defer(lambda: self._write_message(m, b.message, tensors, where))

    def _write_message(self, m, index: int, tensors: Mapping, where: str) -> int:
        """A received message's headers and digest moves checked, then its change written."""
        m.check_headers(where)
        shape = self._shapes[index]
        own = shape.own
        coded = m.coded if len(own) == len(shape.boxes) else m.own_segments(own, self.device)
        return self._apply(shape.geometry, Segments(m.entries[own], m.value_bytes[own], coded, m.moves[own]),
                           tensors, where)

    def _apply(self, boxes: Boxes, seg: Segments, tensors: Mapping, where: str) -> int:
        """Write the change of ``boxes`` (their segments) after checking its digest moves."""
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
                    f"{where}: box {b.offsets}+{b.lengths} of buffer {b.buffer[1]!r} (and {len(bad) - 1} more): its "
                    f"digest moved by {int(got[bad[0]]):#x} under the delta, the sender's by {int(moves[bad[0]]):#x} "
                    "(the delta was damaged, or this rank's base differs from the sender's)")
        written.finish(True)
        return len(boxes.boxes) if self.verify else 0

    # ---- relayed plans ----------------------------------------------------------------------
    def _exchange_part_sizes(self, inputs: DeltaInputs, rnd: DeltaRound, transport: Transport) -> None:
        """A relay's sizes of each forward part it will send as a delta, to its needers; a
        needer's, received: where its delta parts land."""
        ops, received = [], []
        for step, f in self._forward_sends:
            if not self._relayed_ok(self.rank, inputs.receivers):
                continue
            index = next(i for i, (s, _m, r) in enumerate(self.messages) if s is step and r)
            vectors = []
            for part in f.parts:
                b = self._bucket_of(rnd, index, part.bucket)
                m = rnd.messages.get(index)
                boxes = [b.boxes[0] + d for d in part.digests] if b is not None else []
                vectors.append(torch.tensor([FULL] * len(part.digests) * 2, dtype=torch.int64) if b is None or m is None
                               else torch.cat([m.entries[boxes], m.value_bytes[boxes]]))
            ops.append(P2POp("send", torch.cat(vectors).to(self.device), f.peer, _part_tag(step)))
        for step, f in self._forward_recvs:
            if self._relayed_ok(self.rank, inputs.receivers):
                sizes = torch.empty(2 * sum(len(p.boxes.boxes) for p in f.parts), dtype=torch.int64,  # type: ignore[union-attr]
                                    device=self.device)
                ops.append(P2POp("recv", sizes, f.peer, _part_tag(step)))
                received.append((f, sizes))
        _exchange(transport, ops, "delta sizes of forwards")
        for f, sizes in received:
            at = 0
            for part in f.parts:
                n = len(part.boxes.boxes)  # type: ignore[union-attr]
                entries, value_bytes = sizes[at : at + n].cpu(), sizes[at + n : at + 2 * n].cpu()
                at += 2 * n
                if n and int(entries[0]) != FULL:
                    rnd.parts[id(part)] = self._landing(part, entries, value_bytes)

    def _bucket_of(self, rnd: DeltaRound, index: int, bucket: int) -> _Bucket | None:
        msg = self.messages[index][1]
        return rnd.coded.get(id(self._io[id(msg.buckets[bucket])]))

    def _landing(self, part: ForwardPart, entries: torch.Tensor, value_bytes: torch.Tensor) -> _Part:
        lengths = (entries + value_bytes).tolist()
        boxes = part.boxes.boxes  # type: ignore[union-attr]
        runs = []
        for offset, nbytes in part.spans:  # the relay sends each run of touching boxes as one
            runs.append(sum(n for b, n in zip(boxes, lengths, strict=True) if offset <= b.packed_offset < offset + nbytes))
        data = sum(lengths)
        size = aligned(data) + DIGEST_BYTES * len(boxes) if self.verify else data
        return _Part(entries, value_bytes, runs, torch.empty(max(size, 1), dtype=torch.uint8, device=self.device))

    def forward(self, rnd: DeltaRound, io: BucketIO, part: ForwardPart, data: torch.Tensor) -> list[torch.Tensor] | None:
        """A relay's delta forward part of the bucket that arrived in ``data`` (None: it
        came in full): per run of touching boxes its segments, then their digest moves."""
        b = rnd.coded.get(id(io))
        if b is None:
            return None
        m = rnd.messages[b.message]
        first, out = b.boxes[0], []
        runs: list[list[int]] = []
        for d in part.digests:
            if runs and runs[-1][-1] == d - 1:
                runs[-1].append(d)
            else:
                runs.append([d])
        base = m.starts[first]
        for run in runs:
            start, last = m.starts[first + run[0]] - base, first + run[-1]
            end = m.starts[last] - base + int(m.entries[last] + m.value_bytes[last])
            out.append(data[HEADER_BYTES + start : HEADER_BYTES + end])
        if self.verify:
            trailer = data[aligned(HEADER_BYTES + b.segments[1] - b.segments[0]) : b.size].view(torch.int64)
            out.append(trailer[list(part.digests)].view(torch.uint8))
        rnd.saved_bytes["intra"] += part.nbytes - sum(t.numel() for t in out)
        return out

    def landing(self, rnd: DeltaRound, part: ForwardPart) -> list[torch.Tensor] | None:
        """Where a needer's delta forward part lands, one tensor per operation the relay
        posts (None: it comes in full)."""
        p = rnd.part(part)
        if p is None:
            return None
        out, at = [], 0
        for n in p.runs:
            out.append(p.buffer[at : at + n])
            at += n
        if self.verify:
            start = aligned(at)
            out.append(p.buffer[start : start + DIGEST_BYTES * len(part.boxes.boxes)])  # type: ignore[union-attr]
        return out

    def apply_part(self, rnd: DeltaRound, part: ForwardPart, tensors: Mapping, where: str) -> int:
        """A needer's delta forward part, arrived: its boxes' changes written (checked first)."""
        p = rnd.parts[id(part)]
        n = len(part.boxes.boxes)  # type: ignore[union-attr]
        data = int((p.entries + p.value_bytes).sum())
        moves = (p.buffer[aligned(data) : aligned(data) + DIGEST_BYTES * n].view(torch.int64) if self.verify
                 else torch.zeros(n, dtype=torch.int64, device=self.device))
        return self._apply(self._part_boxes[id(part)], Segments(p.entries, p.value_bytes, p.buffer[:data], moves),
                           tensors, where)


def _exchange(transport: Transport, ops: list[P2POp], what: str) -> None:
    if ops:
        for op, work in zip(ops, transport.post(ops), strict=True):
            transport.wait(work, op.peer, f"{op.op} of {what}")


def _part_tag(step) -> int:
    return FORWARD_SIZES_TAG + (step.round << 2) + int(step.phase)
