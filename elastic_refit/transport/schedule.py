"""One rank's view of a plan: local copies, then steps of (send message, receive message).

Built once per (plan, rank) and reused every refit of an epoch. Sender and receiver derive
the same bucket boundaries from the same plan rows, so no sizes travel on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elastic_refit.layout import DTYPE_ITEMSIZE, DTYPES, Layout
from elastic_refit.plan import Phase, Plan, SourceSide, TransferKind

# A local buffer is named by its side and name; a colocated rank has both sides.
BufferRef = tuple[int, str]  # (SourceSide value, buffer name)


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

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


@dataclass(frozen=True, slots=True)
class Step:
    """In one (phase, round) a rank sends at most one message and receives at most one."""

    phase: Phase
    round: int
    send: Message | None
    recv: Message | None


@dataclass(frozen=True, slots=True)
class LocalCopy:
    src: BoxCopy
    dst: BoxCopy


@dataclass(frozen=True, slots=True)
class BufferSpec:
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class RankSchedule:
    """Everything rank ``rank`` does for one plan, in execution order."""

    rank: int
    fingerprint: str
    local_copies: tuple[LocalCopy, ...]
    steps: tuple[Step, ...]
    buffers: dict[BufferRef, BufferSpec]  # every buffer this rank reads or writes
    max_bucket_bytes: int

    @property
    def send_bytes(self) -> int:
        return sum(s.send.nbytes for s in self.steps if s.send)

    @property
    def recv_bytes(self) -> int:
        return sum(s.recv.nbytes for s in self.steps if s.recv)

    def bytes_by_kind(self) -> dict[str, int]:
        out = {"network_send": 0, "network_recv": 0, "intra_send": 0, "intra_recv": 0,
               "local": sum(c.dst.nbytes for c in self.local_copies)}
        for s in self.steps:
            for direction, msg in (("send", s.send), ("recv", s.recv)):
                if msg is not None:
                    key = "network" if msg.kind == TransferKind.NETWORK else "intra"
                    out[f"{key}_{direction}"] += msg.nbytes
        return out


def _buffer_specs(layout: Layout, rank: int, side: SourceSide) -> dict[BufferRef, BufferSpec]:
    out = {}
    for b in np.flatnonzero(layout.buffer_rank == rank).tolist():
        nd = int(layout.buffer_ndim[b])
        out[(int(side), layout.buffer_names[int(layout.buffer_name[b])])] = BufferSpec(
            tuple(int(s) for s in layout.buffer_shape[b, :nd]), DTYPES[int(layout.buffer_dtype[b])]
        )
    return out


def build_rank_schedule(plan: Plan, rank: int) -> RankSchedule:
    """Derive rank ``rank``'s local copies and message steps from ``plan``."""
    t = plan.transfers
    rows = plan.rows_for(rank)
    x = plan.expand(rows)
    k = t.offsets.shape[1]
    offsets, lengths = t.offsets[x.row], t.lengths[x.row]
    from_dst = t.src_side[x.row] == int(SourceSide.DESTINATION)

    def regions(layout: Layout, pieces: np.ndarray, sel: np.ndarray):
        off = np.zeros((pieces.size, k), dtype=np.int64)
        ln = np.ones((pieces.size, k), dtype=np.int64)
        idx = np.flatnonzero(sel)
        if idx.size:
            lk = layout.ndim
            o, n = layout.local_regions(pieces[idx], offsets[idx, :lk], lengths[idx, :lk])
            off[idx, :lk], ln[idx, :lk] = o, n
        return off, ln

    src_off, src_len = regions(plan.source, x.src_piece, ~from_dst)
    o2, l2 = regions(plan.destination, x.src_piece, from_dst)
    src_off[from_dst], src_len[from_dst] = o2[from_dst], l2[from_dst]
    dst_off, dst_len = regions(plan.destination, x.dst_piece, np.ones(x.row.size, dtype=bool))

    def box(side: int, pieces: np.ndarray, i: int, off: np.ndarray, ln: np.ndarray, packed: int) -> BoxCopy:
        layout = plan.destination if side == int(SourceSide.DESTINATION) else plan.source
        b = int(layout.piece_buffer[int(pieces[i])])
        nd = int(layout.buffer_ndim[b])
        name = layout.buffer_names[int(layout.buffer_name[b])]
        itemsize = DTYPE_ITEMSIZE[DTYPES[int(layout.buffer_dtype[b])]]
        return BoxCopy((side, name), tuple(int(v) for v in off[i, :nd]), tuple(int(v) for v in ln[i, :nd]),
                       packed, int(np.prod(ln[i, :nd])) * itemsize)

    half = plan.options.max_transfer_bytes
    bucket_index, in_bucket = plan.options.bucket_of(x.message_offset)
    kind = t.kind[x.row]
    src_side = t.src_side[x.row]
    local_copies = []
    per_step: dict[tuple[int, int], dict[str, object]] = {}
    for i in range(x.row.size):
        row = int(x.row[i])
        if kind[i] == int(TransferKind.LOCAL):
            local_copies.append(LocalCopy(
                box(int(src_side[i]), x.src_piece, i, src_off, src_len, 0),
                box(int(SourceSide.DESTINATION), x.dst_piece, i, dst_off, dst_len, 0),
            ))
            continue
        key = (int(t.phase[row]), int(t.round[row]))
        entry = per_step.setdefault(key, {})
        if int(t.src_rank[row]) == rank:
            msg = entry.setdefault("send", (int(t.dst_rank[row]), int(kind[i]), {}))
            copy = box(int(src_side[i]), x.src_piece, i, src_off, src_len, int(in_bucket[i]))
        else:
            msg = entry.setdefault("recv", (int(t.src_rank[row]), int(kind[i]), {}))
            copy = box(int(SourceSide.DESTINATION), x.dst_piece, i, dst_off, dst_len, int(in_bucket[i]))
        msg[2].setdefault(int(bucket_index[i]), []).append(copy)

    def message(spec) -> Message | None:
        if spec is None:
            return None
        peer, kind_value, buckets = spec
        out = []
        for index in sorted(buckets):
            boxes = buckets[index]
            start = min(b.packed_offset for b in boxes)
            end = max(b.packed_offset + b.nbytes for b in boxes)
            boxes = tuple(BoxCopy(b.buffer, b.offsets, b.lengths, b.packed_offset - start, b.nbytes)
                          for b in sorted(boxes, key=lambda b: b.packed_offset))
            out.append(Bucket(end - start, boxes))
        return Message(peer, TransferKind(kind_value), tuple(out))

    steps = tuple(
        Step(Phase(phase), rnd, message(entry.get("send")), message(entry.get("recv")))
        for (phase, rnd), entry in sorted(per_step.items())
    )
    buffers = {**_buffer_specs(plan.source, rank, SourceSide.SOURCE),
               **_buffer_specs(plan.destination, rank, SourceSide.DESTINATION)}
    max_bucket = max((b.nbytes for s in steps for m in (s.send, s.recv) if m for b in m.buckets), default=0)
    assert max_bucket <= 2 * half, "planner guarantees buckets within bucket_bytes"
    return RankSchedule(rank, plan.fingerprint, tuple(local_copies), steps, buffers, max_bucket)
