"""The classic gather-and-broadcast refit, for side-by-side numbers with the reshard.

For every destination tensor, in destination order:

1. **gather** — the *root* is the source rank holding most bytes of the tensor (ties: the
   lowest rank; the rule of ``elastic_refit.plan.planner.gather_broadcast_bytes``). It
   copies its own pieces into a staging buffer shaped like the whole tensor, and every
   region it lacks is sent by one holder (other source pieces in (rank, piece) order,
   each contributing only what nobody before it covered).
2. **broadcast** — the whole tensor travels down a pipelined chain root -> d1 -> d2 ...
   over the destination ranks holding part of it (ascending rank, the root excluded):
   chunk k is received from the predecessor and forwarded to the successor while chunk
   k+1 is already arriving.
3. **copy-out** — each destination rank copies its pieces out of its staging tensor.

It uses the same ``Transport`` (point-to-point only) as the executor. The per-rank
schedule is built once; ``run`` is cheap to repeat. Memory per rank: one staging tensor
(the largest tensor it touches, kept between runs) plus two chunk buffers for regions
that are not contiguous on one side. Bytes sent and received, summed over ranks, equal
``plan.stats.gather_broadcast_bytes``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from elastic_refit.errors import TransportAborted, brief
from elastic_refit.layout import Layout, LogicalTensor
from elastic_refit.log import ensure_configured
from elastic_refit.plan import Plan
from elastic_refit.transport.buffers import byte_view, resolve_buffers, split_box
from elastic_refit.transport.protocol import Transport, post_recv, post_send
from elastic_refit.transport.schedule import rank_buffers

log = structlog.get_logger("elastic_refit.transport")  # lazy: follows whatever configuration is current

MiB = 1 << 20
_GATHER, _BROADCAST = 0, 1
_MAX_ITEMS = 1 << 16


@dataclass(frozen=True, slots=True)
class BaselineOptions:
    """``chunk_bytes`` is the pipelining unit of the broadcast chain and the size of the
    two buffers used for regions that are not contiguous; ``window`` bounds the receives
    a rank keeps posted ahead."""

    chunk_bytes: int = 8 * MiB
    window: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be an integer >= 1, got {self.chunk_bytes!r}")
        if not isinstance(self.window, int) or self.window < 2:
            raise ValueError(f"window must be an integer >= 2, got {self.window!r}")


@dataclass(frozen=True, slots=True)
class BaselineReport:
    """What one rank moved in one gather-and-broadcast refit: bytes (``*_bytes``), counts
    (``num_*``: tensors refit, messages sent and received) and the wall time (``seconds``)."""

    rank: int
    seconds: float
    send_bytes: int
    recv_bytes: int
    gather_send_bytes: int
    gather_recv_bytes: int
    broadcast_send_bytes: int
    broadcast_recv_bytes: int
    local_bytes: int
    num_tensors: int
    num_messages: int
    staging_bytes: int


@dataclass(frozen=True, slots=True)
class _Region:
    """A box of a contiguous container (a named buffer, or the staging tensor when
    ``buffer`` is None), in bytes: ``spans`` per dim of the container's byte view;
    ``flat`` is (offset, nbytes) when the box is one contiguous span."""

    buffer: str | None
    shape: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    flat: tuple[int, int] | None
    nbytes: int


@dataclass(frozen=True, slots=True)
class _Item:
    """One message: ``region`` is the local side (source buffer or staging)."""

    peer: int
    tag: int
    region: _Region


@dataclass(frozen=True, slots=True)
class _Copy:
    src: _Region
    dst: _Region


@dataclass(frozen=True, slots=True)
class _TensorOp:
    """This rank's part in moving one destination tensor."""

    index: int
    name: str
    nbytes: int
    root: int
    own: tuple[_Copy, ...]  # root: its source pieces -> staging
    gather_recv: tuple[_Item, ...]  # root: regions from other holders -> staging
    gather_send: tuple[_Item, ...]  # holder: source regions -> root
    pred: int | None  # broadcast: receive the chunks from
    succ: int | None  # broadcast: forward the chunks to
    chunks: tuple[tuple[int, int], ...]  # (offset, nbytes) of the staging tensor
    copy_out: tuple[_Copy, ...]  # destination: staging -> its pieces


def _byte_shape(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    shape = shape or (1,)
    return tuple(shape[:-1]) + (shape[-1] * itemsize,)


def _region(buffer: str | None, shape: tuple[int, ...], itemsize: int, offsets, lengths) -> _Region:
    """The byte region of element box (offsets, lengths) in a contiguous container."""
    nd = len(shape)
    offsets = [int(v) for v in offsets[:nd]] or [0]
    lengths = [int(v) for v in lengths[:nd]] or [1]
    bshape = _byte_shape(shape, itemsize)
    spans = [(o, o + n) for o, n in zip(offsets, lengths, strict=True)]
    spans[-1] = (offsets[-1] * itemsize, (offsets[-1] + lengths[-1]) * itemsize)
    nbytes = math.prod(b - a for a, b in spans)
    # Contiguous when every dim after the first one longer than 1 is taken whole.
    lead = 0
    while lead < len(spans) - 1 and spans[lead][1] - spans[lead][0] == 1:
        lead += 1
    flat = None
    if all(spans[j] == (0, bshape[j]) for j in range(lead + 1, len(spans))):
        stride, offset = 1, 0
        for j in reversed(range(len(spans))):
            offset += spans[j][0] * stride
            stride *= bshape[j]
        flat = (offset, nbytes)
    return _Region(buffer, bshape, tuple(spans), flat, nbytes)


def _subtract(a: tuple[list[int], list[int]], b: tuple[list[int], list[int]]) -> list[tuple[list[int], list[int]]]:
    """Box a minus box b as disjoint boxes (at most two per dim)."""
    (ao, al), (bo, bl) = a, b
    lo = [max(x, y) for x, y in zip(ao, bo, strict=True)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(ao, al, bo, bl, strict=True)]
    if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
        return [a]
    out = []
    cur_o, cur_l = list(ao), list(al)
    for d in range(len(ao)):
        if cur_o[d] < lo[d]:  # slab below the overlap in dim d
            o, n = list(cur_o), list(cur_l)
            n[d] = lo[d] - cur_o[d]
            out.append((o, n))
        end = cur_o[d] + cur_l[d]
        if end > hi[d]:  # slab above
            o, n = list(cur_o), list(cur_l)
            o[d], n[d] = hi[d], end - hi[d]
            out.append((o, n))
        cur_o[d], cur_l[d] = lo[d], hi[d] - lo[d]
    return out


def _tag(tensor: int, phase: int, item: int) -> int:
    # Distinct tags per (tensor, phase, item); gloo matches on them, NCCL on order.
    return ((tensor & 0x3FFF) << 17) | (phase << 16) | item


def _piece_box(layout: Layout, p: int, nd: int) -> tuple[list[int], list[int]]:
    """Piece ``p``'s global box over the tensor's first ``nd`` dims, as plain int lists."""
    return ([int(v) for v in layout.piece_offsets[p, :nd]], [int(v) for v in layout.piece_lengths[p, :nd]])


def _staging_region(t: LogicalTensor, off, ln) -> _Region:
    """The element box (off, ln) of tensor ``t``'s staging copy (a whole, dense tensor)."""
    return _region(None, tuple(t.shape), t.itemsize, off, ln)


def _source_region(src: Layout, p: int, t: LogicalTensor, off, ln) -> _Region:
    """Where the global box (off, ln), inside source piece ``p``, lies in that piece's buffer."""
    nd, item = len(t.shape), t.itemsize
    lo, ll = src.local_regions(np.array([p]), np.array([off + [0] * (src.ndim - nd)]),
                               np.array([ln + [1] * (src.ndim - nd)]))
    b = int(src.piece_buffer[p])
    bnd = int(src.buffer_ndim[b])
    return _region(src.buffer_names[int(src.buffer_name[b])],
                   tuple(int(v) for v in src.buffer_shape[b, :bnd]), item, lo[0, :bnd], ll[0, :bnd])


def _gather_root(src: Layout, t: LogicalTensor, s_pieces: list[int], src_nbytes) -> int:
    """The source rank holding most bytes of ``t`` (ties: the lowest), as the planner counts it."""
    if not s_pieces:
        raise ValueError(f"tensor {t.name!r} has no source pieces to gather from")
    held: dict[int, int] = {}
    for p in s_pieces:
        r = int(src.piece_rank[p])
        held[r] = held.get(r, 0) + int(src_nbytes[p])
    return min(held, key=lambda r: (-held[r], r))


def _own_copies(src: Layout, t: LogicalTensor, s_pieces: list[int], root: int) -> list[_Copy]:
    """The root's local copies of its own source pieces into staging."""
    nd = len(t.shape)
    own = []
    for p in s_pieces:
        if int(src.piece_rank[p]) == root:
            o, n = _piece_box(src, p, nd)
            own.append(_Copy(_source_region(src, p, t, o, n), _staging_region(t, o, n)))
    return own


def _gather_regions(src: Layout, t: LogicalTensor, s_pieces: list[int], root: int,
                    limit: int) -> dict[int, list[tuple[int, list[int], list[int]]]]:
    """Per sender rank, the (piece, offsets, lengths) it sends the root: each non-root piece in
    (rank, piece) order gives only what nobody before it covered, cut to ``limit`` bytes."""
    nd, item = len(t.shape), t.itemsize
    covered = [_piece_box(src, p, nd) for p in s_pieces if int(src.piece_rank[p]) == root]
    per_sender: dict[int, list[tuple[int, list[int], list[int]]]] = {}
    others = sorted((p for p in s_pieces if int(src.piece_rank[p]) != root),
                    key=lambda p: (int(src.piece_rank[p]), p))
    for p in others:
        todo = [_piece_box(src, p, nd)]
        for c in covered:
            todo = [part for r in todo for part in _subtract(r, c)]
        for o, n in todo:
            if math.prod(n) == 0:
                continue
            covered.append((o, n))
            for so, sn in split_box(o, n, limit // item):  # at most limit bytes each
                per_sender.setdefault(int(src.piece_rank[p]), []).append((p, so, sn))
    missing = t.numel - sum(math.prod(n) for _, n in covered)
    if missing != 0:
        raise ValueError(f"tensor {t.name!r}: the source pieces leave {missing} elements uncovered")
    return per_sender


def _round_robin(t: LogicalTensor, per_sender: dict[int, list[tuple[int, list[int], list[int]]]]) -> list[tuple]:
    """The root takes the senders round-robin so that they all stream at once; the message
    index in this order is part of each tag."""
    order = []
    queues = [deque(per_sender[r]) for r in sorted(per_sender)]
    senders = sorted(per_sender)
    while any(queues):
        for r, q in zip(senders, queues, strict=True):
            if q:
                order.append((r, *q.popleft()))
    if len(order) >= _MAX_ITEMS:
        raise ValueError(f"tensor {t.name!r}: {len(order)} gather messages; raise chunk_bytes")
    return order


def _gather_items(src: Layout, t: LogicalTensor, ti: int, rank: int, root: int,
                  order: list[tuple]) -> tuple[list[_Item], list[_Item]]:
    """This rank's gather messages: the root's receives into staging, a holder's sends."""
    gather_recv, gather_send = [], []
    for i, (r, p, o, n) in enumerate(order):
        if rank == root:
            gather_recv.append(_Item(r, _tag(ti, _GATHER, i), _staging_region(t, o, n)))
        elif rank == r:
            gather_send.append(_Item(root, _tag(ti, _GATHER, i), _source_region(src, p, t, o, n)))
    return gather_recv, gather_send


def _broadcast_chunks(t: LogicalTensor, limit: int) -> tuple[tuple[int, int], ...]:
    """(offset, nbytes) of each chunk of the staging tensor that the chain pipelines."""
    nchunks = -(-t.nbytes // limit)
    if nchunks >= _MAX_ITEMS:
        raise ValueError(f"tensor {t.name!r}: {nchunks} broadcast chunks; raise chunk_bytes")
    return tuple((c * limit, min(limit, t.nbytes - c * limit)) for c in range(nchunks))


def _copy_out(dst: Layout, t: LogicalTensor, d_pieces: list[int], rank: int) -> list[_Copy]:
    """This rank's copies from staging into each of its destination pieces of ``t``."""
    nd, item = len(t.shape), t.itemsize
    copy_out = []
    for p in d_pieces:
        if int(dst.piece_rank[p]) != rank:
            continue
        o, n = _piece_box(dst, p, nd)
        b = int(dst.piece_buffer[p])
        bnd = int(dst.buffer_ndim[b])
        copy_out.append(_Copy(_staging_region(t, o, n), _region(
            dst.buffer_names[int(dst.buffer_name[b])], tuple(int(v) for v in dst.buffer_shape[b, :bnd]),
            item, dst.piece_local_offsets[p, :bnd], dst.piece_local_lengths[p, :bnd])))
    return copy_out


def _tensor_op(src: Layout, dst: Layout, rank: int, limit: int, ti: int, t: LogicalTensor, s_pieces: list[int],
               d_pieces: list[int], src_nbytes) -> _TensorOp | None:
    """Rank ``rank``'s part in moving destination tensor ``ti``; None when it takes no part.
    Every rank derives the same root, gather order and chain, so tags match."""
    root = _gather_root(src, t, s_pieces, src_nbytes)
    receivers = sorted({int(dst.piece_rank[p]) for p in d_pieces} - {root})
    in_chain = rank == root or rank in receivers
    own = _own_copies(src, t, s_pieces, root) if rank == root else []
    order = _round_robin(t, _gather_regions(src, t, s_pieces, root, limit))
    gather_recv, gather_send = _gather_items(src, t, ti, rank, root, order)
    if not (in_chain or gather_send):
        return None
    chain = [root, *receivers]
    pred = succ = None
    if in_chain:
        k = chain.index(rank)
        pred = chain[k - 1] if k > 0 else None
        succ = chain[k + 1] if k + 1 < len(chain) else None
    chunks = _broadcast_chunks(t, limit)
    copy_out = _copy_out(dst, t, d_pieces, rank) if in_chain else []
    return _TensorOp(ti, t.name, t.nbytes, root, tuple(own), tuple(gather_recv), tuple(gather_send),
                     pred, succ, chunks if in_chain and len(chain) > 1 else (), tuple(copy_out))


def build_baseline_schedule(plan: Plan, rank: int, options: BaselineOptions) -> tuple[_TensorOp, ...]:
    """Rank ``rank``'s part of the gather-and-broadcast refit of ``plan``'s layouts."""
    src, dst = plan.source, plan.destination
    src_nbytes = src.piece_nbytes()
    src_starts = np.searchsorted(src.piece_tensor, np.arange(len(src.tensors) + 1))
    dst_starts = np.searchsorted(dst.piece_tensor, np.arange(len(dst.tensors) + 1))
    ops = []
    for ti, t in enumerate(dst.tensors):
        si = src.tensor_index(t.name)
        s_pieces = list(range(int(src_starts[si]), int(src_starts[si + 1])))
        d_pieces = list(range(int(dst_starts[ti]), int(dst_starts[ti + 1])))
        op = _tensor_op(src, dst, rank, options.chunk_bytes, ti, t, s_pieces, d_pieces, src_nbytes)
        if op is not None:
            ops.append(op)
    return tuple(ops)


class GatherBroadcast:
    """Runs rank ``transport.rank``'s part of the classic refit of ``plan``'s layouts."""

    def __init__(self, plan: Plan, transport: Transport, options: BaselineOptions | None = None) -> None:
        ensure_configured()  # structlog's default would print to stdout
        if getattr(plan, "cast", None) is not None:
            raise ValueError(f"gather-and-broadcast moves the source's bytes as they are; this plan casts "
                             f"({plan.cast.describe()}): publish in the destination's dtypes")  # type: ignore[attr-defined]
        self.plan = plan
        self.transport = transport
        self.options = options or BaselineOptions()
        self.rank = transport.rank
        self.device = transport.device
        self.ops = build_baseline_schedule(plan, self.rank, self.options)
        self.buffers = rank_buffers(plan, self.rank)
        in_chain = [op for op in self.ops if op.chunks or op.own or op.gather_recv or op.copy_out]
        self.staging_needed = max((op.nbytes for op in in_chain), default=0)
        self.chunk_needed = max([it.region.nbytes for op in self.ops for it in (*op.gather_recv, *op.gather_send)
                                 if it.region.flat is None] + [0])
        g = self.send_recv_bytes()
        self.send_bytes, self.recv_bytes = g["send"], g["recv"]
        self._staging: torch.Tensor | None = None
        self._chunks: list[torch.Tensor] = []

    def send_recv_bytes(self) -> dict[str, int]:
        """Bytes this rank sends and receives per refit, by phase."""
        out = {"gather_send": 0, "gather_recv": 0, "broadcast_send": 0, "broadcast_recv": 0, "local": 0}
        for op in self.ops:
            out["gather_send"] += sum(it.region.nbytes for it in op.gather_send)
            out["gather_recv"] += sum(it.region.nbytes for it in op.gather_recv)
            if op.chunks:
                out["broadcast_send"] += op.nbytes if op.succ is not None else 0
                out["broadcast_recv"] += op.nbytes if op.pred is not None else 0
            out["local"] += sum(c.dst.nbytes for c in (*op.own, *op.copy_out))
        out["send"] = out["gather_send"] + out["broadcast_send"]
        out["recv"] = out["gather_recv"] + out["broadcast_recv"]
        return out

    @property
    def staging_allocated(self) -> int:
        return (self._staging.numel() if self._staging is not None else 0) + sum(c.numel() for c in self._chunks)

    def release(self) -> None:
        """Drop the staging buffers (the next run allocates them again)."""
        self._staging = None
        self._chunks = []

    def run(self, source: Mapping[str, torch.Tensor] | None = None,
            destination: Mapping[str, torch.Tensor] | None = None) -> BaselineReport:
        """Gather every tensor on its root and broadcast it whole; ``source``/``destination``
        map buffer names to this rank's tensors. Raises ``TransportAborted`` when this or
        any other rank fails (the transport is aborted so peers do not hang)."""
        start = time.perf_counter()
        num_messages = 0
        try:
            given = resolve_buffers(self.buffers, source or {}, destination or {}, rank=self.rank,
                                    device=self.device)
            buffers = {ref: byte_view(t) for ref, t in given.items()}
            self._ensure_staging()
            for op in self.ops:
                num_messages += self._tensor(op, buffers)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except BaseException as exc:
            log.warning("transport.baseline.failed", rank=self.rank,
                        error=brief(exc))
            self.transport.abort()
            raise
        if not self.transport.vote(True):
            raise TransportAborted(f"rank {self.rank}: another rank failed the refit", rank=self.rank, phase="vote")
        g = self.send_recv_bytes()
        report = BaselineReport(
            rank=self.rank, seconds=time.perf_counter() - start, send_bytes=g["send"], recv_bytes=g["recv"],
            gather_send_bytes=g["gather_send"], gather_recv_bytes=g["gather_recv"],
            broadcast_send_bytes=g["broadcast_send"], broadcast_recv_bytes=g["broadcast_recv"],
            local_bytes=g["local"], num_tensors=len(self.ops), num_messages=num_messages,
            staging_bytes=self.staging_allocated,
        )
        log.info("transport.baseline.done", rank=self.rank, seconds=report.seconds, sent_bytes=report.send_bytes,
                 recv_bytes=report.recv_bytes, num_tensors=report.num_tensors, num_messages=report.num_messages)
        return report

    # ---- internals ---------------------------------------------------------------------
    def _ensure_staging(self) -> None:
        if self._staging is None and self.staging_needed:
            self._staging = torch.empty(self.staging_needed, dtype=torch.uint8, device=self.device)
        if not self._chunks and self.chunk_needed:
            self._chunks = [torch.empty(self.chunk_needed, dtype=torch.uint8, device=self.device) for _ in range(2)]

    def _view(self, region: _Region, side: int, buffers, stage: torch.Tensor) -> torch.Tensor:
        base = stage if region.buffer is None else buffers[(side, region.buffer)]
        if region.flat is not None:
            offset, n = region.flat
            return base.reshape(-1)[offset : offset + n]
        if region.buffer is None:
            base = base.view(region.shape)
        return base[tuple(slice(a, b) for a, b in region.spans)]

    def _tensor(self, op: _TensorOp, buffers) -> int:
        stage = self._staging[: op.nbytes] if self._staging is not None else None  # type: ignore[index]
        messages = 0
        where = f"tensor {op.name!r}"
        for c in op.own:
            dst = self._view(c.dst, 0, buffers, stage)
            dst.copy_(self._view(c.src, 0, buffers, stage).reshape(dst.shape))
        if op.gather_recv:
            messages += self._stream(op.gather_recv, 0, buffers, stage, receive=True, what=f"gather ({where})")
        if op.gather_send:
            messages += self._stream(op.gather_send, 0, buffers, stage, receive=False, what=f"gather ({where})")
        if op.chunks:
            messages += self._chain(op, stage, where)
        for c in op.copy_out:
            dst = self._view(c.dst, 1, buffers, stage)
            dst.copy_(self._view(c.src, 1, buffers, stage).reshape(dst.shape))
        return messages

    def _stream(self, items: tuple[_Item, ...], side: int, buffers, stage, *, receive: bool, what: str) -> int:
        """Send or receive ``items`` in order with up to ``window`` in flight; regions that
        are not contiguous go through the two chunk buffers."""
        transport, window = self.transport, self.options.window
        inflight: deque = deque()  # (work, item, chunk index or None, view)
        free = [0, 1]

        def complete() -> None:
            work, it, slot, view = inflight.popleft()
            transport.wait(work, it.peer, what)
            if slot is not None:
                if receive:
                    view.copy_(self._chunks[slot][: it.region.nbytes].view(view.shape))
                free.append(slot)

        for it in items:
            direct = it.region.flat is not None
            while len(inflight) >= window or (not direct and not free):
                complete()
            view = self._view(it.region, side, buffers, stage)
            if direct:
                work = post_recv(transport, view, it.peer, it.tag) if receive else post_send(transport, view, it.peer, it.tag)
                inflight.append((work, it, None, view))
                continue
            slot = free.pop(0)
            flat = self._chunks[slot][: it.region.nbytes]
            if receive:
                work = post_recv(transport, flat, it.peer, it.tag)
            else:
                flat.view(view.shape).copy_(view)
                work = post_send(transport, flat, it.peer, it.tag)
            inflight.append((work, it, slot, view))
        while inflight:
            complete()
        return len(items)

    def _chain(self, op: _TensorOp, stage: torch.Tensor, where: str) -> int:
        """Pipelined chain broadcast of the staging tensor: receive chunk k from the
        predecessor, forward it to the successor while later chunks arrive."""
        transport, window = self.transport, self.options.window
        flat = stage.reshape(-1)
        views = [flat[o : o + n] for o, n in op.chunks]
        tags = [_tag(op.index, _BROADCAST, k) for k in range(len(views))]
        sends: deque = deque()
        what_recv, what_send = f"broadcast receive ({where})", f"broadcast send ({where})"
        if op.pred is None:
            # The root: everything is in staging, post all sends.
            for v, tag in zip(views, tags, strict=True):
                sends.append(post_send(transport, v, op.succ, tag))  # type: ignore[arg-type]
        else:
            recvs: deque = deque()
            ahead = 0
            for k in range(len(views)):
                while ahead < len(views) and ahead < k + window:
                    recvs.append(post_recv(transport, views[ahead], op.pred, tags[ahead]))
                    ahead += 1
                transport.wait(recvs.popleft(), op.pred, what_recv)
                if op.succ is not None:
                    sends.append(post_send(transport, views[k], op.succ, tags[k]))
        while sends:
            transport.wait(sends.popleft(), op.succ, what_send)  # type: ignore[arg-type]
        return len(views) * ((op.pred is not None) + (op.succ is not None))
