"""Planning in the destination format: layouts in FP8 + scales, and the partial-amax exchange.

A quantized destination tensor ``T`` (``TensorFormats``) is planned as two logical tensors of
the planner's own layouts (``format_layouts``), on both sides:

- ``T`` itself in ``float8_e4m3fn`` (one byte per element), with the pieces it has, and
- its scales ``T + suffix`` (``weight_scale_inv``: float32, or ``weight_scale``: E8M0 codes)
  of shape ``fmt.scale_shape(T.shape)``, one piece per piece of ``T``: the blocks its box
  touches (``DestinationFormat.block_box``).

Buffers holding ``T`` become ``float8_e4m3fn`` buffers of the same shape, and each gets a
scale buffer ``name + suffix`` beside it: the block grid of the local buffer, each piece's
blocks placed in that piece's phase (a piece at global row ``g`` and local row ``l`` puts its
block of local row ``x`` at scale row ``(x + p) // B``, ``p = (g - l) mod B``). For
block-aligned shards ``p`` is 0 and this is vLLM's ``[ceil(rows / B), ceil(cols / B)]``; a
fused buffer of unaligned shards (gate and up of 576 rows each) gets each piece's blocks after
the previous piece's (rows 0-4 and 5-9), and two pieces whose blocks would share a scale row
are refused as overlapping pieces. So destination pieces that cut blocks (TP
shards of 576 rows) are planned exactly: each destination rank receives the FP8 bytes of its
elements and the scales of every block it touches, and two destination ranks of a domain
that share a block get its scale once over the network and once more over NVLink.

The planner (``make_plan``) then runs unchanged on those layouts, so every figure (bytes
moved, cross-domain bytes, lower bound, gather-and-broadcast, per-rank NIC bytes, predicted
seconds) is counted in the destination format, scales included, and the domain dedupe,
sender balance and schedule apply to FP8 bytes and scales alike. The sender of a row
quantizes what it sends (the executor's source buffers of a quantized tensor are its
quantized FP8 copy and scales, ``quantize_source_buffers``); a destination domain receives
each block from one sender, once, and fans it out.

**Blocks split across source shards: partial-amax exchange.** A block whose elements lie in
several source regions (a TP shard boundary inside a block) cannot be quantized by one of
its holders alone: its scale needs the amax of the whole block. Each rank that sends from
such a region receives, for every other region touching the region's blocks, the partial
amax (float32) of that region over the shared blocks from one holder of it (itself when it
holds it; else a holder in its own domain, so the exchange stays on NVLink where it can; else
any holder, rotating), combines them with ``max`` (exact: ``kernels.quantize.combine_amax``)
and quantizes its own elements with the combined scales: bit-identical to quantizing the
whole block. The exchange (``AmaxExchange``) is part of the plan; its bytes (4 per block per
row) are counted in the plan's figures: network rows in the cross-domain bytes, in the busiest
NICs and (being the least any exact quantization of that split needs once the senders are
chosen) in the lower bound; NVLink rows in the intra-domain bytes. Routing the other
holders' BF16 pieces to one quantizing holder was the alternative; it moves up to a whole
block of BF16 per split block, the exchange 4 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elastic_refit.layout import DTYPES, Layout, LayoutBuilder, Topology
from elastic_refit.layout.core import readonly_column
from elastic_refit.layout.formats import DestinationFormat, TensorFormats
from elastic_refit.plan.types import TransferKind, Uncovered

__all__ = ["AMAX_ITEMSIZE", "AmaxExchange", "Quantization", "destination_format_layout", "format_layouts"]

AMAX_ITEMSIZE = 4  # a partial amax travels as float32, whatever the format's scale dtype


@dataclass(frozen=True, eq=False)
class AmaxExchange:
    """Rows of the partial-amax exchange (module docstring), one per (consumer rank, region
    it sends from, other region touching its blocks): ``provider`` computes the partial amax
    of its piece ``provider_piece`` (a piece of the planner's source layout) over the blocks
    ``block_offsets``/``block_lengths`` (lead dims in elements, last two in blocks) and
    ``consumer`` combines it into the scales of its piece ``consumer_piece``. Rows whose
    provider is the consumer cost nothing; ``kind`` is ``TransferKind`` (LOCAL, INTRA or
    NETWORK), ``nbytes`` what a row moves."""

    tensor: np.ndarray
    block_offsets: np.ndarray
    block_lengths: np.ndarray
    provider: np.ndarray
    provider_piece: np.ndarray
    consumer: np.ndarray
    consumer_piece: np.ndarray
    kind: np.ndarray
    nbytes: np.ndarray

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            object.__setattr__(self, name, readonly_column(np.asarray(getattr(self, name), dtype=np.int64)))

    def __len__(self) -> int:
        return int(self.tensor.shape[0])

    @classmethod
    def empty(cls, ndim: int) -> AmaxExchange:
        z = np.zeros(0, dtype=np.int64)
        box = np.zeros((0, ndim), dtype=np.int64)
        return cls(z, box, box, z, z, z, z, z, z)

    def bytes_of(self, kind: int) -> int:
        return int(self.nbytes[self.kind == kind].sum())


@dataclass(frozen=True, eq=False)
class Quantization:
    """What a plan in the destination format adds to a plan: the formats, the layouts as the
    caller gave them (logical dtypes), the scale tensor of every quantized tensor, and the
    partial-amax exchange."""

    formats: TensorFormats
    logical_source: Layout
    logical_destination: Layout
    scale_tensor: dict[str, str]  # quantized tensor name -> its scale tensor's name
    amax: AmaxExchange

    def format_of(self, tensor: str) -> DestinationFormat:
        return self.formats.of(tensor)


def _block_box(offsets: np.ndarray, lengths: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Block boxes of element boxes ``[N, nd]`` (last two dims in blocks, partial ones in)."""
    out_o, out_l = offsets.copy(), lengths.copy()
    for k, b in zip((-2, -1), block, strict=True):
        first = offsets[:, k] // b
        end = -(-(offsets[:, k] + lengths[:, k]) // b)
        out_o[:, k] = first
        out_l[:, k] = np.where(lengths[:, k] > 0, end - first, 0)
    return out_o, out_l


def format_layouts(source: Layout, destination: Layout, formats: TensorFormats) -> tuple[Layout, Layout, dict[str, str]]:
    """Both layouts in the destination format (module docstring), and the scale tensor name
    of every quantized tensor. ``ValueError`` naming the tensor or buffer for a buffer that
    mixes quantized and plain tensors, a
    quantized piece whose last two dims are not its buffer's last two, a scale name that
    collides with a tensor, or a source side that does not hold the whole of a quantized
    tensor (its blocks' scales would not be the whole tensor's); two destination pieces whose
    blocks share a scale entry of one buffer fail the planner's overlap check."""
    formats.check(destination.tensors)
    scale_tensor = _scale_tensors(formats, destination, source)
    src = _format_layout(source, formats, "source")
    dst = _format_layout(destination, formats, "destination")
    return src, dst, scale_tensor


def destination_format_layout(layout: Layout, formats: TensorFormats) -> Layout:
    """``layout`` (a destination side, in logical dtypes) as it holds its tensors in
    ``formats``: what ``format_layouts`` makes of a destination. Every buffer of a quantized
    tensor becomes a ``float8_e4m3fn`` buffer of the same shape with its scale buffer
    ``name + suffix`` beside it; the others stay as they are. An inference rank's buffers
    (its FP8 weights and scales) are this layout's; a side that holds them already (an
    inference holder) serves from it. ``ValueError`` as ``format_layouts`` raises it."""
    if not formats:
        return layout
    formats.check(layout.tensors)
    _scale_tensors(formats, layout)
    return _format_layout(layout, formats, "destination")


def _scale_tensors(formats: TensorFormats, *layouts: Layout) -> dict[str, str]:
    """Quantized tensor -> its scale tensor's name; ``ValueError`` for a name a layout uses."""
    names = {t.name for layout in layouts for t in layout.tensors}
    scale_tensor = {}
    for name, fmt in formats.entries:
        scale = fmt.scale_name(name)
        if scale in names:
            raise ValueError(f"tensor {name!r}: its scales would be named {scale!r}, which is a tensor of the layout")
        scale_tensor[name] = scale
    return scale_tensor


def _format_layout(layout: Layout, formats: TensorFormats, side: str) -> Layout:
    """``layout`` in ``formats`` (module docstring); ``side`` names it in errors."""
    builder = LayoutBuilder(ndim=layout.ndim)
    tensor_fmt = _format_tensors(builder, layout, formats)
    fmt_objects, buffer_fmt = _buffer_formats(layout, tensor_fmt, side)
    starts = np.searchsorted(layout.piece_tensor, np.arange(len(layout.tensors) + 1))
    scale_start, scale_extent = _scale_placement(layout, tensor_fmt, starts, side)
    new_id, scale_id = _format_buffers(builder, layout, fmt_objects, buffer_fmt, scale_extent)
    _format_pieces(builder, layout, tensor_fmt, starts, new_id, scale_id, scale_start)
    return builder.build()


def _format_tensors(builder: LayoutBuilder, layout: Layout, formats: TensorFormats) -> list[DestinationFormat | None]:
    """Add the tensors to ``builder`` in their planned dtype, each quantized one followed by its
    scale tensor, and return each tensor's format (``None``: stays as it is). Tensors come
    first so the tensor ids of the result follow the layout's."""
    tensor_fmt: list[DestinationFormat | None] = []
    for t in layout.tensors:
        fmt = formats.of(t.name)
        if fmt.quantized:
            fmt.check_tensor(t.name, t.shape, t.dtype)
            builder.tensor(t.name, t.shape, "float8_e4m3fn")
            builder.tensor(fmt.scale_name(t.name), fmt.scale_shape(t.shape), fmt.scale_dtype)
            tensor_fmt.append(fmt)
        else:
            builder.tensor(t.name, t.shape, t.dtype)
            tensor_fmt.append(None)
    return tensor_fmt


def _buffer_formats(layout: Layout, tensor_fmt: list[DestinationFormat | None],
                    side: str) -> tuple[list[DestinationFormat], np.ndarray]:
    """The formats in use (sorted by name) and each buffer's index into them (-1: plain, -2:
    no piece). ``ValueError`` for a buffer that mixes formats: a buffer's pieces are all
    quantized in one format, or none of them, since the whole buffer changes dtype."""
    fmt_names = sorted({f.name for f in tensor_fmt if f is not None})
    fmt_objects = [DestinationFormat(n) for n in fmt_names]
    tensor_fmt_id = np.array([-1 if f is None else fmt_names.index(f.name) for f in tensor_fmt], dtype=np.int64)
    buffer_fmt = np.full(layout.num_buffers, -2, dtype=np.int64)  # -2: no piece seen
    piece_fmt = tensor_fmt_id[layout.piece_tensor] if layout.num_pieces else np.zeros(0, dtype=np.int64)
    b_ids = layout.piece_buffer
    order = np.lexsort((piece_fmt, b_ids))
    sb, sf = b_ids[order], piece_fmt[order]
    mixed = np.flatnonzero((sb[1:] == sb[:-1]) & (sf[1:] != sf[:-1]))
    if mixed.size:
        b = int(sb[mixed[0]])
        pieces = order[[mixed[0], mixed[0] + 1]]
        what = [layout.tensors[int(layout.piece_tensor[p])].name for p in pieces]
        where = f"{side} buffer {layout.buffer_names[int(layout.buffer_name[b])]!r} on rank {int(layout.buffer_rank[b])}"
        raise ValueError(f"{where} holds tensors {what[0]!r} and {what[1]!r} in different destination "
                         f"formats; a buffer is quantized whole or not at all")
    buffer_fmt[sb] = sf
    return fmt_objects, buffer_fmt


def _scale_placement(layout: Layout, tensor_fmt: list[DestinationFormat | None], starts: np.ndarray,
                     side: str) -> tuple[np.ndarray, np.ndarray]:
    """Where each quantized piece's blocks start in its buffer's scale grid (last two dims;
    zeros for plain pieces), and the blocks each buffer's scale grid must hold. The pieces
    are checked tensor by tensor first (``_quantized_pieces``), so errors name the first
    bad tensor."""
    q_rows: list[np.ndarray] = []
    q_lo: list[np.ndarray] = []
    q_phase: list[np.ndarray] = []
    q_len: list[np.ndarray] = []
    q_block: list[np.ndarray] = []
    for tid, fmt in enumerate(tensor_fmt):
        if fmt is None:
            continue
        rows = np.arange(starts[tid], starts[tid + 1])
        if rows.size == 0:
            continue
        lo, phase, ll, block = _quantized_pieces(layout, tid, fmt, rows, side)
        q_rows.append(rows)
        q_lo.append(lo)
        q_phase.append(phase)
        q_len.append(ll)
        q_block.append(block)
    scale_extent = np.zeros((layout.num_buffers, 2), dtype=np.int64)  # blocks a scale buffer must hold
    scale_start = np.zeros((layout.num_pieces, 2), dtype=np.int64)
    if q_rows:
        rows, lo, phase = np.concatenate(q_rows), np.concatenate(q_lo), np.concatenate(q_phase)
        ll, block = np.concatenate(q_len), np.concatenate(q_block)
        start, end = _scale_starts(layout.piece_buffer[rows], lo, phase, ll, block)
        scale_start[rows] = start
        np.maximum.at(scale_extent, layout.piece_buffer[rows], end)
    return scale_start, scale_extent


def _quantized_pieces(layout: Layout, tid: int, fmt: DestinationFormat, rows: np.ndarray,
                      side: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For the pieces ``rows`` of quantized tensor ``tid``: local starts, block phases,
    lengths and block sizes in the last two dims. ``ValueError`` unless the tensor's last two
    dims are the buffer's last two (blocks are rows x cols of the buffer); on the source side
    ``Uncovered`` (a ``ValueError``) while pieces are missing and ``ValueError`` when they
    overlap (a block's scale needs all of the block, once)."""
    nd_t = len(layout.tensors[tid].shape)
    bufs = layout.piece_buffer[rows]
    nd_b = layout.buffer_ndim[bufs]
    g_off, g_len = layout.piece_offsets[rows, :nd_t], layout.piece_lengths[rows, :nd_t]
    lo = np.stack([layout.piece_local_offsets[rows, nd_b - 2], layout.piece_local_offsets[rows, nd_b - 1]], 1) \
        if (nd_b >= 2).all() else None
    ll = np.stack([layout.piece_local_lengths[rows, nd_b - 2], layout.piece_local_lengths[rows, nd_b - 1]], 1) \
        if lo is not None else None
    if lo is None or not np.array_equal(ll, g_len[:, -2:]):
        bad = int(rows[0]) if lo is None else int(rows[np.flatnonzero((ll != g_len[:, -2:]).any(axis=1))[0]])
        raise ValueError(f"{side} piece {layout.piece(bad)}: a quantized tensor's last two dims must be its "
                         f"buffer's last two (blocks of rows x cols)")
    block = np.array(fmt.block_shape, dtype=np.int64)
    phase = (g_off[:, -2:] - lo) % block
    if side == "source":
        _check_source_covers(layout, tid, g_off, g_len)
    return lo, phase, ll, np.broadcast_to(block, lo.shape)


def _format_buffers(builder: LayoutBuilder, layout: Layout, fmt_objects: list[DestinationFormat],
                    buffer_fmt: np.ndarray, scale_extent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Add the buffers to ``builder``, grouped by name, then format, dtype and ndim (one
    ``builder.buffers`` call per group): plain ones keep their dtype, quantized ones become
    FP8 with a scale buffer beside them. Returns each buffer's new id and its scale buffer's
    id (-1: none)."""
    new_id = np.full(layout.num_buffers, -1, dtype=np.int64)
    scale_id = np.full(layout.num_buffers, -1, dtype=np.int64)
    by_name = np.argsort(layout.buffer_name, kind="stable")
    name_starts = np.searchsorted(layout.buffer_name[by_name], np.arange(len(layout.buffer_names) + 1))
    for k, name in enumerate(layout.buffer_names):
        ids = by_name[name_starts[k] : name_starts[k + 1]]
        if ids.size == 0:
            continue
        for f in np.unique(buffer_fmt[ids]).tolist():
            group = ids[buffer_fmt[ids] == f]
            for dt in np.unique(layout.buffer_dtype[group]).tolist():
                sub = group[layout.buffer_dtype[group] == dt]
                for nd in np.unique(layout.buffer_ndim[sub]).tolist():
                    part = sub[layout.buffer_ndim[sub] == nd]
                    fmt = fmt_objects[f] if f >= 0 else None
                    _add_buffers(builder, layout, name, part, nd, dt, fmt, scale_extent, new_id, scale_id)
    return new_id, scale_id


def _add_buffers(builder: LayoutBuilder, layout: Layout, name: str, part: np.ndarray, nd: int, dt: int,
                 fmt: DestinationFormat | None, scale_extent: np.ndarray, new_id: np.ndarray,
                 scale_id: np.ndarray) -> None:
    """Add one group of buffers (one name, format, dtype and ndim) and record their ids in
    ``new_id`` / ``scale_id``. A scale buffer covers the buffer's block grid, or more where
    unaligned pieces placed their blocks past it (``scale_extent``)."""
    shapes = layout.buffer_shape[part, :nd]
    if fmt is None:
        new_id[part] = builder.buffers(name, layout.buffer_rank[part], shapes, DTYPES[dt])
        return
    new_id[part] = builder.buffers(name, layout.buffer_rank[part], shapes, "float8_e4m3fn")
    scale_shapes = shapes.copy()
    for j, b in zip((-2, -1), fmt.block_shape, strict=True):
        scale_shapes[:, j] = np.maximum(-(-shapes[:, j] // b), scale_extent[part, j])
    scale_id[part] = builder.buffers(name + fmt.scale_suffix, layout.buffer_rank[part], scale_shapes,
                                     fmt.scale_dtype)


def _format_pieces(builder: LayoutBuilder, layout: Layout, tensor_fmt: list[DestinationFormat | None],
                   starts: np.ndarray, new_id: np.ndarray, scale_id: np.ndarray, scale_start: np.ndarray) -> None:
    """Add every piece in its new buffer, tensor by tensor, and for a quantized tensor the
    piece of its scales (the blocks the piece touches, at ``scale_start`` in the scale
    buffer). Pieces go in groups of one buffer ndim, as ``builder.pieces`` takes local boxes
    of one width."""
    for tid, t in enumerate(layout.tensors):
        rows = np.arange(starts[tid], starts[tid + 1])
        if rows.size == 0:
            continue
        nd_t = len(t.shape)
        fmt = tensor_fmt[tid]
        all_bufs = layout.piece_buffer[rows]
        for nd_b in np.unique(layout.buffer_ndim[all_bufs]).tolist():  # local boxes of one rank each
            at = np.flatnonzero(layout.buffer_ndim[all_bufs] == nd_b)
            sel, bufs = rows[at], all_bufs[at]
            g_off, g_len = layout.piece_offsets[sel, :nd_t], layout.piece_lengths[sel, :nd_t]
            l_off, l_len = layout.piece_local_offsets[sel, :nd_b], layout.piece_local_lengths[sel, :nd_b]
            builder.pieces(t.name, new_id[bufs], g_off, g_len, l_off, l_len)
            if fmt is None:
                continue
            b_off, b_len = _block_box(g_off, g_len, fmt.block_shape)
            s_off, s_len = l_off.copy(), l_len.copy()
            for j in (0, 1):
                s_off[:, nd_b - 2 + j] = scale_start[sel, j]
                s_len[:, nd_b - 2 + j] = b_len[:, nd_t - 2 + j]
            builder.pieces(fmt.scale_name(t.name), scale_id[bufs], b_off, b_len, s_off, s_len)


def _scale_starts(buffer: np.ndarray, lo: np.ndarray, phase: np.ndarray, length: np.ndarray,
                  block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per quantized piece (its buffer, local start, block phase, lengths and block size in
    the last two dims): where its blocks start in the buffer's scale grid, and where they end.

    A piece's first block sits at ``(lo + phase) // B`` (vLLM's grid for aligned shards), or
    right after the blocks of the piece before it in the buffer along that dim, whichever is
    later: unaligned fused shards (gate, up) then get disjoint block rows."""
    count = np.where(length > 0, (lo + phase + np.maximum(length, 1) - 1) // block - (lo + phase) // block + 1, 0)
    start = (lo + phase) // block
    multi = np.bincount(buffer, minlength=int(buffer.max(initial=0)) + 1)[buffer] > 1
    for j in (0, 1):
        rows = np.flatnonzero(multi)
        if rows.size == 0:
            break
        order = rows[np.lexsort((length[rows, j], lo[rows, j], buffer[rows]))]
        prev_buffer, prev_lo, prev_len, prev_start, prev_end = -1, -1, -1, 0, 0
        for r in order.tolist():
            b, a, n = int(buffer[r]), int(lo[r, j]), int(length[r, j])
            if b == prev_buffer and (a, n) == (prev_lo, prev_len):
                start[r, j] = prev_start  # the same interval of this dim: the same blocks
                continue
            if b == prev_buffer and a >= prev_lo + prev_len:
                start[r, j] = max(int(start[r, j]), prev_end)
            prev_buffer, prev_lo, prev_len, prev_start = b, a, n, int(start[r, j])
            prev_end = prev_start + int(count[r, j])
    return start, start + count


def _check_source_covers(layout: Layout, tid: int, g_off: np.ndarray, g_len: np.ndarray) -> None:
    """The source's distinct boxes of a quantized tensor must cover it (they are disjoint).
    Fewer elements than the tensor: a source holding the rest is gone or not there yet
    (``Uncovered``: the version waits for it); more: pieces overlap (a layout fault)."""
    t = layout.tensors[tid]
    boxes = np.unique(np.concatenate([g_off, g_len], axis=1), axis=0)
    nd = len(t.shape)
    covered = int(np.prod(boxes[:, nd:], axis=1).sum())
    total = int(np.prod(t.shape))
    if covered < total:
        raise Uncovered(f"tensor {t.name!r}: the sources' pieces hold {covered} of its {total} elements; a quantized "
                        "tensor needs the whole of every block on the source side (a source holding the rest is "
                        "gone or not there yet)")
    if covered != total:
        raise ValueError(f"tensor {t.name!r}: the source's distinct pieces hold {covered} of its {int(np.prod(t.shape))} "
                         f"elements (or overlap); a quantized tensor needs the whole of every block on the source side")


def amax_exchange(source: Layout, quantized: dict[int, DestinationFormat], senders: np.ndarray,
                  topology: Topology) -> AmaxExchange:
    """The exchange rows (module docstring) of the planner's source layout ``source``:
    ``quantized`` maps its quantized (element) tensor ids to their formats and ``senders``
    lists the source pieces (of element or scale tensors) that send any row."""
    domains = topology.domain_array()
    ndim = source.ndim
    sending = np.zeros(source.num_pieces, dtype=bool)
    sending[senders] = True
    starts = np.searchsorted(source.piece_tensor, np.arange(len(source.tensors) + 1))
    scale_of = {}
    for tid, fmt in quantized.items():
        scale_of[tid] = source.tensor_index(fmt.scale_name(source.tensors[tid].name))
    out: list[list] = []
    for tid, fmt in quantized.items():
        rows = np.arange(starts[tid], starts[tid + 1])
        if rows.size == 0:
            continue
        t = source.tensors[tid]
        nd = len(t.shape)
        off, ln = source.piece_offsets[rows, :nd], source.piece_lengths[rows, :nd]
        shape = np.array(t.shape[-2:])
        block = np.array(fmt.block_shape)
        end = off[:, -2:] + ln[:, -2:]
        aligned = ((off[:, -2:] % block == 0) & ((end % block == 0) | (end == shape))).all()
        if aligned:
            continue  # no block is split: every holder quantizes its blocks alone
        # A scale piece's sender is the rank of the element piece with the same block box
        # (the scale pieces are those boxes, one per element piece, on the same buffer rank).
        s_rows = np.arange(starts[scale_of[tid]], starts[scale_of[tid] + 1])
        def buffer_name(p: int) -> str:
            return source.buffer_names[int(source.buffer_name[int(source.piece_buffer[p])])]

        scale_sending = {(int(source.piece_rank[p]), buffer_name(p), tuple(source.piece_offsets[p, :nd]),
                          tuple(source.piece_lengths[p, :nd])) for p in s_rows[sending[s_rows]]}
        b_off, b_len = _block_box(off, ln, fmt.block_shape)
        boxes, box_of = np.unique(np.concatenate([off, ln], axis=1), axis=0, return_inverse=True)
        box_of = box_of.reshape(-1)
        holders = [rows[box_of == k] for k in range(boxes.shape[0])]  # pieces of each distinct box
        bb_off, bb_len = _block_box(boxes[:, :nd], boxes[:, nd:], fmt.block_shape)
        lo = np.maximum(bb_off[:, None, :], bb_off[None, :, :])
        hi = np.minimum(bb_off[:, None, :] + bb_len[:, None, :], bb_off[None, :, :] + bb_len[None, :, :])
        touch = (hi > lo).all(axis=2)
        np.fill_diagonal(touch, False)
        for i, p in enumerate(rows.tolist()):
            k = int(box_of[i])
            rank = int(source.piece_rank[p])
            key = (rank, buffer_name(p) + fmt.scale_suffix, tuple(b_off[i]), tuple(b_len[i]))
            if not (sending[p] or key in scale_sending):
                continue
            for other in np.flatnonzero(touch[k]).tolist():
                cand = holders[other]
                cand_rank = source.piece_rank[cand]
                mine = cand[cand_rank == rank]
                if mine.size:
                    provider = int(mine[0])
                else:
                    near = cand[domains[cand_rank] == domains[rank]]
                    pool = near if near.size else cand
                    pool = pool[np.argsort(source.piece_rank[pool], kind="stable")]
                    provider = int(pool[rank % pool.size])
                prank = int(source.piece_rank[provider])
                kind = (TransferKind.LOCAL if prank == rank else
                        TransferKind.INTRA if domains[prank] == domains[rank] else TransferKind.NETWORK)
                box_o, box_l = np.zeros(ndim, dtype=np.int64), np.ones(ndim, dtype=np.int64)
                box_o[:nd], box_l[:nd] = lo[k, other], hi[k, other] - lo[k, other]
                nbytes = 0 if kind == TransferKind.LOCAL else AMAX_ITEMSIZE * int(np.prod(box_l[:nd]))
                out.append([tid, box_o, box_l, prank, provider, rank, p, int(kind), nbytes])
    if not out:
        return AmaxExchange.empty(ndim)
    cols = list(zip(*out, strict=True))
    return AmaxExchange(np.array(cols[0]), np.stack(cols[1]), np.stack(cols[2]), np.array(cols[3]),
                        np.array(cols[4]), np.array(cols[5]), np.array(cols[6]), np.array(cols[7]),
                        np.array(cols[8]))
