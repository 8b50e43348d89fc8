"""The rules of a symbolic layout (``layout.symbolic``): meshes of ranks, the splits that cut
a tensor over their axes, and the rules that place the resulting shards in buffers.

Pure numpy: each rule enumerates the pieces of any set of mesh positions on demand.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from elastic_refit.layout.box import canonical_dtype
from elastic_refit.layout.dtensor import _chunk, _merge_intervals

__all__ = ["SPLIT_KINDS", "BufferRule", "Mesh", "PieceRule", "Split"]

SPLIT_KINDS = ("chunk", "strided", "block", "balanced", "slice")
_AXIS_KINDS = ("chunk", "strided", "block", "balanced")


def _ints(values: object, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in values)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a sequence of integers, got {values!r}") from None
    return out


@dataclass(frozen=True, slots=True)
class Mesh:
    """Ranks laid out as an N-d mesh: position ``c`` (row-major over ``shape``) is rank
    ``base + sum(c[a] * strides[a])``, or ``table[position]`` for a mesh given as a rank table.

    An affine mesh must decode (every rank it holds has one position, found by dividing by
    the strides, largest first); ``Mesh.of`` turns any rank array into the affine form when
    one fits, else into a table.
    """

    shape: tuple[int, ...]
    base: int = 0
    strides: tuple[int, ...] = ()
    table: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        shape = _ints(self.shape, "mesh shape")
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"mesh shape must be non-empty and >= 1, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        table = _ints(self.table, "mesh table")
        object.__setattr__(self, "table", table)
        if table:
            if len(table) != self.size or len(set(table)) != len(table) or min(table) < 0:
                raise ValueError(f"mesh table must list {self.size} distinct ranks >= 0, got {len(table)} "
                                 f"({sorted(table)[:8]}...)")
            object.__setattr__(self, "base", 0)
            object.__setattr__(self, "strides", ())
            return
        strides = _ints(self.strides, "mesh strides") or _row_major(shape)
        if len(strides) != len(shape):
            raise ValueError(f"mesh of shape {shape} needs {len(shape)} strides, got {strides}")
        # size-1 axes have no stride (so equal meshes spell alike)
        strides = tuple(0 if s == 1 else st for s, st in zip(shape, strides, strict=True))
        object.__setattr__(self, "strides", strides)
        object.__setattr__(self, "base", int(self.base))
        if self.base < 0 or any(st < 0 for st in strides):
            raise ValueError(f"mesh base and strides must be >= 0, got base {self.base}, strides {strides}")
        span = 0
        for a in sorted(range(len(shape)), key=lambda a: strides[a]):
            if shape[a] > 1:
                if strides[a] <= span:
                    raise ValueError(f"mesh of shape {shape} with strides {strides} lists a rank twice or does not "
                                     f"decode (each stride must exceed the span of the smaller ones)")
                span += (shape[a] - 1) * strides[a]

    @classmethod
    def of(cls, ranks: np.ndarray | Sequence) -> Mesh:
        """The mesh of an N-d array of rank ids: affine when one fits, else a table."""
        array = np.asarray(ranks, dtype=np.int64)
        if array.ndim == 0 or array.size == 0:
            raise ValueError(f"mesh must be a non-empty N-d array of ranks, got {ranks!r}")
        shape = array.shape
        base = int(array.reshape(-1)[0])
        strides = tuple(int(array[tuple(1 if b == a else 0 for b in range(array.ndim))]) - base if shape[a] > 1 else 0
                        for a in range(array.ndim))
        try:
            mesh = cls(shape, base, strides)
            if np.array_equal(mesh.ranks(np.arange(mesh.size)), array.reshape(-1)):
                return mesh
        except ValueError:
            pass
        return cls(shape, table=tuple(array.reshape(-1).tolist()))

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def shifted(self, delta: int) -> Mesh:
        """The same mesh with every rank ``delta`` lower."""
        if self.table:
            return Mesh(self.shape, table=tuple(r - delta for r in self.table))
        return Mesh(self.shape, self.base - delta, self.strides)

    def shifted_key(self, delta: int) -> tuple:
        """``shifted(delta)`` as a plain tuple (equal exactly when the shifted meshes are), for
        memo keys without building a mesh."""
        if self.table:
            return (self.shape, 0, (), tuple(r - delta for r in self.table))
        return (self.shape, self.base - delta, self.strides, ())

    @property
    def min_rank(self) -> int:
        return min(self.table) if self.table else self.base

    @property
    def max_rank(self) -> int:
        if self.table:
            return max(self.table)
        return self.base + sum((n - 1) * st for n, st in zip(self.shape, self.strides, strict=True))

    def coords(self, positions: np.ndarray) -> np.ndarray:
        """``[P, axes]`` mesh coordinates of row-major ``positions``."""
        return np.stack(np.unravel_index(np.asarray(positions, dtype=np.int64), self.shape), axis=1).astype(np.int64)

    def ranks(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if self.table:
            return np.asarray(self.table, dtype=np.int64)[positions]
        return self.base + self.coords(positions) @ np.asarray(self.strides, dtype=np.int64)

    def positions_of(self, ranks: np.ndarray) -> np.ndarray:
        """Per rank of ``ranks``, its position in this mesh, or -1 where it holds none."""
        ranks = np.asarray(ranks, dtype=np.int64)
        if self.table:
            table = np.asarray(self.table, dtype=np.int64)
            order = np.argsort(table)
            at = np.minimum(np.searchsorted(table[order], ranks), table.size - 1)
            return np.where(table[order][at] == ranks, order[at], -1)
        rest = ranks - self.base
        ok = rest >= 0
        coords = np.zeros((ranks.size, len(self.shape)), dtype=np.int64)
        for a in sorted(range(len(self.shape)), key=lambda a: -self.strides[a]):
            if self.shape[a] == 1:
                continue
            c = rest // self.strides[a]
            ok &= c < self.shape[a]
            coords[:, a] = np.clip(c, 0, self.shape[a] - 1)
            rest = rest - coords[:, a] * self.strides[a]
        ok &= rest == 0
        return np.where(ok, np.ravel_multi_index(tuple(coords.T), self.shape), -1)

    def to_json(self) -> list:
        return [list(self.shape), self.base, list(self.strides), list(self.table)]

    @classmethod
    def from_json(cls, value: list) -> Mesh:
        shape, base, strides, table = value
        return cls(tuple(shape), base, tuple(strides), tuple(table))


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for s in reversed(shape):
        out.append(step)
        step *= s
    return tuple(reversed(out))


@dataclass(frozen=True, slots=True)
class Split:
    """One cut of tensor dim ``dim`` (module docstring): ``kind`` in ``SPLIT_KINDS``, over mesh
    axis ``axis`` (not for ``slice``); ``size`` is the strided split factor, the block size
    or the slice start; ``length`` the slice length."""

    kind: str
    dim: int
    axis: int = -1
    size: int = 0
    length: int = 0

    def __post_init__(self) -> None:
        if self.kind not in SPLIT_KINDS:
            raise ValueError(f"split kind must be one of {SPLIT_KINDS}, got {self.kind!r}")
        for name in ("dim", "axis", "size", "length"):
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.dim < 0:
            raise ValueError(f"split dim must be >= 0, got {self.dim}")
        if (self.kind in _AXIS_KINDS) != (self.axis >= 0):
            raise ValueError(f"a {self.kind} split {'needs' if self.kind in _AXIS_KINDS else 'takes no'} mesh axis, "
                             f"got axis {self.axis}")
        if self.kind in ("strided", "block") and self.size < 1:
            raise ValueError(f"a {self.kind} split needs size >= 1, got {self.size}")
        if self.kind == "slice" and (self.size < 0 or self.length < 0):
            raise ValueError(f"a slice needs start and length >= 0, got {self.size}, {self.length}")

    def to_json(self) -> list:
        return [self.kind, self.dim, self.axis, self.size, self.length]


def _check_splits(what: str, shape: tuple[int, ...], mesh: Mesh, splits: tuple[Split, ...]) -> tuple[Split, ...]:
    splits = tuple(s if isinstance(s, Split) else Split(*s) for s in splits)
    for s in splits:
        if s.dim >= len(shape):
            raise ValueError(f"{what}: split {s.to_json()} is out of range for shape {shape}")
        if s.axis >= len(mesh.shape):
            raise ValueError(f"{what}: split {s.to_json()} names mesh axis {s.axis} of a {len(mesh.shape)}-axis mesh")
    return splits


@dataclass(frozen=True, slots=True)
class BufferRule:
    """Buffer ``name`` on every rank of ``mesh``: the local shape of a virtual ``shape``
    under ``splits`` (no splits: ``shape`` itself on every rank)."""

    name: str
    mesh: Mesh
    shape: tuple[int, ...]
    dtype: str
    splits: tuple[Split, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"buffer name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "shape", _ints(self.shape, f"buffer {self.name!r} shape"))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        object.__setattr__(self, "splits", _check_splits(f"buffer {self.name!r}", self.shape, self.mesh, self.splits))

    def to_json(self) -> list:
        return [self.name, self.mesh.to_json(), list(self.shape), self.dtype, [s.to_json() for s in self.splits]]

    @classmethod
    def from_json(cls, v: list) -> BufferRule:
        return cls(v[0], Mesh.from_json(v[1]), tuple(v[2]), v[3], tuple(Split(*s) for s in v[4]))


@dataclass(frozen=True, slots=True)
class PieceRule:
    """Tensor ``tensor`` cut by ``splits`` over ``mesh``; each position's local shard lives
    in buffer ``buffer`` of its rank, shifted by ``local_start`` along ``local_dim``."""

    tensor: str
    buffer: str
    mesh: Mesh
    splits: tuple[Split, ...] = ()
    local_dim: int = 0
    local_start: int = 0

    def __post_init__(self) -> None:
        splits = tuple(s if isinstance(s, Split) else Split(*s) for s in self.splits)
        object.__setattr__(self, "splits", splits)
        object.__setattr__(self, "local_dim", int(self.local_dim))
        object.__setattr__(self, "local_start", int(self.local_start))
        if self.local_dim < 0 or self.local_start < 0:
            raise ValueError(f"tensor {self.tensor!r}: local dim and start must be >= 0, got "
                             f"{self.local_dim}, {self.local_start}")

    def to_json(self) -> list:
        return [self.tensor, self.buffer, self.mesh.to_json(), [s.to_json() for s in self.splits], self.local_dim,
                self.local_start]

    @classmethod
    def from_json(cls, v: list) -> PieceRule:
        return cls(v[0], v[1], Mesh.from_json(v[2]), tuple(Split(*s) for s in v[3]), v[4], v[5])


def _intervals(shape: tuple[int, ...], mesh: Mesh, splits: tuple[Split, ...], positions: np.ndarray):
    """Per dim, ``(global_start, length, local_start)`` ``[P, m]`` of each position's
    intervals (as ``dtensor.shard_intervals``, for some positions and every split kind)."""
    num = positions.size
    coords = mesh.coords(positions) if num else np.zeros((0, len(mesh.shape)), dtype=np.int64)
    dims = [(np.zeros((num, 1), np.int64), np.full((num, 1), size, np.int64), np.zeros((num, 1), np.int64))
            for size in shape]
    for split in splits:
        g, n, s = dims[split.dim]
        total = n.sum(axis=1, keepdims=True)
        zero = np.zeros_like(total)
        c = coords[:, split.axis: split.axis + 1] if split.axis >= 0 else zero
        k = mesh.shape[split.axis] if split.axis >= 0 else 1
        if split.kind == "chunk":
            ranges = [_chunk(zero, total, k, c)]
        elif split.kind == "strided":
            ranges = []
            for part in range(split.size):
                p_lo, p_hi = _chunk(zero, total, split.size, part)
                ranges.append(_chunk(p_lo, p_hi - p_lo, k, c))
        elif split.kind == "block":
            ranges = [(np.minimum(c * split.size, total), np.minimum((c + 1) * split.size, total))]
        elif split.kind == "balanced":
            base, extra = total // k, total % k
            lo = c * base + np.minimum(c, extra)
            ranges = [(lo, lo + base + (c < extra))]
        else:  # slice
            ranges = [(np.minimum(split.size, total), np.minimum(split.size + split.length, total))]
        new_g, new_n, new_s = [], [], []
        at = zero
        for lo, hi in ranges:
            start = np.maximum(s, lo)
            length = np.clip(np.minimum(s + n, hi) - start, 0, None)
            new_g.append(np.where(length > 0, g + start - s, 0))
            new_n.append(length)
            new_s.append(np.where(length > 0, at + start - lo, 0))
            at = at + (hi - lo)
        new_g, new_n, new_s = (np.concatenate(a, axis=1) for a in (new_g, new_n, new_s))
        dims[split.dim] = _merge_intervals(new_g, new_n, new_s) if len(ranges) > 1 else (new_g, new_n, new_s)
    return dims


def _local_shape(shape, mesh, splits, positions) -> np.ndarray:
    dims = _intervals(shape, mesh, splits, positions)
    return np.stack([n.sum(axis=1) for _, n, _ in dims], axis=1) if dims else np.zeros((positions.size, 0), np.int64)


def _rule_pieces(shape: tuple[int, ...], rule: PieceRule, positions: np.ndarray):
    """``(position index, offsets, lengths, local offsets)`` of the non-empty pieces."""
    dims = _intervals(shape, rule.mesh, rule.splits, positions)
    num, ndim = positions.size, len(shape)
    chunks = []
    for combo in itertools.product(*(range(g.shape[1]) for g, _, _ in dims)):
        off, ln, loff = (np.zeros((num, ndim), np.int64) for _ in range(3))
        for d, i in enumerate(combo):
            g, n, s = dims[d]
            off[:, d], ln[:, d], loff[:, d] = g[:, i], n[:, i], s[:, i]
        keep = np.flatnonzero(np.all(ln > 0, axis=1))
        chunks.append((keep, off[keep], ln[keep], loff[keep]))
    index = np.concatenate([c[0] for c in chunks])
    offsets, lengths, local = (np.concatenate([c[j] for c in chunks]) for j in (1, 2, 3))
    if rule.local_start:
        local[:, rule.local_dim] += rule.local_start
    return index, offsets, lengths, local
