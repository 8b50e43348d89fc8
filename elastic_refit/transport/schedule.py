"""One rank's view of a plan: local copies, then steps of (send message, receive message).

Built once per (plan, rank) and reused every refit of an epoch. Sender and receiver derive
the same bucket boundaries from the same plan rows, so no sizes travel on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from elastic_refit.layout import DTYPE_ITEMSIZE, DTYPES, Buffer, Layout
from elastic_refit.plan import Phase, Plan, SourceSide, TransferKind
from elastic_refit.plan.types import ExpandedTransfers

# A local buffer is named by its side and name; a colocated rank has both sides.
BufferRef = tuple[int, str]  # (SourceSide value, buffer name)
# The "buffer" of a box a relay only stages (it forwards the bytes and keeps none).
STAGED: BufferRef = (int(SourceSide.RELAY), "")


@dataclass(frozen=True, slots=True)
class BoxCopy:
    """One box: where it sits in a local buffer and (for messages) in the packed bucket."""

    buffer: BufferRef
    offsets: tuple[int, ...]  # inside the local buffer, in the buffer's own dims
    lengths: tuple[int, ...]
    packed_offset: int  # byte offset inside the bucket (0 for local copies)
    nbytes: int


@dataclass(frozen=True, slots=True)
class Bucket:
    """Boxes that travel in one packed buffer; ``nbytes`` is exactly what goes on the wire."""

    nbytes: int
    boxes: tuple[BoxCopy, ...]


@dataclass(frozen=True, slots=True)
class Message:
    peer: int
    kind: TransferKind  # NETWORK or INTRA
    buckets: tuple[Bucket, ...]
    relayed: bool = False  # a relay forwards some of its bytes (alike on both ends)
    # Some of its bytes come from the sender's destination buffers (fan-out inside a domain,
    # holders): alike on both ends (deltas size such a message when its window comes).
    from_destination: bool = False

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


@dataclass(frozen=True, slots=True)
class ForwardPart:
    """What one forward carries with bucket ``bucket`` of its network message.

    ``spans`` are the runs that travel, one operation each, in stream order and merged
    where they touch: at the relay (offset in that received bucket, bytes), at the needer
    (offset in the part, bytes); ``boxes`` (needer only) is where the part's bytes land,
    packed back to back in the same order. ``digests`` (relay only) are the indices, in the
    received bucket, of the boxes the part carries, in the same order: with verification
    on, the digests that came with them travel on with the part, and the needer checks them."""

    bucket: int
    nbytes: int
    spans: tuple[tuple[int, int], ...] = ()
    boxes: Bucket | None = None
    digests: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Forward:
    """Bytes a relay forwards over NVLink from the network message it receives in a step,
    one part per network bucket that holds some of them (relayed plans)."""

    peer: int
    parts: tuple[ForwardPart, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


@dataclass(frozen=True, slots=True)
class Step:
    """In one (phase, round) a rank sends at most one message and receives at most one;
    in relayed plans it may also forward what it receives to ranks of its domain
    (``forward_sends``, from ``recv``) and receive such forwards (``forward_recvs``)."""

    phase: Phase
    round: int
    send: Message | None
    recv: Message | None
    forward_sends: tuple[Forward, ...] = ()
    forward_recvs: tuple[Forward, ...] = ()


@dataclass(frozen=True, slots=True)
class LocalCopy:
    src: BoxCopy
    dst: BoxCopy


@dataclass(frozen=True, slots=True)
class RankSchedule:
    """Everything rank ``rank`` does for one plan, in execution order."""

    rank: int
    fingerprint: str
    local_copies: tuple[LocalCopy, ...]
    steps: tuple[Step, ...]
    buffers: dict[BufferRef, Buffer]  # every buffer this rank reads or writes, in its own dtype
    max_bucket_bytes: int
    # Source buffers whose bytes travel in another dtype (a plan that casts, ``Plan.cast``):
    # ref -> the dtype its boxes have in buckets; packing casts them.
    wire_dtypes: dict[BufferRef, str] = field(default_factory=dict)

    @property
    def send_bytes(self) -> int:
        return sum((s.send.nbytes if s.send else 0) + sum(f.nbytes for f in s.forward_sends) for s in self.steps)

    @property
    def recv_bytes(self) -> int:
        return sum((s.recv.nbytes if s.recv else 0) + sum(f.nbytes for f in s.forward_recvs) for s in self.steps)

    def bytes_by_kind(self) -> dict[str, int]:
        out = {"network_send": 0, "network_recv": 0, "intra_send": 0, "intra_recv": 0,
               "local": sum(c.dst.nbytes for c in self.local_copies)}
        for s in self.steps:
            for direction, msg in (("send", s.send), ("recv", s.recv)):
                if msg is not None:
                    key = "network" if msg.kind == TransferKind.NETWORK else "intra"
                    out[f"{key}_{direction}"] += msg.nbytes
            out["intra_send"] += sum(f.nbytes for f in s.forward_sends)  # forwards stay in the domain
            out["intra_recv"] += sum(f.nbytes for f in s.forward_recvs)
        return out


def rank_buffers(plan: Plan, rank: int) -> dict[BufferRef, Buffer]:
    """Rank ``rank``'s local buffers in ``plan``'s layouts: source side first, then destination
    (a colocated rank has both). A plan that casts lists its source buffers as the caller
    holds them (``Plan.cast.logical_source``, the source dtypes)."""
    cast = getattr(plan, "cast", None)
    source = plan.source if cast is None else cast.logical_source
    sides = ((SourceSide.SOURCE, source), (SourceSide.DESTINATION, plan.destination))
    return {(int(side), buffer.name): buffer for side, layout in sides for buffer in layout.buffers(rank)}


def wire_dtypes(plan: Plan, rank: int) -> dict[BufferRef, str]:
    """Rank ``rank``'s source buffers that ``plan`` casts: ref -> the dtype on the wire."""
    if getattr(plan, "cast", None) is None:
        return {}
    held = {b.name: b.dtype for b in plan.cast.logical_source.buffers(rank)}  # type: ignore[attr-defined]
    return {(int(SourceSide.SOURCE), b.name): b.dtype for b in plan.source.buffers(rank) if held.get(b.name) != b.dtype}


def build_rank_schedule(plan: Plan, rank: int) -> RankSchedule:
    """Derive rank ``rank``'s local copies and message steps from ``plan``."""
    copies = _expand_copies(plan, rank)
    local_copies, per_step = _group_copies(copies)
    half = plan.options.max_transfer_bytes
    steps = _steps(per_step, half)
    buffers = rank_buffers(plan, rank)
    max_bucket = _max_bucket_bytes(steps)
    assert max_bucket <= 2 * half, "buckets and direct chunks stay within bucket_bytes"
    return RankSchedule(rank, plan.fingerprint, tuple(local_copies), steps, buffers, max_bucket,
                        wire_dtypes(plan, rank))


# Per (phase, round): "send"/"recv" message specs
# [peer, kind, direct buckets, packed boxes, relayed, from_destination] and
# "forward_send"/"forward_recv" {peer: [(stream position, bytes, box at the needer)]}.
_StepSpecs = dict[tuple[int, int], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class _Copies:
    """One rank's box copies of a plan (``Plan.expand`` of its rows) and their local regions."""

    plan: Plan
    rank: int
    x: ExpandedTransfers
    k: int  # columns of the plan's offsets/lengths
    kind: np.ndarray  # TransferKind of each copy
    src_side: np.ndarray  # SourceSide of each copy
    forwarded: np.ndarray  # copies a relay forwards over NVLink (sent or received here)
    has_dst: np.ndarray  # False: a relayed copy, only staged here
    relay_messages: set[int]  # messages that go packed (see ``_relay_messages``)
    src_off: np.ndarray  # region of each copy in its source-side local buffer
    src_len: np.ndarray
    dst_off: np.ndarray  # region of each copy in its destination local buffer
    dst_len: np.ndarray

    def box(self, side: int, pieces: np.ndarray, i: int, off: np.ndarray, ln: np.ndarray) -> BoxCopy:
        """Copy ``i``'s box in the local buffer of ``pieces[i]`` on ``side`` (packed offset 0)."""
        layout = self.plan.destination if side == int(SourceSide.DESTINATION) else self.plan.source
        return _box_of(layout, int(pieces[i]), side, off[i], ln[i])


def _relay_messages(plan: Plan) -> set[int]:
    """Messages with forwarded rows: they go packed (no direct chunks), so that a copy's place
    in the stream is its message_offset on every rank, the needers included."""
    t = plan.transfers
    relay_rows = t.src_side == int(SourceSide.RELAY)
    return set(np.unique(t.message[t.src_piece[relay_rows]]).tolist()) if relay_rows.any() else set()


def _local_regions(layout: Layout, pieces: np.ndarray, sel: np.ndarray, offsets: np.ndarray,
                   lengths: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Regions of the selected copies' boxes in ``layout``'s local buffers (others: zeros/ones)."""
    off = np.zeros((pieces.size, k), dtype=np.int64)
    ln = np.ones((pieces.size, k), dtype=np.int64)
    idx = np.flatnonzero(sel)
    if idx.size:
        lk = layout.ndim
        o, n = layout.local_regions(pieces[idx], offsets[idx, :lk], lengths[idx, :lk])
        off[idx, :lk], ln[idx, :lk] = o, n
    return off, ln


def _expand_copies(plan: Plan, rank: int) -> _Copies:
    """Expand rank ``rank``'s plan rows into box copies and place them in its local buffers."""
    t = plan.transfers
    rows = plan.rows_for(rank)
    x = plan.expand(rows)
    k = t.offsets.shape[1]
    offsets, lengths = t.offsets[x.row], t.lengths[x.row]
    from_dst = t.src_side[x.row] == int(SourceSide.DESTINATION)
    from_src = t.src_side[x.row] == int(SourceSide.SOURCE)
    forwarded = t.src_side[x.row] == int(SourceSide.RELAY)
    relay_messages = _relay_messages(plan)
    has_dst = x.dst_piece >= 0  # -1: a relayed copy, only staged here
    src_off, src_len = _local_regions(plan.source, x.src_piece, from_src, offsets, lengths, k)
    o2, l2 = _local_regions(plan.destination, x.src_piece, from_dst, offsets, lengths, k)
    src_off[from_dst], src_len[from_dst] = o2[from_dst], l2[from_dst]
    dst_off, dst_len = _local_regions(plan.destination, np.maximum(x.dst_piece, 0), has_dst, offsets, lengths, k)
    return _Copies(plan, rank, x, k, t.kind[x.row], t.src_side[x.row], forwarded, has_dst, relay_messages,
                   src_off, src_len, dst_off, dst_len)


def _group_copies(c: _Copies) -> tuple[list[LocalCopy], _StepSpecs]:
    """Sort the copies, in plan order, into local copies and per-step message/forward specs."""
    local_copies = []
    per_step: _StepSpecs = {}
    for i in range(c.x.row.size):
        if c.forwarded[i]:
            _add_forward(c, i, per_step)
        elif c.kind[i] == int(TransferKind.LOCAL):
            local_copies.append(LocalCopy(
                c.box(int(c.src_side[i]), c.x.src_piece, i, c.src_off, c.src_len),
                c.box(int(SourceSide.DESTINATION), c.x.dst_piece, i, c.dst_off, c.dst_len),
            ))
        else:
            _add_to_message(c, i, per_step)
    return local_copies, per_step


def _add_forward(c: _Copies, i: int, per_step: _StepSpecs) -> None:
    """Record forwarded copy ``i``: (stream position in the network message, bytes, box at the needer)."""
    t = c.plan.transfers
    row = int(c.x.row[i])
    sending = int(t.src_rank[row]) == c.rank
    entry = per_step.setdefault((int(t.phase[row]), int(t.round[row])), {})
    side = entry.setdefault("forward_send" if sending else "forward_recv", {})
    peer = int(t.dst_rank[row]) if sending else int(t.src_rank[row])
    target = None if sending else c.box(int(SourceSide.DESTINATION), c.x.dst_piece, i, c.dst_off, c.dst_len)
    side.setdefault(peer, []).append((int(c.x.message_offset[i]), int(t.nbytes[row]), target))


def _add_to_message(c: _Copies, i: int, per_step: _StepSpecs) -> None:
    """Add copy ``i`` to its step's send or receive spec: as a packed box or as direct chunks."""
    t, x = c.plan.transfers, c.x
    row = int(x.row[i])
    sending = int(t.src_rank[row]) == c.rank
    key = (int(t.phase[row]), int(t.round[row]))
    entry = per_step.setdefault(key, {})
    peer = int(t.dst_rank[row]) if sending else int(t.src_rank[row])
    msg = entry.setdefault("send" if sending else "recv", [peer, int(c.kind[i]), [], [], False, False])
    msg[4] = msg[4] or int(t.message[row]) in c.relay_messages
    msg[5] = msg[5] or bool(c.src_side[i] == int(SourceSide.DESTINATION))
    src_layout = c.plan.destination if c.src_side[i] == int(SourceSide.DESTINATION) else c.plan.source
    if not sending and not c.has_dst[i]:  # staged for forwarding only: no buffer of ours
        msg[3].append(BoxCopy(STAGED, (), (), 0, int(t.nbytes[row])))
        return
    chunks = None if int(t.message[row]) in c.relay_messages else _direct_chunks(
        t.offsets[row], t.lengths[row],
        (src_layout, int(x.src_piece[i])), (c.plan.destination, int(x.dst_piece[i])),
        c.plan.options.direct_min_bytes,
        int(c.plan.destination.tensor_itemsize[int(t.tensor[row])]), c.plan.options.max_transfer_bytes,
    )
    if chunks is None:
        pieces, off, ln, side = ((x.src_piece, c.src_off, c.src_len, int(c.src_side[i])) if sending
                                 else (x.dst_piece, c.dst_off, c.dst_len, int(SourceSide.DESTINATION)))
        msg[3].append(c.box(side, pieces, i, off, ln))
    else:
        msg[2].extend(_chunk_buckets(c, i, sending, src_layout, chunks))


def _chunk_buckets(c: _Copies, i: int, sending: bool, src_layout: Layout,
                   chunks: tuple[np.ndarray, np.ndarray]) -> list[Bucket]:
    """One single-box bucket per direct chunk of copy ``i``, in this rank's buffer."""
    layout, piece, side = ((src_layout, int(c.x.src_piece[i]), int(c.src_side[i])) if sending
                           else (c.plan.destination, int(c.x.dst_piece[i]), int(SourceSide.DESTINATION)))
    c_off, c_len = _pad_cols(*layout.local_regions(np.full(len(chunks[0]), piece), *_cut(chunks, layout.ndim)), c.k)
    return [Bucket(0, (_box_of(layout, piece, side, c_off[j], c_len[j]),)) for j in range(c_off.shape[0])]


def _message(spec: list | None, half: int) -> Message | None:
    """A message of a spec: its direct chunks, then its packed boxes bucketed by half-window."""
    if spec is None:
        return None
    peer, kind_value, directs, packed, relayed, from_destination = spec
    buckets: dict[int, list[BoxCopy]] = {}
    position = 0
    for b in packed:  # sequential layout; a bucket holds the boxes starting in one half-window
        index, offset = divmod(position, half)
        buckets.setdefault(index, []).append(BoxCopy(b.buffer, b.offsets, b.lengths, offset, b.nbytes))
        position += b.nbytes
    out = [Bucket(d.boxes[0].nbytes, d.boxes) for d in directs]
    for index in sorted(buckets):
        boxes = buckets[index]
        start = min(b.packed_offset for b in boxes)
        end = max(b.packed_offset + b.nbytes for b in boxes)
        boxes = tuple(BoxCopy(b.buffer, b.offsets, b.lengths, b.packed_offset - start, b.nbytes) for b in boxes)
        out.append(Bucket(end - start, boxes))
    return Message(peer, TransferKind(kind_value), tuple(out), relayed, from_destination)


def _steps(per_step: _StepSpecs, half: int) -> tuple[Step, ...]:
    """The steps of the specs, in (phase, round) order."""
    steps = []
    for (phase, rnd), entry in sorted(per_step.items()):
        recv = _message(entry.get("recv"), half)
        steps.append(Step(Phase(phase), rnd, _message(entry.get("send"), half), recv,
                          _forward_sends(entry.get("forward_send", {}), entry.get("recv"), half),
                          _forward_recvs(entry.get("forward_recv", {}), half)))
    return tuple(steps)


def _max_bucket_bytes(steps: tuple[Step, ...]) -> int:
    """The largest bucket or forward part of the steps (0 when there are none)."""
    return max([b.nbytes for s in steps for m in (s.send, s.recv) if m for b in m.buckets]
               + [p.nbytes for s in steps for f in s.forward_recvs + s.forward_sends for p in f.parts],
               default=0)


def _forward_sends(by_peer: dict[int, list], recv_spec, half: int) -> tuple[Forward, ...]:
    """A relay's forwards of one step: runs of the buckets of the message it receives there
    (a message of packed boxes only, so a copy's stream position is its place)."""
    if not by_peer:
        return ()
    if recv_spec is None or recv_spec[2]:
        raise ValueError("a forward needs a packed network message to forward from")
    # Where each bucket of the received message starts in the stream (see ``_message``), and
    # each box's place in its bucket (the index of its digest there).
    bucket_start: dict[int, int] = {}
    box_at: dict[int, int] = {}
    index_at: dict[int, int] = {}
    boxes_in: dict[int, int] = {}
    position = 0
    for b in recv_spec[3]:
        bucket = position // half
        bucket_start.setdefault(bucket, position)
        box_at[position] = b.nbytes
        index_at[position] = boxes_in.get(bucket, 0)
        boxes_in[bucket] = index_at[position] + 1
        position += b.nbytes
    for items in by_peer.values():
        for position, nbytes, _ in items:
            if box_at.get(position) != nbytes:
                raise AssertionError(f"a forward of {nbytes} bytes at {position} matches no received box")
    forwards = []
    for peer in sorted(by_peer):
        parts: dict[int, tuple[list[list[int]], list[int]]] = {}
        for position, nbytes, _ in sorted(by_peer[peer], key=lambda item: item[0]):
            bucket = position // half
            offset = position - bucket_start[bucket]
            spans, digests = parts.setdefault(bucket, ([], []))
            digests.append(index_at[position])
            if spans and spans[-1][0] + spans[-1][1] == offset:
                spans[-1][1] += nbytes  # touching runs travel as one
            else:
                spans.append([offset, nbytes])
        forwards.append(Forward(peer, tuple(
            ForwardPart(bucket, sum(n for _, n in spans), spans=tuple((o, n) for o, n in spans),
                        digests=tuple(digests))
            for bucket, (spans, digests) in sorted(parts.items()))))
    return tuple(forwards)


def _forward_recvs(by_peer: dict[int, list], half: int) -> tuple[Forward, ...]:
    """A needer's forwards of one step: per relay and network bucket, its boxes packed in
    stream order (the order the relay gathers them in)."""
    forwards = []
    for peer in sorted(by_peer):
        parts: dict[int, tuple[list[BoxCopy], list[list[int]], list[int]]] = {}
        for position, nbytes, target in sorted(by_peer[peer], key=lambda item: item[0]):
            boxes, spans, end = parts.setdefault(position // half, ([], [], [-1]))
            packed = sum(b.nbytes for b in boxes)
            boxes.append(BoxCopy(target.buffer, target.offsets, target.lengths, packed, nbytes))
            if end[0] == position:  # touches the previous run: the relay sends them as one
                spans[-1][1] += nbytes
            else:
                spans.append([packed, nbytes])
            end[0] = position + nbytes
        forwards.append(Forward(peer, tuple(
            ForwardPart(bucket, sum(b.nbytes for b in boxes), spans=tuple((o, n) for o, n in spans),
                        boxes=Bucket(sum(b.nbytes for b in boxes), tuple(boxes)))
            for bucket, (boxes, spans, _) in sorted(parts.items()))))
    return tuple(forwards)


def _run_elements(lengths: np.ndarray, shape: np.ndarray) -> int:
    """Elements of the longest contiguous runs of a box in a row-major buffer."""
    run = 1
    for d in reversed(range(len(shape))):
        run *= int(lengths[d])
        if lengths[d] != shape[d]:
            break
    return run


def _direct_chunks(offsets: np.ndarray, lengths: np.ndarray, src: tuple[Layout, int], dst: tuple[Layout, int],
                   direct_min: int, itemsize: int, limit: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Sub-boxes of a global box that are contiguous in both the source and destination
    buffers, when each carries at least ``direct_min`` bytes; else None (pack the box).

    Both runs are suffix products of the box's extents (local boxes match the global one up
    to size-1 dims), so the shorter run cuts both sides into the same chunks. Chunks above
    ``limit`` bytes are cut along their outer dims; a sub-range of the outermost dim of a
    contiguous run is still contiguous.
    """
    runs = []
    for layout, piece in (src, dst):
        _, ln = layout.local_regions(np.array([piece]), offsets[None, : layout.ndim], lengths[None, : layout.ndim])
        b = int(layout.piece_buffer[piece])
        nd = int(layout.buffer_ndim[b])
        runs.append(_run_elements(ln[0, :nd], layout.buffer_shape[b, :nd]))
    chunk = min(runs)
    if chunk * itemsize < direct_min:
        return None
    dims = [d for d in range(lengths.size) if lengths[d] > 1]
    suffix, fixed = 1, len(dims)
    while fixed > 0 and suffix * int(lengths[dims[fixed - 1]]) <= chunk:
        fixed -= 1
        suffix *= int(lengths[dims[fixed]])
    lead = dims[:fixed]
    grid = np.stack(np.meshgrid(*[np.arange(int(lengths[d])) for d in lead], indexing="ij"), -1).reshape(-1, len(lead)) \
        if lead else np.zeros((1, 0), dtype=np.int64)
    c_off = np.tile(offsets, (grid.shape[0], 1))
    c_len = np.tile(lengths, (grid.shape[0], 1))
    for j, d in enumerate(lead):
        c_off[:, d] += grid[:, j]
        c_len[:, d] = 1
    while True:
        nbytes = np.prod(c_len, axis=1) * itemsize
        big = nbytes > limit
        if not big.any():
            return c_off, c_len
        d = int(np.argmax(c_len[0] > 1))  # chunks share their shape: cut all the same way
        slab = int(nbytes[0]) // int(c_len[0, d])
        per = max(limit // slab, 1)
        parts = -(-int(c_len[0, d]) // per)
        starts = np.arange(parts) * per
        c_off = np.repeat(c_off, parts, axis=0)
        c_len = np.repeat(c_len, parts, axis=0)
        c_off[:, d] += np.tile(starts, c_off.shape[0] // parts)
        c_len[:, d] = np.minimum(per, c_len[:, d] - np.tile(starts, c_len.shape[0] // parts))


def _cut(chunks: tuple[np.ndarray, np.ndarray], ndim: int) -> tuple[np.ndarray, np.ndarray]:
    return chunks[0][:, :ndim], chunks[1][:, :ndim]


def _pad_cols(off: np.ndarray, ln: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    if off.shape[1] >= k:
        return off, ln
    o = np.zeros((off.shape[0], k), dtype=np.int64)
    n = np.ones((ln.shape[0], k), dtype=np.int64)
    o[:, : off.shape[1]], n[:, : ln.shape[1]] = off, ln
    return o, n


def _box_of(layout: Layout, piece: int, side: int, off: np.ndarray, ln: np.ndarray) -> BoxCopy:
    b = int(layout.piece_buffer[piece])
    nd = int(layout.buffer_ndim[b])
    itemsize = DTYPE_ITEMSIZE[DTYPES[int(layout.buffer_dtype[b])]]
    return BoxCopy((side, layout.buffer_names[int(layout.buffer_name[b])]), tuple(int(v) for v in off[:nd]),
                   tuple(int(v) for v in ln[:nd]), 0, int(np.prod(ln[:nd])) * itemsize)
