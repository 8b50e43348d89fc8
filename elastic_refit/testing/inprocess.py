"""Reference execution of a plan inside one process, on numpy or torch arrays.

This is the oracle for the planner's property tests and the local transport of
single-device benchmarks: every transfer becomes one slice assignment, in plan order
(deliver phase, then fan-out phase). In relayed plans a forward writes what its network
copy read (the relay's staging holds exactly those bytes), and a network copy that a relay
only stages writes nothing.
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
