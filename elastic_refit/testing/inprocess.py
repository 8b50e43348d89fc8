"""Reference execution of a plan inside one process, on numpy or torch arrays.

This is the oracle for the planner's property tests and the local transport of
single-device benchmarks: every transfer becomes one slice assignment, in plan order
(deliver phase, then fan-out phase). In relayed plans a forward writes what its network
copy read (the relay's staging holds exactly those bytes), and a network copy that a relay
only stages writes nothing.

Plans in a quantized destination format (``Plan.quantization``) read the source buffers in
the destination format: ``quantize_source_buffers`` makes them from the caller's BF16 source
buffers as each sender does (its own blocks' amax, combined with the partial amax the plan's
exchange brings it for blocks split across source shards, then the reference quantizer of
``elastic_refit.kernels.quantize``), and ``execute_in_process`` then moves FP8 bytes and
scales like any other bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import numpy as np

from elastic_refit.layout import DTYPE_ITEMSIZE, DTYPES, Layout
from elastic_refit.plan import Plan, SourceSide, TransferKind
from elastic_refit.plan.types import ExpandedTransfers

BufferKey = tuple[int, str]  # (rank, buffer name)

# numpy has no bfloat16/float8: store every dtype as an unsigned integer of the same width,
# which keeps copies bit-exact.
_STORAGE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def storage_dtype(dtype: str) -> np.dtype:
    return np.dtype(_STORAGE[DTYPE_ITEMSIZE[dtype]])


def allocate_buffers(layout: Layout, fill: int = 0) -> dict[BufferKey, np.ndarray]:
    """One numpy array per buffer of ``layout``, filled with ``fill``."""
    out: dict[BufferKey, np.ndarray] = {}
    for b in range(layout.num_buffers):
        nd = int(layout.buffer_ndim[b])
        shape = tuple(int(s) for s in layout.buffer_shape[b, :nd])
        dtype = storage_dtype(DTYPES[int(layout.buffer_dtype[b])])
        key = (int(layout.buffer_rank[b]), layout.buffer_names[int(layout.buffer_name[b])])
        out[key] = np.full(shape, fill, dtype=dtype)
    return out


def _buffer_key(layout: Layout, piece: int) -> BufferKey:
    b = int(layout.piece_buffer[piece])
    return int(layout.buffer_rank[b]), layout.buffer_names[int(layout.buffer_name[b])]


def _slices(offsets: np.ndarray, lengths: np.ndarray, ndim: int) -> tuple[slice, ...]:
    return tuple(slice(int(o), int(o) + int(n)) for o, n in zip(offsets[:ndim], lengths[:ndim], strict=True))


def piece_slices(layout: Layout, piece: int) -> tuple[BufferKey, tuple[slice, ...], tuple[slice, ...]]:
    """(buffer key, slices of the global tensor, slices of the local buffer) of one piece."""
    t = layout.tensors[int(layout.piece_tensor[piece])]
    b = int(layout.piece_buffer[piece])
    return (
        _buffer_key(layout, piece),
        _slices(layout.piece_offsets[piece], layout.piece_lengths[piece], len(t.shape)),
        _slices(layout.piece_local_offsets[piece], layout.piece_local_lengths[piece], int(layout.buffer_ndim[b])),
    )


def scatter_tensors(layout: Layout, tensors: Mapping[str, np.ndarray], buffers: MutableMapping[BufferKey, Any],
                    ranks: set[int] | None = None) -> None:
    """Write every piece of ``layout`` from whole global tensors (test and benchmark set-up)."""
    for p in range(layout.num_pieces):
        key, global_slices, local_slices = piece_slices(layout, p)
        if ranks is not None and key[0] not in ranks:
            continue
        name = layout.tensors[int(layout.piece_tensor[p])].name
        buf = buffers[key]
        buf[local_slices] = tensors[name][global_slices].reshape(buf[local_slices].shape)


def check_pieces(layout: Layout, tensors: Mapping[str, np.ndarray], buffers: Mapping[BufferKey, Any],
                 equal: Callable[[Any, Any], bool] | None = None) -> list[str]:
    """Every piece of ``layout`` compared with the global tensors; returns mismatches."""
    equal = equal or (lambda a, b: bool(np.array_equal(a, b)))
    problems = []
    for p in range(layout.num_pieces):
        key, global_slices, local_slices = piece_slices(layout, p)
        got = buffers[key][local_slices]
        want = tensors[layout.tensors[int(layout.piece_tensor[p])].name][global_slices].reshape(got.shape)
        if not equal(got, want):
            problems.append(f"{layout.piece(p)}")
    return problems


def forward_sources(plan: Plan, x: ExpandedTransfers) -> np.ndarray:
    """The piece every copy of ``x`` finally reads: for a forward (``SourceSide.RELAY``),
    the source piece its network copy (same row ``src_piece``, same class member) reads;
    for any other copy its own ``src_piece``. ``x`` must hold the forwards' network copies
    (``plan.expand()`` does). ``ValueError`` when a forward is not what its network copy
    brought: another box, another round or stream offset, or sent by a rank that did not
    receive it."""
    t = plan.transfers
    src_piece = x.src_piece.copy()
    forward = np.flatnonzero(t.src_side[x.row] == int(SourceSide.RELAY))
    if forward.size == 0:
        return src_piece
    num_tensors = len(plan.destination.tensors)
    key = x.row * num_tensors + x.tensor
    order = np.argsort(key, kind="stable")
    wanted = x.src_piece[forward] * num_tensors + x.tensor[forward]
    found = np.minimum(np.searchsorted(key[order], wanted), order.size - 1)
    parent = order[found]
    rows, parent_rows = x.row[forward], x.row[parent]
    problems = {
        "its network copy is missing": key[parent] != wanted,
        "it forwards a copy that did not cross the network": t.kind[parent_rows] != int(TransferKind.NETWORK),
        "it does not stay inside the domain": t.kind[rows] != int(TransferKind.INTRA),
        "its sender did not receive the network copy": t.dst_rank[parent_rows] != t.src_rank[rows],
        "its box differs from the network copy's": np.any((t.offsets[parent_rows] != t.offsets[rows])
                                                          | (t.lengths[parent_rows] != t.lengths[rows]), axis=1),
        "its round differs from the network copy's": t.round[parent_rows] != t.round[rows],
        "its stream offset differs from the network copy's": x.message_offset[parent] != x.message_offset[forward],
    }
    for problem, bad in problems.items():
        if np.any(bad):
            row = int(rows[np.argmax(bad)])
            raise ValueError(f"forward row {row} (rank {int(t.src_rank[row])} -> {int(t.dst_rank[row])}, tensor "
                             f"{plan.destination.tensors[int(t.tensor[row])].name!r}): {problem}")
    src_piece[forward] = x.src_piece[parent]
    return src_piece


def copy_regions(plan: Plan) -> tuple[ExpandedTransfers, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every box copy of ``plan`` that writes a destination piece, with its local source and
    destination regions; a forward reads where its network copy read (``forward_sources``:
    its ``src_piece`` is that source piece), and copies only a relay stages are left out.

    Returns the expanded copies and ``(src_offsets, src_lengths, dst_offsets, dst_lengths)``
    inside the local buffers, padded to the plan's ndim.
    """
    t = plan.transfers
    x = plan.expand()
    x = dataclasses.replace(x, src_piece=forward_sources(plan, x))
    writes = x.dst_piece >= 0
    if not writes.all():
        x = ExpandedTransfers(*(getattr(x, f.name)[writes] for f in dataclasses.fields(x)))
    offsets, lengths = t.offsets[x.row], t.lengths[x.row]
    from_dst = t.src_side[x.row] == int(SourceSide.DESTINATION)
    src_off = np.zeros_like(offsets)
    src_len = np.zeros_like(lengths)
    for layout, sel in ((plan.source, ~from_dst), (plan.destination, from_dst)):
        idx = np.flatnonzero(sel)
        if idx.size:
            src_off[idx], src_len[idx] = _regions_padded(layout, x.src_piece[idx], offsets[idx], lengths[idx])
    dst_off, dst_len = _regions_padded(plan.destination, x.dst_piece, offsets, lengths)
    return x, src_off, src_len, dst_off, dst_len


def execute_in_process(plan: Plan, source_buffers: Mapping[BufferKey, Any],
                       destination_buffers: MutableMapping[BufferKey, Any]) -> int:
    """Run every box copy of ``plan`` with slice assignments, in plan order; returns bytes."""
    if len(plan.transfers) == 0:
        return 0
    x, src_off, src_len, dst_off, dst_len = copy_regions(plan)
    from_dst = plan.transfers.src_side[x.row] == int(SourceSide.DESTINATION)
    dst = plan.destination
    # Fan-outs read what the deliver phase wrote: run the phases in order.
    for i in np.argsort(plan.transfers.phase[x.row], kind="stable").tolist():
        layout = dst if from_dst[i] else plan.source
        src_piece = int(x.src_piece[i])
        src_buf = (destination_buffers if from_dst[i] else source_buffers)[_buffer_key(layout, src_piece)]
        src_nd = int(layout.buffer_ndim[int(layout.piece_buffer[src_piece])])
        dst_piece = int(x.dst_piece[i])
        dst_buf = destination_buffers[_buffer_key(dst, dst_piece)]
        dst_nd = int(dst.buffer_ndim[int(dst.piece_buffer[dst_piece])])
        region = dst_buf[_slices(dst_off[i], dst_len[i], dst_nd)]
        region[...] = src_buf[_slices(src_off[i], src_len[i], src_nd)].reshape(region.shape)
    t = plan.transfers
    return int((t.nbytes * t.instances).sum())


def _regions_padded(layout: Layout, pieces: np.ndarray, offsets: np.ndarray, lengths: np.ndarray):
    k = layout.ndim
    off, ln = layout.local_regions(pieces, offsets[:, :k], lengths[:, :k])
    return _pad_to(off, offsets.shape[1], 0), _pad_to(ln, offsets.shape[1], 1)


def _pad_to(array: np.ndarray, k: int, fill: int) -> np.ndarray:
    if array.shape[1] >= k:
        return array[:, :k] if array.shape[1] > k else array
    out = np.full((array.shape[0], k), fill, dtype=np.int64)
    out[:, : array.shape[1]] = array
    return out


def _torch_view(array: np.ndarray, dtype: str):
    import torch

    return torch.from_numpy(np.ascontiguousarray(array)).view(getattr(torch, dtype))


class _ReferenceQuantizer:
    """What :func:`quantize_source_buffers` reads of a quantized plan: its source side, the
    quantized tensors and their formats, the pieces that send, the scale piece of each
    quantized piece and the partial-amax rows each piece consumes."""

    def __init__(self, plan: Plan, logical_buffers: Mapping[BufferKey, Any]) -> None:
        q = plan.quantization
        if q is None:
            raise ValueError("the plan has no quantization: its source buffers are the caller's")
        self.q = q
        self.src = src = plan.source
        self.logical_buffers = logical_buffers
        self.quantized = {src.tensor_index(name): q.format_of(name) for name in q.scale_tensor
                          if name in src._tensor_index}
        # Which pieces send: source pieces of every row read from the source side.
        x = plan.expand(np.flatnonzero(plan.transfers.src_side == int(SourceSide.SOURCE)))
        self.sending = set(x.src_piece.tolist())
        self.scale_piece: dict[tuple[int, int, tuple, tuple, tuple], int] = {}
        for tid, fmt in self.quantized.items():
            sid = src.tensor_index(fmt.scale_name(src.tensors[tid].name))
            for p in np.flatnonzero(src.piece_tensor == sid).tolist():
                nd = len(src.tensors[sid].shape)
                self.scale_piece[(sid, int(src.piece_rank[p]), _buffer_key(src, p)[1],
                                  tuple(src.piece_offsets[p, :nd].tolist()),
                                  tuple(src.piece_lengths[p, :nd].tolist()))] = p
        self.amax_rows: dict[int, list[int]] = {}
        for i, consumer in enumerate(q.amax.consumer_piece.tolist()):
            self.amax_rows.setdefault(consumer, []).append(i)

    def piece_data(self, p: int):
        src = self.src
        key, _, local = piece_slices(src, p)
        logical = self.q.logical_source.tensor(src.tensors[int(src.piece_tensor[p])].name)
        box = np.asarray(self.logical_buffers[key])[local]
        return _torch_view(box, logical.dtype).reshape(tuple(int(n) for n in src.piece_lengths[p, :len(logical.shape)]))

    def block_box(self, p: int, fmt) -> tuple[np.ndarray, np.ndarray]:
        nd = len(self.src.tensors[int(self.src.piece_tensor[p])].shape)
        o, n = fmt.block_box(self.src.piece_offsets[p, :nd].tolist(), self.src.piece_lengths[p, :nd].tolist())
        return np.array(o), np.array(n)

    def origin(self, p: int, fmt) -> tuple[int, int]:
        nd = len(self.src.tensors[int(self.src.piece_tensor[p])].shape)
        return tuple(int(o) % b for o, b in zip(self.src.piece_offsets[p, nd - 2 : nd], fmt.block_shape, strict=True))

    def scale_piece_of(self, p: int, fmt) -> tuple[int | None, np.ndarray]:
        """The scale piece of quantized piece ``p`` (None if its rank holds none) and the
        offsets of ``p``'s block box."""
        src = self.src
        b_off, b_len = self.block_box(p, fmt)
        name = src.tensors[int(src.piece_tensor[p])].name
        s_piece = self.scale_piece.get((src.tensor_index(fmt.scale_name(name)), int(src.piece_rank[p]),
                                        _buffer_key(src, p)[1] + fmt.scale_suffix, tuple(b_off.tolist()),
                                        tuple(b_len.tolist())))
        return s_piece, b_off

    def amax(self, p: int, fmt, b_off: np.ndarray, data):
        """Piece ``p``'s block amax (of its ``data``), combined with the partial amax of the pieces that share
        its blocks split across source shards."""
        from elastic_refit.kernels.quantize import block_amax, combine_amax

        nd = len(self.src.tensors[int(self.src.piece_tensor[p])].shape)
        amax = block_amax(data, fmt, self.origin(p, fmt))
        for i in self.amax_rows.get(p, []):
            provider = int(self.q.amax.provider_piece[i])
            p_off, _ = self.block_box(provider, fmt)
            partial = block_amax(self.piece_data(provider), fmt, self.origin(provider, fmt))
            lo = self.q.amax.block_offsets[i, :nd]
            ln = self.q.amax.block_lengths[i, :nd]
            # lead dims are elements (the pieces' own offsets), the last two blocks
            mine = tuple(slice(int(a - b), int(a - b + n)) for a, b, n in zip(lo, b_off, ln, strict=True))
            theirs = tuple(slice(int(a - b), int(a - b + n)) for a, b, n in zip(lo, p_off, ln, strict=True))
            amax[mine] = combine_amax(amax[mine], partial[theirs])
        return amax

    def quantize_piece(self, out: dict[BufferKey, np.ndarray], p: int, fmt, s_piece: int | None,
                       b_off: np.ndarray) -> None:
        """Write piece ``p``'s FP8 data (and its scales, when its rank holds them) into ``out``."""
        import torch

        from elastic_refit.kernels.quantize import (
            check_scales,
            quantize_with_scales,
            scales_from_amax,
        )

        data = self.piece_data(p)
        scales = scales_from_amax(self.amax(p, fmt, b_off, data), fmt)
        check_scales(scales, fmt, self.src.tensors[int(self.src.piece_tensor[p])].name, tuple(int(v) for v in b_off))
        fp8 = quantize_with_scales(data, scales, fmt, self.origin(p, fmt))
        key, _, local = piece_slices(self.src, p)
        region = out[key][local]
        region[...] = fp8.view(torch.uint8).numpy().reshape(region.shape)
        if s_piece is not None:
            s_key, _, s_local = piece_slices(self.src, s_piece)
            region = out[s_key][s_local]
            region[...] = scales.contiguous().view(torch.uint8).numpy().view(region.dtype).reshape(region.shape)


def quantize_source_buffers(plan: Plan, logical_buffers: Mapping[BufferKey, Any],
                            ranks: set[int] | None = None) -> dict[BufferKey, np.ndarray]:
    """The source buffers of a quantized ``plan`` (``plan.source``, in the destination
    format) from the caller's buffers of ``plan.quantization.logical_source``, as the senders
    make them: every source piece that sends a row (element or scale) is quantized by its
    rank, with the partial amax of the plan's exchange for blocks split across source shards.
    Buffers of plain tensors are passed through. Returns numpy storage arrays (uint8 FP8,
    uint32 float32 scales or uint8 E8M0 codes) keyed like ``allocate_buffers``; ``ranks``
    limits the work to some ranks. ``NonFiniteBlockError`` (naming the tensor and block) for
    a block with NaN or Inf."""
    if plan.quantization is None:
        return dict(logical_buffers)
    src = plan.source
    out = allocate_buffers(src)
    for key in out:
        if key in logical_buffers and out[key].dtype == np.asarray(logical_buffers[key]).dtype \
                and out[key].shape == np.asarray(logical_buffers[key]).shape:
            out[key] = np.asarray(logical_buffers[key])
    ref = _ReferenceQuantizer(plan, logical_buffers)
    for tid, fmt in ref.quantized.items():
        for p in np.flatnonzero(src.piece_tensor == tid).tolist():
            if ranks is not None and int(src.piece_rank[p]) not in ranks:
                continue
            s_piece, b_off = ref.scale_piece_of(p, fmt)
            if p not in ref.sending and s_piece not in ref.sending:
                continue  # a holder that sends nothing of it quantizes nothing
            ref.quantize_piece(out, p, fmt, s_piece, b_off)
    return out


def reference_destination(plan: Plan, tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """What the destination of a quantized ``plan`` must hold, tensor by tensor of
    ``plan.destination``: ``kernels.quantize.quantize_reference`` of every whole quantized
    tensor (FP8 bytes and scales, as storage arrays), the other tensors as given.
    ``tensors`` are the logical tensors as storage arrays (``random_tensors``)."""
    import torch

    from elastic_refit.kernels.quantize import quantize_reference

    q = plan.quantization
    out: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        fmt = q.format_of(name) if q is not None else None
        if fmt is None or not fmt.quantized:
            out[name] = np.asarray(array)
            continue
        logical = q.logical_source.tensor(name) if name in q.logical_source._tensor_index \
            else q.logical_destination.tensor(name)
        fp8, scales = quantize_reference(_torch_view(np.asarray(array), logical.dtype), fmt, name=name)
        out[name] = fp8.view(torch.uint8).numpy()
        scale_dtype = storage_dtype(fmt.scale_dtype)
        out[q.scale_tensor[name]] = scales.contiguous().view(torch.uint8).numpy().view(scale_dtype).reshape(scales.shape)
    return out
