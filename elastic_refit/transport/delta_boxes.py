"""Where the boxes of a message sit in their buffers, and their change against a base
(``transport.delta``): what each box's changed elements are, their values, and how far
each box's digest moves; and the way back, writing them.

Two forms, the same results: on the CPU each box is a strided numpy view of its buffer
(compare, ``flatnonzero`` and the flat iterator's gathers and scatters run in C, no index
arithmetic of ours); elsewhere a few tensor operations per message whatever its boxes
(:class:`Boxes`' ``select`` and ``flat``), the reference for fused kernels.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from elastic_refit.kernels.delta import (
    changed_elements,
    changed_elements_many,
    delta_digests,
    gather_elements_many,
    positions_by_buffer,
    segment_entries,
    segment_entry_counts,
    segment_positions,
    write_elements,
    write_elements_many,
)
from elastic_refit.layout import DTYPE_ITEMSIZE
from elastic_refit.transport.buffers import byte_view
from elastic_refit.transport.schedule import BoxCopy, RankSchedule

__all__ = ["Boxes", "Change", "Segments", "Written", "compare_ahead", "segment_places"]

try:  # the compiled form (setup.py); without it numpy runs, with the same results
    from elastic_refit.transport import _delta as _native
except ImportError:  # pragma: no cover - no compiler where it was installed
    _native = None

_CHANGED = "changed elements by buffer"  # the vectorized form's entry in a refit's cache (segments)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(slots=True)
class Change:
    """A message's change: per box its changed elements (``counts``), their indices in
    their box (``local``, box after box), their new values (bytes, box after box) and per
    box how far its digest moves (``moves``, int64)."""

    local: torch.Tensor
    counts: torch.Tensor
    values: torch.Tensor
    moves: torch.Tensor


class Written:
    """What :meth:`Boxes.apply_segments` returns beside the digest moves: ``finish(ok)``
    writes the change once its moves were found right (the forms that check first), or
    puts the old elements back when they were not (the one-pass compiled form)."""

    def __init__(self, write=None, undo=None) -> None:
        self._write, self._undo = write, undo

    def finish(self, ok: bool) -> None:
        if ok and self._write is not None:
            self._write()
        if not ok and self._undo is not None:
            self._undo()


@dataclass(slots=True)
class Segments:
    """A message's change as segments: per box its gap entries and value bytes, the
    segments back to back (``coded``: each box's entries, then its values) and per box how
    far its digest moves."""

    entries: torch.Tensor
    value_bytes: torch.Tensor
    coded: torch.Tensor
    moves: torch.Tensor


def compare_ahead(geometries: Iterable[Boxes], tensors: Mapping, base: Mapping, cache: dict) -> None:
    """The changed elements of every buffer the vectorized ``geometries`` read, compared
    at once with two read-backs (:func:`changed_elements_many`) into ``cache`` (a refit's,
    as :meth:`Boxes.segments` takes it): what :meth:`Boxes.code` would otherwise find buffer
    by buffer, a read-back each."""
    changed = cache.setdefault(_CHANGED, {})
    todo: dict = {}
    for g in geometries:
        if g.vectorized:
            todo.update({ref: unit for ref, unit in zip(g.refs, g.itemsizes, strict=True)
                         if ref not in changed and ref in base})
    if todo:
        found = changed_elements_many([byte_view(tensors[r]).reshape(-1) for r in todo],
                                      [byte_view(base[r]).reshape(-1) for r in todo], list(todo.values()))
        changed.update(zip(todo, found, strict=True))


class Boxes:
    """Where the elements of one bucket's boxes sit in their buffers, as tensors (one row
    per box, dims padded to the deepest): maps buffers' changed elements (flat indices,
    ascending) to the bucket's (box by box in stream order, each counted from its box's
    first element) and back, a few tensor operations per bucket whatever its boxes."""

    def __init__(self, boxes: tuple[BoxCopy, ...], schedule: RankSchedule, device: torch.device, *,
                 vectorized: bool | None = None) -> None:
        self.vectorized = device.type != "cpu" if vectorized is None else vectorized  # else numpy views
        self.refs: list = []
        for b in boxes:
            if b.buffer not in self.refs:
                self.refs.append(b.buffer)
        self.boxes = boxes
        self.itemsizes = [DTYPE_ITEMSIZE[schedule.buffers[r].dtype] for r in self.refs]
        k = max([len(b.lengths) for b in boxes] + [1])
        shapes, lengths, lo = [], [], []
        for b in boxes:
            shape = schedule.buffers[b.buffer].shape
            strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
            lo.append(sum(o * st for o, st in zip(b.offsets, strides, strict=True)))
            shapes.append([1] * (k - len(shape)) + list(shape))  # padded in front: a dim of 1 is full
            lengths.append([1] * (k - len(shape)) + list(b.lengths))
        self.ref_of = torch.tensor([self.refs.index(b.buffer) for b in boxes], dtype=torch.int64, device=device)
        self.box_itemsize = [self.itemsizes[self.refs.index(b.buffer)] for b in boxes]
        self._shapes = [tuple(schedule.buffers[b.buffer].shape) for b in boxes]
        self._run_cache: dict[int, tuple[np.ndarray, int]] = {}
        self.itemsize = torch.tensor(self.box_itemsize, dtype=torch.int64, device=device)
        self._itemsize_host = torch.tensor(self.box_itemsize, dtype=torch.int64)  # sizes are host arithmetic
        self._span = max([math.prod(schedule.buffers[r].shape) for r in self.refs] + [1]) + 1
        self.lo = torch.tensor(lo, dtype=torch.int64, device=device)
        # Per dim where it matters: (whether some box is partial there, so its digit says
        # whether an element is inside; the buffer's extent from there and stride; the box's
        # length and stride). A box's index of an element differs from its offset from the
        # box's first element by digit * (buffer stride - box stride) per dim.
        self._dims = []
        for d in range(k):
            check = d > 0 and any(sh[d] != ln[d] for sh, ln in zip(shapes, lengths, strict=True))
            convert = any(math.prod(sh[d + 1 :]) != math.prod(ln[d + 1 :]) for sh, ln in zip(shapes, lengths, strict=True))
            if check or convert:
                self._dims.append((check, *(torch.tensor(col, dtype=torch.int64, device=device) for col in (
                    [math.prod(sh[d:]) for sh in shapes], [math.prod(sh[d + 1 :]) for sh in shapes],
                    [ln[d] for ln in lengths], [math.prod(ln[d + 1 :]) for ln in lengths]))))
        hi = [first + sum((n - 1) * math.prod(sh[d + 1 :]) for d, (n, sh_d) in enumerate(zip(ln, sh, strict=True))) + 1
              for first, ln, sh in zip(lo, lengths, shapes, strict=True)]
        self.bounds = torch.tensor([lo, hi], dtype=torch.int64, device=device) + self.ref_of * self._span

    def select(self, changed: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(index in its box, flat index in its buffer, box) of every changed element in
        the bucket's boxes, in stream order; ``changed``: per ref, its buffer's."""
        keyed = torch.cat([c + i * self._span for i, c in enumerate(changed)])
        ends = torch.searchsorted(keyed, self.bounds)  # [2, box]
        num = ends[1] - ends[0]
        total = int(num.sum())  # the one size read back; the rest stays on the device
        box = torch.repeat_interleave(torch.arange(len(self.boxes), device=keyed.device), num, output_size=total)
        at = torch.arange(total, device=keyed.device) + torch.repeat_interleave(
            ends[0] - (torch.cumsum(num, 0) - num), num, output_size=total)
        flat = keyed[at] - self.ref_of[box] * self._span
        # An element is in its box when every digit of its offset from the box's first
        # element (in the buffer's dims) is below the box's length there; those digits,
        # in the box's dims, are its index in the box.
        rel = flat - self.lo[box]
        if not self._dims:  # every box a contiguous run
            return rel, flat, box
        inside = torch.ones_like(rel, dtype=torch.bool)
        local = rel.clone()
        for check, outer, stride, length, box_stride in self._dims:
            digit = torch.div(torch.remainder(rel, outer[box]), stride[box], rounding_mode="floor")
            if check:
                inside &= digit < length[box]
            local -= digit * (stride - box_stride)[box]
        keep = inside.nonzero().squeeze(1)
        return local.index_select(0, keep), flat.index_select(0, keep), box.index_select(0, keep)

    def flat(self, local: torch.Tensor, box: torch.Tensor) -> torch.Tensor:
        """The buffers' flat indices of the boxes' elements ``local`` (of boxes ``box``)."""
        rel = local.clone()
        for _check, _outer, stride, length, box_stride in self._dims:
            digit = torch.remainder(torch.div(local, box_stride[box], rounding_mode="floor"), length[box])
            rel += digit * (stride - box_stride)[box]
        return rel + self.lo[box]

    # ---- the change of a message ------------------------------------------------------------
    def _flat(self, tensors) -> list[torch.Tensor]:
        """This geometry's buffers of ``tensors`` (by ref), as flat bytes, in ref order."""
        return [byte_view(tensors[r]).reshape(-1) for r in self.refs]

    def _np(self, tensor: torch.Tensor, i: int) -> np.ndarray:
        """Box ``i`` of ``tensor`` (its buffer) as a numpy view of integers of its element size."""
        b = self.boxes[i]
        view = byte_view(tensor).view(_INT[self.box_itemsize[i]])
        return view[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths, strict=True))].numpy()

    def code(self, tensors, base, changed: dict, verify: bool) -> Change:
        """The change of the boxes from ``base`` to ``tensors`` (by ref); ``changed``: a
        cache of each buffer's changed elements (the vectorized form compares each buffer
        once per refit)."""
        if not self.vectorized:
            return self._code_cpu(tensors, base, verify)
        for ref, itemsize in zip(self.refs, self.itemsizes, strict=True):
            if ref not in changed:
                changed[ref] = changed_elements(byte_view(tensors[ref]).reshape(-1), byte_view(base[ref]).reshape(-1),
                                                itemsize)
        local, flat, box = self.select([changed[r] for r in self.refs])
        n = len(self.boxes)
        if len(set(self.itemsizes)) == 1:  # every buffer gathered in one call (one launch on CUDA)
            u = self.itemsizes[0]
            new = gather_elements_many(self._flat(tensors), self.ref_of[box], flat, u)
            moves = (delta_digests(gather_elements_many(self._flat(base), self.ref_of[box], flat, u), new, local * u,
                                   box, n) if verify else torch.zeros(n, dtype=torch.int64, device=local.device))
            return Change(local, torch.bincount(box, minlength=n).cpu(), new.reshape(-1), moves)
        values, at = _values(self, box, None)
        moves = torch.zeros(n, dtype=torch.int64, device=local.device)
        # One element size: the old values gather beside the new ones and one digest call
        # covers the message (a call per buffer is a dozen kernel launches each on a GPU).
        olds = torch.empty_like(values) if verify and at is None else None
        for i, u, idx in self.groups(box):
            at_flat = _masked(flat, idx)
            new = _rows(tensors[self.refs[i]], u).index_select(0, at_flat)
            _put(values, at, idx, new)
            if verify:
                old = _rows(base[self.refs[i]], u).index_select(0, at_flat)
                if olds is not None:
                    _put(olds, None, idx, old)
                else:
                    moves += delta_digests(old, new, _masked(local, idx) * u, _masked(box, idx), n)
        if olds is not None:
            u = self.itemsizes[0]
            moves = delta_digests(olds.view(-1, u), values.view(-1, u), local * u, box, n)
        return Change(local, torch.bincount(box, minlength=n).cpu(), values, moves)

    def _code_cpu(self, tensors, base, verify: bool) -> Change:
        locals_, values = [], []
        moves = np.zeros(len(self.boxes), dtype=np.int64)
        for i, b in enumerate(self.boxes):
            cur, old = self._np(tensors[b.buffer], i), self._np(base[b.buffer], i)
            local = np.flatnonzero(cur != old)
            new = cur.flat[local] if local.size else cur.reshape(-1)[:0]
            locals_.append(local)
            values.append(new.view(np.uint8).reshape(-1))
            if verify and local.size:
                moves[i] = _moved(old.flat[local], new, local, self.box_itemsize[i])
        counts = torch.tensor([x.size for x in locals_], dtype=torch.int64)
        return Change(torch.from_numpy(np.concatenate(locals_ + [np.zeros(0, np.int64)]).astype(np.int64)), counts,
                      torch.from_numpy(np.concatenate(values + [np.zeros(0, np.uint8)])), torch.from_numpy(moves))

    def apply(self, tensors, change: Change, verify: bool):
        """Check and write a change (``change.moves`` unused): returns the digest moves it
        makes on this rank's buffers (zeros without ``verify``) and a function that writes
        it (call it once the moves were found right)."""
        if not self.vectorized:
            return self._apply_cpu(tensors, change, verify)
        n = len(self.boxes)
        counts = change.counts.to(change.local.device)
        box = torch.repeat_interleave(torch.arange(n, device=counts.device), counts,
                                      output_size=change.local.numel())
        flat = self.flat(change.local, box)
        if len(set(self.itemsizes)) == 1:  # every buffer read and written in one call each
            u, buffers, ref = self.itemsizes[0], self._flat(tensors), self.ref_of[box]
            new = change.values.view(-1, u)
            moves = (delta_digests(gather_elements_many(buffers, ref, flat, u), new, change.local * u, box, n) if verify
                     else torch.zeros(n, dtype=torch.int64, device=counts.device))
            return moves, lambda: write_elements_many(buffers, ref, flat, new, u)
        values, at = _values(self, box, change.values)
        moves = torch.zeros(n, dtype=torch.int64, device=counts.device)
        olds = torch.empty_like(values) if verify and at is None else None  # one digest call, as in code
        writes = []
        for i, u, idx in self.groups(box):
            rows, f = _rows(tensors[self.refs[i]], u), _masked(flat, idx)
            new = _take(values, at, idx, u)
            if olds is not None:
                _put(olds, None, idx, rows.index_select(0, f))
            elif verify:
                moves += delta_digests(rows.index_select(0, f), new, _masked(change.local, idx) * u, _masked(box, idx), n)
            writes.append((rows, f, new, u))
        if olds is not None:
            u = self.itemsizes[0]
            moves = delta_digests(olds.view(-1, u), values.view(-1, u), change.local * u, box, n)

        def write() -> None:
            for rows, f, new, u in writes:
                write_elements(rows.view(-1), f, new.reshape(-1), u)  # fused scatter on CUDA
        return moves, write

    def _apply_cpu(self, tensors, change: Change, verify: bool):
        local, values = change.local.numpy(), change.values.numpy()
        moves = np.zeros(len(self.boxes), dtype=np.int64)
        writes = []
        start = offset = 0
        for i, k in enumerate(change.counts.tolist()):
            if not k:
                continue
            b, u = self.boxes[i], self.box_itemsize[i]
            dst, at = self._np(tensors[b.buffer], i), local[start : start + k]
            new = values[offset : offset + k * u].view(dst.dtype)
            if verify:
                moves[i] = _moved(dst.flat[at], new, at, u)
            writes.append((dst, at, new))
            start, offset = start + k, offset + k * u

        def write() -> None:
            for dst, at, new in writes:
                dst.flat[at] = new
        return torch.from_numpy(moves), write


    # ---- segments: each box's gap entries then its values, box after box -------------------
    def segments(self, tensors, base, verify: bool, cache: dict | None = None) -> Segments:
        """The change of the boxes from ``base`` to ``tensors`` (by ref) as segments.
        ``cache``: what this refit already compared: boxes coded (the same region sent to
        several destinations, e.g. data-parallel replicas, is compared once; compiled form),
        or each buffer's changed elements (vectorized form: a buffer cut into boxes for
        several messages, e.g. TP shards, is compared once per refit, not once per message)."""
        if not self.vectorized and _native is not None:
            return self._segments_native(tensors, base, {} if cache is None else cache)
        change = self.code(tensors, base, {} if cache is None else cache.setdefault(_CHANGED, {}), verify)
        device = change.values.device
        # Per-box sizes come to the host (a few numbers per box); per-element work stays on the device.
        entries = segment_entry_counts(change.local, change.counts.to(device)).cpu()
        value_bytes = change.counts * self._itemsize_host
        coded = torch.empty(int((entries + value_bytes).sum()), dtype=torch.uint8, device=device)
        ent = torch.empty(int(entries.sum()), dtype=torch.uint8, device=device)
        segment_entries(change.local.to(device), change.counts.to(device), ent)
        e_at, v_at = segment_places(entries, value_bytes, device)
        coded[e_at], coded[v_at] = ent, change.values
        return Segments(entries, value_bytes, coded, change.moves)

    def _runs(self, i: int) -> tuple[np.ndarray, int]:
        """Box ``i`` as runs of contiguous elements: (each run's first element, run length)."""
        cached = self._run_cache.get(i)
        if cached is None:
            b = self.boxes[i]
            shape = self._shapes[i]
            d = len(shape) - 1
            while d > 0 and b.lengths[d] == shape[d]:
                d -= 1  # the dims after d are whole: one run spans them
            run = math.prod(b.lengths[d:])
            strides = [math.prod(shape[j + 1 :]) for j in range(len(shape))]
            starts = np.zeros(1, dtype=np.int64) + sum(o * st for o, st in zip(b.offsets, strides, strict=True))
            for j in range(d):
                starts = (starts[:, None] + np.arange(b.lengths[j], dtype=np.int64) * strides[j]).reshape(-1)
            cached = self._run_cache[i] = (starts, run)
        return cached

    def _segments_native(self, tensors, base, cache: dict) -> Segments:
        n = len(self.boxes)
        sizes = [len(self._runs(i)[0]) * self._runs(i)[1] for i in range(n)]  # elements per box
        worst = max([k * (u + 1) + k // 255 + 1 for k, u in zip(sizes, self.box_itemsize, strict=True)] + [1])
        out, vals = np.empty(worst, dtype=np.uint8), np.empty(worst, dtype=np.uint8)
        entries, value_bytes, moves, parts = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.uint64), []
        for i, b in enumerate(self.boxes):
            key = (b.buffer, b.offsets, b.lengths)
            if key not in cache:
                starts, run = self._runs(i)
                e, k, move = _native.encode(_flat_np(tensors[b.buffer]), _flat_np(base[b.buffer]), starts, run,
                                            self.box_itemsize[i], out, vals)
                cache[key] = (e, k * self.box_itemsize[i], move, out[: e + k * self.box_itemsize[i]].copy())
            entries[i], value_bytes[i], moves[i], coded = cache[key]
            parts.append(coded)
        coded = np.concatenate(parts + [np.zeros(0, np.uint8)])
        return Segments(torch.from_numpy(entries), torch.from_numpy(value_bytes), torch.from_numpy(coded),
                        torch.from_numpy(moves.view(np.int64)))

    def apply_segments(self, tensors, seg: Segments, verify: bool):
        """Check and write segments (``seg.moves`` unused): returns the digest moves they
        make on this rank's buffers (zeros without ``verify``) and a :class:`Written`
        (``finish(True)`` once the moves were found right, ``finish(False)`` else)."""
        if self.vectorized or _native is None:  # the boxes' segments lie back to back in ``coded``
            e_at, v_at = segment_places(seg.entries, seg.value_bytes, seg.coded.device)
            ent, values = seg.coded[e_at], seg.coded[v_at]
            local = segment_positions(ent, seg.entries.to(seg.coded.device))
            counts = torch.div(seg.value_bytes, self._itemsize_host, rounding_mode="floor")
            moves, write = self.apply(tensors, Change(local, counts, values, seg.moves), verify)
            return moves, Written(write=write)
        # One pass: each changed element's digest move, its old bytes kept and its new ones
        # written; a failed check puts the old ones back (``undo``).
        coded = seg.coded.numpy()
        lengths = (seg.entries + seg.value_bytes).tolist()
        at = list(itertools.accumulate([0] + lengths))
        moves = np.zeros(len(self.boxes), np.uint64)
        done = []
        for i, (b, e) in enumerate(zip(self.boxes, seg.entries.tolist(), strict=True)):
            if lengths[i]:
                starts, run = self._runs(i)
                job = (_flat_np(tensors[b.buffer]), starts, run, self.box_itemsize[i])
                old = np.empty(lengths[i] - e, dtype=np.uint8)
                moves[i] = _native.apply(*job, coded[at[i] : at[i + 1]], e, True, old)
                done.append((job, coded[at[i] : at[i] + e], old, e))

        def undo() -> None:
            for job, entries, old, e in reversed(done):
                _native.apply(*job, np.concatenate([entries, old]), e, True, None)
        return torch.from_numpy(moves.view(np.int64)), Written(undo=undo)

    def groups(self, box: torch.Tensor):
        """Per ref of the bucket holding changed elements: (its index, itemsize, the
        positions of the elements in its boxes, ascending, or None when the bucket has one
        ref), from :func:`positions_by_buffer`."""
        if len(self.refs) == 1:
            yield 0, self.itemsizes[0], None
            return
        for i, at in positions_by_buffer(self.ref_of[box], len(self.refs)):
            yield i, self.itemsizes[i], at



def _rows(tensor: torch.Tensor, itemsize: int) -> torch.Tensor:
    """A contiguous buffer as one row of bytes per element."""
    return byte_view(tensor).reshape(-1).view(-1, itemsize)


def _values(boxes: Boxes, box: torch.Tensor, values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A message's values (new, or ``values``) and, when its boxes mix element sizes, each
    element's byte offset there (None: one size ``u``, element ``j`` at ``j * u``)."""
    if len(set(boxes.itemsizes)) == 1:
        nbytes, at = box.numel() * boxes.itemsizes[0], None
    else:
        sizes = boxes.itemsize[box]
        nbytes, at = int(sizes.sum()), torch.cumsum(sizes, 0) - sizes
    if values is None:
        values = torch.empty(nbytes, dtype=torch.uint8, device=box.device)
    return values, at


def _masked(t: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """``t`` at positions ``idx`` (all of it for None)."""
    return t if idx is None else t.index_select(0, idx)


def _put(values: torch.Tensor, at: torch.Tensor | None, idx: torch.Tensor | None, rows: torch.Tensor) -> None:
    """Element rows ``rows`` into ``values`` at elements ``idx`` (None: all, in order); ``at``
    each element's byte offset when the elements mix sizes."""
    u = rows.shape[1]
    if at is None:
        if idx is None:
            values.copy_(rows.reshape(-1))
        else:
            values.view(-1, u).index_copy_(0, idx, rows)
        return
    index = (_masked(at, idx)[:, None] + torch.arange(u, device=at.device)).reshape(-1)
    values[index] = rows.reshape(-1)


def _take(values: torch.Tensor, at: torch.Tensor | None, idx: torch.Tensor | None, u: int) -> torch.Tensor:
    """The element rows of ``values`` at elements ``idx`` (None: all)."""
    if at is None:
        return _masked(values.view(-1, u), idx)
    index = (_masked(at, idx)[:, None] + torch.arange(u, device=at.device)).reshape(-1)
    return values[index].view(-1, u)


def _moved(old: np.ndarray, new: np.ndarray, local: np.ndarray, u: int) -> int:
    """How far a box's digest moves when its elements ``local`` go from ``old`` to
    ``new`` (numpy, mod 2**64; as ``kernels.delta.delta_digests``)."""
    unsigned = _UNSIGNED[u]
    diff = new.view(unsigned).astype(np.uint64) - old.view(unsigned).astype(np.uint64)
    offsets = (local * u).astype(np.uint64)
    scale = np.left_shift(np.uint64(1), (offsets % np.uint64(8)) * np.uint64(8))
    weight = np.uint64(2) * (offsets // np.uint64(8)) + np.uint64(1)
    total = (diff * scale * weight).sum(dtype=np.uint64)
    return int(np.array(total, dtype=np.uint64).view(np.int64))


def segment_places(entries: torch.Tensor, value_bytes: torch.Tensor,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each entry byte and each value byte of boxes coded back to back (entries then
    values, per box) sit among the segments."""
    entries, value_bytes = entries.to(device), value_bytes.to(device)
    lengths = entries + value_bytes
    starts = torch.cumsum(lengths, 0) - lengths

    def places(counts: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        total = int(counts.sum())
        before = torch.cumsum(counts, 0) - counts
        return torch.arange(total, device=device) + torch.repeat_interleave(first - before, counts, output_size=total)

    return places(entries, starts), places(value_bytes, starts + entries)


def _flat_np(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU buffer's bytes, flat (numpy, the same memory)."""
    return byte_view(tensor).reshape(-1).numpy()
