"""Regions (N-d boxes of local tensors) and their collapse into strided rows of bytes."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

__all__ = [
    "MAX_ENTRY_BYTES",
    "MAX_STRIDED_DIMS",
    "BoxRegion",
    "Entry",
    "collapse",
    "entries_for",
    "first_box_overlap",
    "region_overlap",
]

# One descriptor entry never exceeds this many bytes, so that every index inside an entry fits
# int32 in the kernel (only final byte offsets are int64). Bigger regions are split.
MAX_ENTRY_BYTES = 1 << 30
# The kernel walks at most three strided dims per entry; boxes that stay more strided than
# that after merging are expanded along their leading dims into several entries.
MAX_STRIDED_DIMS = 3


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class BoxRegion:
    """One N-d box of one local tensor, and where its bytes go in the packed buffer.

    The box is ``tensor[offsets[0]:offsets[0]+lengths[0], ...]``; its
    ``prod(lengths) * itemsize`` bytes are laid out in row-major order of the box starting
    at ``packed_offset_bytes``. A 0-d tensor takes ``offsets == lengths == ()``.
    """

    tensor_index: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    packed_offset_bytes: int

    def __post_init__(self) -> None:
        if not _is_int(self.tensor_index) or self.tensor_index < 0:
            raise ValueError(f"tensor_index must be an int >= 0, got {self.tensor_index!r}")
        for name in ("offsets", "lengths"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(_is_int(v) and v >= 0 for v in value):
                raise ValueError(f"{name} must be a tuple of ints >= 0, got {value!r}")
        if len(self.offsets) != len(self.lengths):
            raise ValueError(
                f"offsets {self.offsets} and lengths {self.lengths} differ in rank "
                f"({len(self.offsets)} != {len(self.lengths)})"
            )
        if not _is_int(self.packed_offset_bytes) or self.packed_offset_bytes < 0:
            raise ValueError(
                f"packed_offset_bytes must be an int >= 0, got {self.packed_offset_bytes!r}"
            )

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return math.prod(self.lengths)

    def nbytes(self, itemsize: int) -> int:
        """Bytes of the box for elements of ``itemsize`` bytes."""
        return self.numel * itemsize


@dataclass(frozen=True, slots=True)
class Entry:
    """One kernel work unit: rows of contiguous bytes at up to three strided dims.

    ``dims`` holds ``(count, byte_stride)`` pairs, outermost first, exactly
    ``MAX_STRIDED_DIMS`` of them (unused ones are ``(1, 0)``); the entry covers
    ``prod(counts) * row_bytes`` bytes starting at ``tensor_offset`` in the tensor and at
    ``packed_offset`` in the packed buffer.
    """

    tensor_index: int
    tensor_offset: int
    packed_offset: int
    row_bytes: int
    dims: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return math.prod(c for c, _ in self.dims) * self.row_bytes

    @property
    def width_log2(self) -> int:
        """log2 of the widest access (<= 16 bytes) every row start and length allows."""
        g = 16
        for v in (self.tensor_offset, self.packed_offset, self.row_bytes):
            g = math.gcd(g, v)
        for c, s in self.dims:
            if c > 1:
                g = math.gcd(g, s)
        return g.bit_length() - 1


def collapse(
    region: BoxRegion, shape: tuple[int, ...], itemsize: int
) -> tuple[int, int, list[tuple[int, int]]]:
    """Collapse a box into ``(tensor_offset, row_bytes, [(count, byte_stride), ...])``.

    Trailing dims that the box covers fully merge into the contiguous row; an outer dim
    merges with the one inside it when that inner dim is covered fully; dims of count 1
    only shift the start. The box must be non-empty and inside ``shape``.
    """
    if not shape:
        return 0, itemsize, []
    ndim = len(shape)
    strides = [0] * ndim
    acc = itemsize
    for k in range(ndim - 1, -1, -1):
        strides[k] = acc
        acc *= shape[k]
    t_off = sum(o * s for o, s in zip(region.offsets, strides, strict=True))
    # Innermost dim j such that every dim after it is full: the row spans dims j..ndim-1.
    j = ndim - 1
    while j > 0 and region.lengths[j] == shape[j]:
        j -= 1
    row_bytes = region.lengths[j] * strides[j]
    dims: list[tuple[int, int]] = []
    for k in range(j):
        count = region.lengths[k]
        if dims and region.lengths[k] == shape[k] and dims[-1][1] == shape[k] * strides[k]:
            # Dim k full: (k-1, k) index one contiguous range of dim-k steps.
            prev_count, _ = dims.pop()
            dims.append((prev_count * count, strides[k]))
        else:
            dims.append((count, strides[k]))
    dims = [(c, s) for c, s in dims if c != 1]
    return t_off, row_bytes, dims


def entries_for(
    region: BoxRegion, shape: tuple[int, ...], itemsize: int, max_entry_bytes: int = MAX_ENTRY_BYTES
) -> list[Entry]:
    """The kernel entries of one non-empty region: collapsed, expanded, split by size."""
    t_off, row_bytes, dims = collapse(region, shape, itemsize)
    out: list[Entry] = []
    _split(
        region.tensor_index,
        t_off,
        region.packed_offset_bytes,
        row_bytes,
        dims,
        max_entry_bytes,
        out,
    )
    return out


def _split(
    tensor_index: int,
    t_off: int,
    p_off: int,
    row_bytes: int,
    dims: list[tuple[int, int]],
    limit: int,
    out: list[Entry],
) -> None:
    total = math.prod(c for c, _ in dims) * row_bytes
    if len(dims) <= MAX_STRIDED_DIMS and total <= limit:
        padded = [(1, 0)] * (MAX_STRIDED_DIMS - len(dims)) + list(dims)
        out.append(Entry(tensor_index, t_off, p_off, row_bytes, tuple(padded)))
        return
    if not dims:
        # One contiguous row over the limit: cut it into limit-sized pieces (limit is a
        # multiple of 16, so the pieces keep the row's alignment).
        for start in range(0, row_bytes, limit):
            out.append(
                Entry(
                    tensor_index,
                    t_off + start,
                    p_off + start,
                    min(limit, row_bytes - start),
                    ((1, 0),) * MAX_STRIDED_DIMS,
                )
            )
        return
    (count0, stride0), rest = dims[0], dims[1:]
    step = math.prod(c for c, _ in rest) * row_bytes  # packed bytes per step of dim 0
    if len(dims) <= MAX_STRIDED_DIMS and step <= limit:
        chunk = limit // step
        for first in range(0, count0, chunk):
            n = min(chunk, count0 - first)
            sub = ([(n, stride0)] if n > 1 else []) + rest
            _split(
                tensor_index,
                t_off + first * stride0,
                p_off + first * step,
                row_bytes,
                sub,
                limit,
                out,
            )
        return
    for i in range(count0):
        _split(
            tensor_index, t_off + i * stride0, p_off + i * step, row_bytes, list(rest), limit, out
        )


def region_overlap(a: BoxRegion, b: BoxRegion) -> bool:
    """Whether two non-empty boxes of the same tensor share an element."""
    return all(
        oa < ob + lb and ob < oa + la
        for oa, la, ob, lb in zip(a.offsets, a.lengths, b.offsets, b.lengths, strict=True)
    )


def first_box_overlap(regions: list[tuple[int, BoxRegion]]) -> tuple[int, int] | None:
    """Indices of the first pair of overlapping boxes among ``(index, region)`` of one tensor."""
    if not regions:
        return None
    if not regions[0][1].offsets:  # 0-d tensor: any two boxes overlap
        return (regions[0][0], regions[1][0]) if len(regions) > 1 else None
    ordered = sorted(regions, key=lambda ir: ir[1].offsets[0])
    for i, (ia, a) in enumerate(ordered):
        end0 = a.offsets[0] + a.lengths[0]
        for ib, b in itertools.islice(ordered, i + 1, None):
            if b.offsets[0] >= end0:
                break
            if region_overlap(a, b):
                return (min(ia, ib), max(ia, ib))
    return None
