"""Delta coding of packed bytes against a base: what changed, where, and its new bytes.

A refit's bucket is a flat run of bytes (boxes of one or more tensors, packed). Between two
versions of an RL policy most of its elements do not change (1-2% of BF16 elements at lr
1e-6), so a sender that holds the bytes of the previous version (the *base*) sends only the
changed elements, and a receiver that holds exactly the same base rebuilds the bucket.

The comparison is by element of ``unit`` bytes (the bucket's element size: 2 for BF16, 1 for
FP8 bytes, or the greatest common divisor of the element sizes a bucket mixes), bit for bit
(integer views: ``-0.0`` and ``0.0`` differ, a NaN equals its own bits).

Payload (``uint8``, no alignment needed)::

    [E: int64][K: int64][E gap entries: uint8][K * unit value bytes]

Entries walk the positions: a pointer starts at element 0; an entry ``e < 255`` marks the
element ``pointer + e`` as changed (its value is the next one) and moves the pointer past it;
``e == 255`` skips 255 elements (a gap of 255 or more takes several entries). So a changed
element costs one byte of position plus its value bytes, and a long unchanged run one byte
per 255 elements: a BF16 bucket with a fraction ``d`` of elements changed encodes to about
``1.5 d + 1/510`` of its size.

Everything here is plain torch (compare, nonzero, cumsum, gather, scatter): the same code
runs on the CPU and on CUDA, and is the reference for the fused kernels of
:mod:`elastic_refit.kernels.delta_triton`, which :func:`changed_elements`,
:func:`encode_delta`, :func:`apply_delta` and :func:`write_elements` run instead for CUDA
tensors when Triton is installed (``ELASTIC_REFIT_DELTA_KERNELS=torch`` keeps the torch
forms).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import torch
from elastic_refit.kernels import delta_triton

__all__ = ["HEADER_BYTES", "SKIP", "apply_delta", "changed_elements", "changed_elements_many", "delta_digests",
           "delta_unit", "encode_delta", "encoded_nbytes", "gather_elements_many", "payload_counts",
           "positions_by_buffer", "segment_entries", "segment_entry_counts", "segment_positions", "write_elements",
           "write_elements_many"]

HEADER_BYTES = 16
SKIP = 255  # an entry that moves the pointer by 255 elements and marks nothing
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def delta_unit(itemsizes: Iterable[int]) -> int:
    """The element size (bytes) a bucket holding elements of ``itemsizes`` is compared in:
    their greatest common divisor (a packed bucket's boxes start at multiples of it)."""
    unit = 0
    for size in itemsizes:
        if size < 1:
            raise ValueError(f"item sizes must be >= 1, got {size}")
        unit = math.gcd(unit, int(size))
    if unit == 0:
        raise ValueError("delta_unit needs at least one item size")
    return unit


def _elements(data: torch.Tensor, unit: int) -> torch.Tensor:
    """``data`` (flat uint8) as one integer per element when it can be viewed so (1-D, every
    element aligned), else as rows of ``unit`` bytes."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"delta coding works on flat uint8 tensors, got {data.dtype} of shape {tuple(data.shape)}")
    if data.numel() % unit:
        raise ValueError(f"{data.numel()} bytes are not a whole number of {unit}-byte elements")
    view = _INT_VIEW.get(unit)
    if view is not None and data.is_contiguous() and (data.storage_offset() % unit == 0):
        try:
            return data.view(view)
        except RuntimeError:  # an allocation not aligned to the element
            pass
    return data.view(-1, unit)


def changed_elements(current: torch.Tensor, base: torch.Tensor, unit: int) -> torch.Tensor:
    """Indices (int64, ascending) of the ``unit``-byte elements where ``current`` and
    ``base`` (flat uint8 of the same size) differ, bit for bit."""
    if current.shape != base.shape:
        raise ValueError(f"current has {current.numel()} bytes, base {base.numel()}")
    a, b = _elements(current, unit), _elements(base, unit)
    if a.dim() != b.dim():  # one of them could not be viewed as integers: compare rows
        a, b = current.view(-1, unit), base.view(-1, unit)
    if a.dim() == 1 and delta_triton.usable(a):  # compare and compaction fused (Triton)
        return delta_triton.encode_changes(a, b, values=False)[0]
    if a.dim() == 1 and a.device.type == "cpu":  # numpy's compare + flatnonzero: ~2x torch's on one thread
        import numpy as np

        return torch.from_numpy(np.flatnonzero(a.numpy() != b.numpy()).astype(np.int64, copy=False))
    differ = a != b
    if differ.dim() == 2:
        differ = differ.any(dim=1)
    return differ.nonzero().flatten()


def changed_elements_many(currents: list[torch.Tensor], bases: list[torch.Tensor], units: list[int], *,
                          batched: bool | None = None) -> list[torch.Tensor]:
    """:func:`changed_elements` of several buffers (flat uint8 each, of one device), found
    with two read-backs in all instead of one or two per buffer: on a GPU whose ranks share
    it, each read-back waits for a context switch (milliseconds), and a rank compares tens
    of buffers per refit. On the CPU (no read-backs) buffer by buffer, as there, unless
    ``batched`` (tests) says otherwise."""
    if not (len(currents) == len(bases) == len(units)):
        raise ValueError(f"{len(currents)} currents, {len(bases)} bases and {len(units)} units")
    if batched is None:
        batched = bool(currents) and currents[0].device.type != "cpu"
    if not currents or not batched:
        return [changed_elements(c, b, u) for c, b, u in zip(currents, bases, units, strict=True)]
    sizes = []
    for c, b, u in zip(currents, bases, units, strict=True):
        if c.shape != b.shape:
            raise ValueError(f"current has {c.numel()} bytes, base {b.numel()}")
        _elements(c, u)  # the same checks as changed_elements
        sizes.append(c.numel() // u)
    differ = torch.empty(sum(sizes), dtype=torch.bool, device=currents[0].device)
    at = 0
    for c, b, u, n in zip(currents, bases, units, sizes, strict=True):
        a, z = _elements(c, u), _elements(b, u)
        if a.dim() != z.dim() or a.dim() == 2:  # rows: an element differs where any byte does
            torch.any(c.view(-1, u) != b.view(-1, u), dim=1, out=differ[at : at + n])
        else:
            torch.ne(a, z, out=differ[at : at + n])
        at += n
    flat = differ.nonzero().flatten()  # read-back 1: how many changed in all
    starts = torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int64, device=flat.device)
    cuts = torch.searchsorted(flat, starts).tolist()  # read-back 2: where each buffer's run ends
    return [flat[cuts[i] : cuts[i + 1]] - starts[i] for i in range(len(sizes))]


def _gaps(changed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per changed element: the skips before its entry and its entry (the rest of its gap)."""
    prev = torch.cat([changed.new_full((1,), -1), changed[:-1]])
    gaps = changed - prev - 1
    return torch.div(gaps, SKIP, rounding_mode="floor"), torch.remainder(gaps, SKIP)


def encoded_nbytes(changed: torch.Tensor, unit: int) -> int:
    """Bytes of the payload that encodes the elements ``changed`` (ascending indices)."""
    if changed.numel() == 0:
        return HEADER_BYTES
    skips, _ = _gaps(changed)
    return HEADER_BYTES + int(skips.sum()) + changed.numel() * (1 + unit)


def encode_delta(current: torch.Tensor, base: torch.Tensor, unit: int, out: torch.Tensor | None = None,
                 changed: torch.Tensor | None = None) -> torch.Tensor:
    """The payload that turns ``base`` into ``current`` (flat uint8 tensors of equal size,
    compared in ``unit``-byte elements); written into the front of ``out`` when given (it
    may be ``current`` itself: the values are gathered before anything is written) and
    returned as the view of the bytes written. ``changed``: the indices, when known."""
    gathered = None
    if changed is None:
        a = _elements(current, unit)
        if a.dim() == 1 and delta_triton.usable(a) and _elements(base, unit).dim() == 1:
            changed, gathered = delta_triton.encode_changes(a, _elements(base, unit))  # values in the same pass
        else:
            changed = changed_elements(current, base, unit)
    k = changed.numel()
    skips, rest = _gaps(changed) if k else (changed, changed)
    num_entries = k + (int(skips.sum()) if k else 0)
    nbytes = HEADER_BYTES + num_entries + k * unit
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=current.device)
    elif out.numel() < nbytes:
        raise ValueError(f"the payload needs {nbytes} bytes, out has {out.numel()}")
    # A copy either way: out may alias current.
    values = (current.view(-1, unit).index_select(0, changed).reshape(-1) if gathered is None
              else gathered.view(torch.uint8))
    out = out[:nbytes]
    header = torch.tensor([num_entries, k], dtype=torch.int64).view(torch.uint8)
    out[:HEADER_BYTES].copy_(header)
    entries = out[HEADER_BYTES : HEADER_BYTES + num_entries]
    entries.fill_(SKIP)
    if k:
        # Entry of changed element i: after i earlier entries and every skip up to its own.
        entries[torch.arange(k, device=changed.device) + torch.cumsum(skips, 0)] = rest.to(torch.uint8)
        out[HEADER_BYTES + num_entries :].copy_(values)
    return out


def payload_counts(payload: torch.Tensor) -> tuple[int, int]:
    """(entries, changed elements) a payload's header says."""
    if payload.numel() < HEADER_BYTES:
        raise ValueError(f"a delta payload has at least {HEADER_BYTES} bytes, got {payload.numel()}")
    header = payload[:HEADER_BYTES].cpu().clone().view(torch.int64)
    return int(header[0]), int(header[1])


def apply_delta(payload: torch.Tensor, target: torch.Tensor, unit: int) -> int:
    """Write a payload of :func:`encode_delta` into ``target`` (flat uint8, holding the
    base): it then holds the current bytes. Returns the number of elements written.
    ``ValueError`` for a payload that does not fit ``target``."""
    num_entries, k = payload_counts(payload)
    if num_entries < k or k < 0 or payload.numel() != HEADER_BYTES + num_entries + k * unit:
        raise ValueError(f"a delta payload of {payload.numel()} bytes cannot hold {num_entries} entries and "
                         f"{k} values of {unit} bytes")
    if k == 0:
        return 0
    entries = payload[HEADER_BYTES : HEADER_BYTES + num_entries]
    marks = entries != SKIP
    step = torch.where(marks, entries.to(torch.int64) + 1, torch.full_like(entries, SKIP, dtype=torch.int64))
    changed = torch.cumsum(step, 0)[marks] - 1
    if changed.numel() != k:
        raise ValueError(f"a delta payload's entries mark {changed.numel()} elements, its header says {k}")
    rows = target.view(-1, unit)
    if k and int(changed[-1]) >= rows.shape[0]:
        raise ValueError(f"a delta payload writes element {int(changed[-1])} of a target of {rows.shape[0]}")
    write_elements(target, changed, payload[HEADER_BYTES + num_entries :], unit)
    return k


def write_elements(target: torch.Tensor, index: torch.Tensor, values: torch.Tensor, unit: int) -> None:
    """Write the ``unit``-byte elements ``index`` (int64, distinct, in range) of ``target``
    (flat uint8) with ``values`` (their bytes, element after element): the apply's scatter
    (fused on CUDA, :func:`delta_triton.scatter`; ``index_copy_`` otherwise)."""
    if index.numel() == 0:
        return
    view = _INT_VIEW.get(unit)
    if view is not None and delta_triton.usable(target) and target.is_contiguous() and values.is_contiguous():
        ints, vals = _elements(target, unit), _elements(values, unit)
        if vals.dim() != 1:  # values at an unaligned offset (a payload's): a small aligned copy
            vals = _elements(values.clone(), unit)
        if ints.dim() == 1 and vals.dim() == 1:
            delta_triton.scatter(ints, index.contiguous(), vals)
            return
    target.view(-1, unit).index_copy_(0, index, values.reshape(-1, unit))


def positions_by_buffer(ref: torch.Tensor, num_buffers: int):
    """Per buffer that ``ref`` (each element's buffer) names: (its index, the positions of
    its elements, ascending), with one stable sort and one read of the per-buffer counts in
    all (a boolean mask per buffer would read a size back from the device each: on a GPU
    shared by many processes, each such read waits for the device's time slices)."""
    order = torch.argsort(ref, stable=True)
    start = 0
    for i, k in enumerate(torch.bincount(ref, minlength=num_buffers).tolist()):
        if k:
            yield i, order[start : start + k]
        start += k


def _fused_many(buffers: list[torch.Tensor], unit: int) -> list[torch.Tensor] | None:
    """The buffers as flat integer views the fused many-buffer kernels take, or None (no
    Triton, not a device, an element size without an integer view, an unaligned buffer)."""
    if _INT_VIEW.get(unit) is None or not delta_triton.usable(buffers[0]):
        return None
    views = [_elements(b, unit) for b in buffers]
    return views if all(v.dim() == 1 for v in views) else None


def gather_elements_many(buffers: list[torch.Tensor], ref: torch.Tensor, index: torch.Tensor,
                         unit: int) -> torch.Tensor:
    """Rows of ``unit`` bytes: element ``index[i]`` of ``buffers[ref[i]]`` (flat uint8
    buffers of one device; ``ref``, ``index`` int64): one fused launch on CUDA
    (:func:`delta_triton.gather_many`), a gather per buffer otherwise."""
    if len(buffers) == 1:
        return buffers[0].view(-1, unit).index_select(0, index)
    fused = _fused_many(buffers, unit)
    if fused is not None:
        return delta_triton.gather_many(fused, ref.contiguous(), index.contiguous()).view(torch.uint8).view(-1, unit)
    out = torch.empty((index.numel(), unit), dtype=torch.uint8, device=index.device)
    for i, at in positions_by_buffer(ref, len(buffers)):
        out.index_copy_(0, at, buffers[i].view(-1, unit).index_select(0, index.index_select(0, at)))
    return out


def write_elements_many(buffers: list[torch.Tensor], ref: torch.Tensor, index: torch.Tensor, rows: torch.Tensor,
                        unit: int) -> None:
    """Write ``rows`` (``unit`` bytes each) as element ``index[i]`` of ``buffers[ref[i]]``
    (no element written twice), the way back of :func:`gather_elements_many`."""
    if len(buffers) == 1:
        write_elements(buffers[0], index, rows.reshape(-1), unit)
        return
    fused = _fused_many(buffers, unit)
    if fused is not None and rows.is_contiguous():
        delta_triton.scatter_many(fused, ref.contiguous(), index.contiguous(), rows.view(-1).view(_INT_VIEW[unit]))
        return
    for i, at in positions_by_buffer(ref, len(buffers)):
        write_elements(buffers[i], index.index_select(0, at), rows.index_select(0, at).reshape(-1), unit)


# ---- segments: one run of entries per box, each counting from its box's first element ------
# A bucket's payload for the executor codes each box on its own (its gaps restart at the
# box's start), so the entries and values of any run of boxes can be cut out of it and
# forwarded, and sizes follow from per-box counts. Everything stays O(changed elements).


def _segment_gaps(local: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per changed element: the unchanged elements before it in its segment."""
    prev = torch.cat([local.new_full((1,), -1), local[:-1]])
    starts = torch.cumsum(counts, 0) - counts  # each segment's first element
    starts = starts[counts > 0]
    prev[starts] = -1
    return local - prev - 1


def segment_entry_counts(local: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Entries per segment (int64, one per segment) that code ``local``: per segment,
    ``counts[s]`` ascending element indices counted from the segment's start."""
    if local.numel() == 0:
        return torch.zeros_like(counts)
    skips = torch.div(_segment_gaps(local, counts), SKIP, rounding_mode="floor")
    segment = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    return counts + torch.zeros_like(counts).index_add_(0, segment, skips)


def segment_entries(local: torch.Tensor, counts: torch.Tensor, out: torch.Tensor) -> None:
    """Write the entries of :func:`segment_entry_counts` into ``out`` (uint8, exactly their
    number): segment after segment, each as :func:`encode_delta` codes one run."""
    out.fill_(SKIP)
    if local.numel() == 0:
        return
    gaps = _segment_gaps(local, counts)
    skips, rest = torch.div(gaps, SKIP, rounding_mode="floor"), torch.remainder(gaps, SKIP)
    out[torch.arange(local.numel(), device=local.device) + torch.cumsum(skips, 0)] = rest.to(torch.uint8)


def segment_positions(entries: torch.Tensor, entry_counts: torch.Tensor) -> torch.Tensor:
    """The element indices (int64, each counted from its segment's start, segment after
    segment) that ``entries`` code, ``entry_counts[s]`` entries per segment."""
    if entries.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=entries.device)
    marks = entries != SKIP
    step = torch.where(marks, entries.to(torch.int64) + 1, torch.full_like(entries, SKIP, dtype=torch.int64))
    total = torch.cumsum(step, 0)
    # A segment's pointer starts at 0: subtract what the segments before it walked.
    firsts = torch.cumsum(entry_counts, 0) - entry_counts
    base = torch.repeat_interleave(torch.where(firsts > 0, total[(firsts - 1).clamp(min=0)], 0), entry_counts)
    return (total - base)[marks] - 1


def _words(rows: torch.Tensor) -> torch.Tensor:
    """Rows of ``u <= 8`` bytes as little-endian unsigned integers in int64 (mod 2**64)."""
    shifts = torch.arange(rows.shape[1], device=rows.device, dtype=torch.int64) * 8
    return (rows.to(torch.int64) << shifts).sum(1)


def delta_digests(old: torch.Tensor, new: torch.Tensor, byte_offsets: torch.Tensor, segment: torch.Tensor,
                  num_segments: int) -> torch.Tensor:
    """How much each segment's digest (``transport.buffers.digest``, before its final xor
    with the length) moves when the elements ``old`` (rows of ``u`` bytes, ``u`` in 1, 2,
    4, 8) become ``new``: elements at ``byte_offsets`` of their segment (multiples of
    ``u``), in segment ``segment``. The digest is a sum of words times odd weights mod
    2**64, so this needs the changed elements only (int64 per segment, wrapping)."""
    out = torch.zeros(num_segments, dtype=torch.int64, device=old.device)
    if old.numel() == 0:
        return out
    diff = _words(new) - _words(old)
    scale = torch.ones_like(byte_offsets) << ((byte_offsets % 8) * 8)  # the element's place in its word
    weight = 2 * torch.div(byte_offsets, 8, rounding_mode="floor") + 1
    return out.index_add_(0, segment, diff * scale * weight)
