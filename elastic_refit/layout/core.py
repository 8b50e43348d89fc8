"""Logical tensors, local buffers, pieces, layouts and topologies.

A *piece* says "box B of logical tensor T lives in local buffer X of rank r at box B'".
A *layout* holds every piece of one side. Frontier models have hundreds of thousands of
pieces per side, so a layout stores them column-wise in read-only numpy arrays; ``Piece``
and ``Buffer`` are row views for people and tests.

All boxes inside a layout are padded to the layout's ``ndim`` with offset 0 and length 1,
which changes no volume and lets one array hold tensors of different ranks.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from elastic_refit.layout.box import DTYPE_ITEMSIZE, DTYPES, Box, canonical_dtype
from elastic_refit.layout.fingerprint import (
    block_digests,
    combine_fingerprint,
)

__all__ = [
    "Buffer",
    "Layout",
    "LayoutBuilder",
    "LogicalTensor",
    "Piece",
    "Topology",
    "combine_layouts",
    "readonly_column",
]

_DTYPE_INDEX = {name: i for i, name in enumerate(DTYPES)}
_ITEMSIZE_BY_INDEX = np.array([DTYPE_ITEMSIZE[d] for d in DTYPES], dtype=np.int64)


MAX_TENSOR_BYTES = 1 << 62  # byte sizes and offsets must fit int64 columns, with room for sums
MAX_RANKS = 1 << 20  # rank ids of a layout or spec; a topology is allocated per rank


@dataclass(frozen=True, slots=True)
class LogicalTensor:
    """One weight in the canonical (HF) naming, with its global shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tensor name must be a non-empty string, got {self.name!r}")
        shape = tuple(int(s) for s in self.shape)
        if not shape or any(s < 0 for s in shape):
            raise ValueError(f"tensor {self.name!r}: shape must be non-empty and >= 0, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        # Byte offsets and sizes live in int64 columns: a larger tensor would wrap.
        if self.nbytes > MAX_TENSOR_BYTES:
            raise ValueError(f"tensor {self.name!r}: {list(shape)} {self.dtype} is {self.nbytes} bytes, more than "
                             f"the {MAX_TENSOR_BYTES} (2**62) a layout can address")

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, slots=True)
class Buffer:
    """A rank's local buffer (a parameter tensor as the framework stores it)."""

    rank: int
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class Piece:
    """Box ``box`` of logical tensor ``tensor`` lives in ``buffer`` of ``rank`` at ``local_box``."""

    tensor: str
    box: Box
    rank: int
    buffer: str
    local_box: Box


@dataclass(frozen=True, slots=True)
class Topology:
    """Where each rank sits: ``domains[r]`` is the NVLink domain of rank ``r``."""

    domains: tuple[int, ...]
    hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        domains = tuple(int(d) for d in self.domains)
        if not domains:
            raise ValueError("topology needs at least one rank")
        if any(d < 0 for d in domains):
            raise ValueError(f"domain ids must be >= 0, got {sorted(set(domains))[:8]}")
        object.__setattr__(self, "domains", domains)
        hosts = tuple(str(h) for h in self.hosts) or tuple(f"domain-{d}" for d in domains)
        if len(hosts) != len(domains):
            raise ValueError(f"topology has {len(domains)} domains but {len(hosts)} hosts")
        object.__setattr__(self, "hosts", hosts)

    @classmethod
    def uniform(cls, num_ranks: int, domain_size: int) -> Topology:
        """Ranks ``0..num_ranks-1`` packed into domains of ``domain_size`` consecutive ranks."""
        if domain_size < 1:
            raise ValueError(f"domain size must be >= 1, got {domain_size}")
        if num_ranks < 1:
            raise ValueError(f"number of ranks must be >= 1, got {num_ranks}")
        return cls(tuple(r // domain_size for r in range(num_ranks)))

    @property
    def num_ranks(self) -> int:
        return len(self.domains)

    @property
    def num_domains(self) -> int:
        return len(set(self.domains))

    def domain_array(self) -> np.ndarray:
        return np.asarray(self.domains, dtype=np.int64)

    def fingerprint(self) -> str:
        return hashlib.blake2b(repr(self.domains).encode(), digest_size=16).hexdigest()


def readonly_column(array: np.ndarray) -> np.ndarray:
    """``array`` contiguous and frozen (the columns of frozen layouts and plans)."""
    array = np.ascontiguousarray(array)
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class Layout:
    """All pieces of all logical tensors for one side, stored column-wise.

    Build one with ``LayoutBuilder`` (or the DTensor, preset and spec-file constructors);
    the builder validates bounds, dtypes and extents and sorts rows canonically so that
    equal inputs give byte-identical arrays on every process.
    """

    tensors: tuple[LogicalTensor, ...]
    buffer_names: tuple[str, ...]
    buffer_rank: np.ndarray  # int64[B]
    buffer_name: np.ndarray  # int64[B], index into buffer_names
    buffer_shape: np.ndarray  # int64[B, K], padded with 1
    buffer_ndim: np.ndarray  # int64[B]
    buffer_dtype: np.ndarray  # int64[B], index into DTYPES
    piece_tensor: np.ndarray  # int64[P]
    piece_buffer: np.ndarray  # int64[P]
    piece_offsets: np.ndarray  # int64[P, K] global box
    piece_lengths: np.ndarray  # int64[P, K]
    piece_local_offsets: np.ndarray  # int64[P, K] box inside the buffer
    piece_local_lengths: np.ndarray  # int64[P, K]
    # Derived in __post_init__.
    piece_rank: np.ndarray = field(init=False)
    tensor_shape: np.ndarray = field(init=False)
    tensor_itemsize: np.ndarray = field(init=False)
    _tensor_index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        ndim = self.ndim
        for name in ("buffer_rank", "buffer_name", "buffer_shape", "buffer_ndim", "buffer_dtype",
                     "piece_tensor", "piece_buffer", "piece_offsets", "piece_lengths",
                     "piece_local_offsets", "piece_local_lengths"):
            object.__setattr__(self, name, readonly_column(np.asarray(getattr(self, name), dtype=np.int64)))
        shapes = np.ones((len(self.tensors), ndim), dtype=np.int64)
        for i, t in enumerate(self.tensors):
            shapes[i, : len(t.shape)] = t.shape
        object.__setattr__(self, "tensor_shape", readonly_column(shapes))
        object.__setattr__(
            self, "tensor_itemsize",
            readonly_column(np.array([t.itemsize for t in self.tensors], dtype=np.int64)),
        )
        object.__setattr__(self, "piece_rank", readonly_column(self.buffer_rank[self.piece_buffer]))
        object.__setattr__(self, "_tensor_index", {t.name: i for i, t in enumerate(self.tensors)})

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        """Width of the padded box arrays (the largest tensor or buffer rank)."""
        return int(np.asarray(self.piece_offsets).shape[1]) if np.ndim(self.piece_offsets) == 2 else 1

    @property
    def num_pieces(self) -> int:
        return int(self.piece_tensor.shape[0])

    @property
    def num_buffers(self) -> int:
        return int(self.buffer_rank.shape[0])

    @property
    def ranks(self) -> tuple[int, ...]:
        cached = self.__dict__.get("_ranks")
        if cached is None:
            # ranks are small ints: a presence count instead of np.unique's sort
            present = np.bincount(self.buffer_rank) if self.num_buffers else np.zeros(0, dtype=np.int64)
            cached = tuple(np.flatnonzero(present).tolist())
            object.__setattr__(self, "_ranks", cached)
        return cached

    @property
    def fingerprint(self) -> str:
        """Canonical hash of every tensor, buffer and piece (computed on first use): per
        tensor and per buffer name, each shifted to its first rank, so a ``SymbolicLayout``
        of the same pieces hashes alike without listing them (``layout.fingerprint``)."""
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            # Built from rules (SymbolicLayout.to_layout): theirs is equal, and cheaper where the
            # rules stand for many pieces (or have it already).
            rules = self.__dict__.get("_rules")
            if rules is not None and (self.num_pieces > 50_000 or "fingerprint" in rules._memo):
                cached = rules.fingerprint
            else:
                cached = _explicit_fingerprint(self)
            object.__setattr__(self, "_fingerprint", cached)
        return cached

    def tensor_layout_ids(self) -> np.ndarray:
        """Per tensor, the id of its layout (memoised, read-only ``int64[T]``).

        Two tensors get the same id exactly when their shapes, dtypes and (rank, box)
        piece lists are equal, so they are laid out identically up to local buffers. Ids
        number the distinct layouts in the order of their first tensor.
        """
        cached = self.__dict__.get("_layout_ids")
        if cached is None:
            cached = readonly_column(_tensor_layout_ids(self, self.__dict__.get("_layout_ids_hint")))
            object.__setattr__(self, "_layout_ids", cached)
        return cached

    def piece_nbytes(self) -> np.ndarray:
        volume = self.piece_lengths[:, 0].copy()
        for j in range(1, self.ndim):  # one multiply per dim: ~8x faster than np.prod(axis=1)
            volume *= self.piece_lengths[:, j]
        return volume * self.tensor_itemsize[self.piece_tensor]

    @property
    def nbytes(self) -> int:
        """Bytes of all pieces (replicas counted once per replica)."""
        cached = self.__dict__.get("_nbytes")
        if cached is None:
            cached = int(self.piece_nbytes().sum())
            object.__setattr__(self, "_nbytes", cached)
        return cached

    @property
    def model_nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    # ---- lookups ------------------------------------------------------------------------
    def tensor_index(self, name: str) -> int:
        try:
            return self._tensor_index[name]
        except KeyError:
            raise KeyError(f"layout has no tensor named {name!r}") from None

    def tensor(self, name: str) -> LogicalTensor:
        return self.tensors[self.tensor_index(name)]

    def buffer(self, index: int) -> Buffer:
        nd = int(self.buffer_ndim[index])
        return Buffer(
            rank=int(self.buffer_rank[index]),
            name=self.buffer_names[int(self.buffer_name[index])],
            shape=tuple(int(s) for s in self.buffer_shape[index, :nd]),
            dtype=DTYPES[int(self.buffer_dtype[index])],
        )

    def buffers(self, rank: int | None = None) -> list[Buffer]:
        rows = range(self.num_buffers) if rank is None else np.flatnonzero(self.buffer_rank == rank)
        return [self.buffer(int(i)) for i in rows]

    def piece(self, index: int) -> Piece:
        t = self.tensors[int(self.piece_tensor[index])]
        b = int(self.piece_buffer[index])
        nd_b = int(self.buffer_ndim[b])
        nd_t = len(t.shape)
        return Piece(
            tensor=t.name,
            box=Box(tuple(self.piece_offsets[index, :nd_t]), tuple(self.piece_lengths[index, :nd_t])),
            rank=int(self.buffer_rank[b]),
            buffer=self.buffer_names[int(self.buffer_name[b])],
            local_box=Box(
                tuple(self.piece_local_offsets[index, :nd_b]),
                tuple(self.piece_local_lengths[index, :nd_b]),
            ),
        )

    def pieces(self, tensor: str | None = None) -> Iterator[Piece]:
        if tensor is None:
            rows: Iterable[int] = range(self.num_pieces)
        else:
            rows = np.flatnonzero(self.piece_tensor == self.tensor_index(tensor))
        for i in rows:
            yield self.piece(int(i))

    def local_regions(
        self, piece_rows: np.ndarray, offsets: np.ndarray, lengths: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Map global sub-boxes of pieces to boxes inside their local buffers.

        ``offsets``/``lengths`` are ``[N, K]`` global boxes, each inside the global box of
        ``piece_rows[i]``. Extents match the piece's up to size-1 dims: the k-th dim of
        length > 1 of the global box is the k-th dim of length > 1 of the local box.
        """
        piece_rows = np.asarray(piece_rows, dtype=np.int64)
        g_len = self.piece_lengths[piece_rows]
        l_len = self.piece_local_lengths[piece_rows]
        rel = np.asarray(offsets, dtype=np.int64) - self.piece_offsets[piece_rows]
        lengths = np.asarray(lengths, dtype=np.int64)
        local_off = self.piece_local_offsets[piece_rows].copy()
        local_len = np.ones_like(local_off)
        same = np.all(g_len == l_len, axis=1)
        local_off[same] += rel[same]
        local_len[same] = lengths[same]
        other = np.flatnonzero(~same)
        if other.size:
            dim_map = _squeeze_dim_map(g_len[other], l_len[other])
            for j in range(local_off.shape[1]):
                g = dim_map[:, j]
                mapped = g >= 0
                sel = other[mapped]
                local_off[sel, j] += rel[sel, g[mapped]]
                local_len[sel, j] = lengths[sel, g[mapped]]
        return local_off, local_len

    # ---- derived layouts -----------------------------------------------------------------
    def without_ranks(self, ranks: Iterable[int]) -> Layout:
        """The same layout with every buffer and piece of ``ranks`` removed.

        The result copies the kept rows and inherits what this layout memoised and still
        holds for them (per-rank fingerprint digests, tensor layout groups as a hint, ...),
        so hashing and planning it after a membership change costs less than a fresh one.
        """
        mine = np.asarray(self.ranks, dtype=np.int64)
        return self._select_ranks(np.setdiff1d(mine, np.fromiter(ranks, dtype=np.int64)))

    def restrict_to_ranks(self, ranks: Iterable[int]) -> Layout:
        mine = np.asarray(self.ranks, dtype=np.int64)
        return self._select_ranks(np.intersect1d(mine, np.fromiter(ranks, dtype=np.int64)))

    def _select_ranks(self, ranks: np.ndarray) -> Layout:
        """Every buffer and piece of ``ranks`` (a subset of ``self.ranks``), in order."""
        kept_rank = np.zeros(max(self.ranks, default=-1) + 1, dtype=bool)
        kept_rank[ranks] = True
        keep = kept_rank[self.buffer_rank]
        buffers = np.flatnonzero(keep)
        keep_piece = keep[self.piece_buffer]
        pieces = np.flatnonzero(keep_piece)
        new_index = np.cumsum(keep) - 1

        def take(array: np.ndarray, rows: np.ndarray) -> np.ndarray:
            return np.take(array, rows, axis=0)  # ~3x faster than a boolean mask on [N, K]

        derived = Layout(
            tensors=self.tensors,
            buffer_names=self.buffer_names,
            buffer_rank=take(self.buffer_rank, buffers),
            buffer_name=take(self.buffer_name, buffers),
            buffer_shape=take(self.buffer_shape, buffers),
            buffer_ndim=take(self.buffer_ndim, buffers),
            buffer_dtype=take(self.buffer_dtype, buffers),
            piece_tensor=take(self.piece_tensor, pieces),
            piece_buffer=new_index[take(self.piece_buffer, pieces)],
            piece_offsets=take(self.piece_offsets, pieces),
            piece_lengths=take(self.piece_lengths, pieces),
            piece_local_offsets=take(self.piece_local_offsets, pieces),
            piece_local_lengths=take(self.piece_local_lengths, pieces),
        )
        # What survives dropping whole ranks: the tensors and names (the same objects); the
        # kept ranks, which all hold buffers; pieces that did not overlap still do not;
        # tensors laid out identically still are (both lose the same ranks' pieces). The last is a hint only: tensors
        # that differed may now be equal, so tensor_layout_ids compares them again.
        object.__setattr__(derived, "_ranks", tuple(int(r) for r in ranks))
        if self.__dict__.get("_no_overlap"):
            object.__setattr__(derived, "_no_overlap", True)
        nbytes = self.__dict__.get("_nbytes")
        if nbytes is not None:  # less the dropped pieces, which are few
            dropped = np.flatnonzero(~keep_piece)
            dropped_bytes = np.prod(self.piece_lengths[dropped], axis=1) * self.tensor_itemsize[self.piece_tensor[dropped]]
            object.__setattr__(derived, "_nbytes", nbytes - int(dropped_bytes.sum()))
        blocks = self.__dict__.get("_fp_blocks")
        if blocks is not None:  # the fingerprint's blocks of what lost no row carry over
            touched_tensors = np.zeros(len(self.tensors), dtype=bool)
            touched_tensors[self.piece_tensor[~keep_piece]] = True
            touched_names = np.zeros(len(self.buffer_names), dtype=bool)
            touched_names[self.buffer_name[~keep]] = True
            object.__setattr__(derived, "_fp_parent", (*blocks, touched_tensors, touched_names))
        hint = self.__dict__.get("_layout_ids")
        if hint is None:
            hint = self.__dict__.get("_layout_ids_hint")
        if hint is not None:
            object.__setattr__(derived, "_layout_ids_hint", hint)
        return derived

    def describe_ranks(self, rows: np.ndarray, limit: int = 6) -> str:
        ranks = sorted({int(r) for r in self.piece_rank[rows]})
        text = ", ".join(str(r) for r in ranks[:limit])
        return text + (f", ... ({len(ranks)} ranks)" if len(ranks) > limit else "")


def _explicit_fingerprint(layout: Layout) -> str:
    """``Layout.fingerprint`` from the columns (``layout.fingerprint`` module docstring)."""
    num_names = len(layout.buffer_names)
    order: list[tuple[str, np.ndarray]] = []
    if not _increasing(layout.buffer_rank * max(num_names, 1) + layout.buffer_name):
        order += [("buffer_rank", layout.buffer_rank), ("buffer_name", layout.buffer_name)]
    if not _non_decreasing(layout.piece_tensor):
        order.append(("piece_tensor", layout.piece_tensor))
    # Pieces grouped by tensor (layout order kept inside), with the index of their buffer's
    # name among the names the tensor uses.
    by_tensor = slice(None) if not order else np.argsort(layout.piece_tensor, kind="stable")
    tensor = layout.piece_tensor[by_tensor]
    buffer = layout.piece_buffer[by_tensor]
    name = layout.buffer_name[buffer]
    num_tensors, k = len(layout.tensors), layout.ndim
    pair = tensor * max(num_names, 1) + name
    # the (tensor, name) pairs used, sorted: a presence count where the pair space is small
    space = num_tensors * max(num_names, 1)
    pairs = np.flatnonzero(np.bincount(pair, minlength=space)) if space <= 8 * pair.size + 1024 else np.unique(pair)
    name_index = np.searchsorted(pairs, pair) - np.searchsorted(pairs, tensor * max(num_names, 1))
    pair_starts = np.searchsorted(pairs, np.arange(num_tensors + 1) * max(num_names, 1))
    # A layout derived by dropping ranks (_select_ranks) keeps its parent's blocks of the
    # tensors and names that lost nothing: only the others are hashed again.
    parent = layout.__dict__.get("_fp_parent")
    sel = np.arange(tensor.size) if parent is None else np.flatnonzero(parent[2][np.minimum(tensor, num_tensors - 1)])
    starts = np.searchsorted(tensor[sel], np.arange(num_tensors + 1))
    sel = sel[: starts[-1]]  # (ids past the tensors, in a layout assembled by hand, are in no block)
    rank = layout.buffer_rank[buffer[sel]]
    r0 = _group_min(rank, starts)
    rows_of = (np.arange(layout.num_pieces) if isinstance(by_tensor, slice) else by_tensor)[sel]  # by block
    digests = _piece_digests(layout, rows_of, rank - r0[tensor[sel]], name_index[sel], starts, k)
    names_of = (pairs % max(num_names, 1)).tolist()
    tensor_blocks = [(int(r0[t]), tuple(names_of[pair_starts[t]: pair_starts[t + 1]]), digests[t])
                     if parent is None or parent[2][t] else parent[0][t] for t in range(num_tensors)]
    by_name = np.argsort(layout.buffer_name, kind="stable")
    if parent is not None:
        by_name = by_name[parent[3][np.minimum(layout.buffer_name[by_name], num_names - 1)]]
    name_starts = np.searchsorted(layout.buffer_name[by_name], np.arange(num_names + 1))
    by_name = by_name[: name_starts[-1]]
    rank = layout.buffer_rank[by_name]
    b0 = _group_min(rank, name_starts)
    rows = np.empty((rank.size, 3 + layout.buffer_shape.shape[1]), dtype=np.int64)
    rows[:, 0] = rank - b0[layout.buffer_name[by_name]]
    rows[:, 1], rows[:, 2], rows[:, 3:] = layout.buffer_ndim[by_name], layout.buffer_dtype[by_name], \
        layout.buffer_shape[by_name]
    buffer_blocks = [block if parent is None or parent[3][n] else parent[1][n] for n, block in
                     enumerate(zip(b0.tolist(), block_digests("buffers", rows, name_starts), strict=True))]
    object.__setattr__(layout, "_fp_blocks", (tensor_blocks, buffer_blocks))
    return combine_fingerprint(layout.ndim, layout.tensors, layout.buffer_names, tensor_blocks, buffer_blocks, order)


def _piece_digests(layout: Layout, rows_of: np.ndarray, rank: np.ndarray, name_index: np.ndarray,
                   starts: np.ndarray, k: int, chunk: int = 1 << 16) -> list[bytes]:
    """The digest of every tensor's block (``piece_block``'s rows: ``rows_of`` are the layout
    rows of the blocks back to back, ``starts`` where each tensor's begin), built a few
    thousand rows at a time: whole tensors per chunk, so many small tensors cost one pass and
    large ones stay in cache."""
    digests: list[bytes] = []
    columns = (layout.piece_offsets, layout.piece_lengths, layout.piece_local_offsets, layout.piece_local_lengths)
    t, num = 0, starts.size - 1
    while t < num:
        stop = max(int(np.searchsorted(starts, starts[t] + chunk, side="right")) - 1, t + 1)
        stop = min(stop, num)
        a, b = int(starts[t]), int(starts[stop])
        rows = np.empty((b - a, 2 + 4 * k), dtype=np.int64)
        rows[:, 0], rows[:, 1] = rank[a:b], name_index[a:b]
        at = rows_of[a:b]
        for j, column in enumerate(columns):
            rows[:, 2 + j * k: 2 + (j + 1) * k] = column[at]
        digests += block_digests("pieces", rows, starts[t: stop + 1] - a)
        t = stop
    return digests


def _group_min(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The least of each group ``values[starts[g]:starts[g + 1]]`` (0 for an empty group)."""
    out = np.zeros(starts.size - 1, dtype=np.int64)
    full = np.flatnonzero(np.diff(starts) > 0)
    if full.size:
        out[full] = np.minimum.reduceat(values, starts[full])
    return out


def _increasing(values: np.ndarray) -> bool:
    return values.size < 2 or bool(np.all(values[1:] > values[:-1]))


def _non_decreasing(values: np.ndarray) -> bool:
    return values.size < 2 or bool(np.all(values[1:] >= values[:-1]))


# Odd multipliers of the row hash (any fixed odd constants; equality is verified exactly).
_HASH_MULTIPLIERS = tuple(np.uint64(m) for m in (
    0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
    0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x94D049BB133111EB, 0xBF58476D1CE4E5B9,
))


def _row_hashes(columns: Sequence[np.ndarray]) -> np.ndarray:
    """A 64-bit hash of each row of some int64 columns: a wrapping polynomial in odd
    constants, then one multiply-xorshift mix so that sums of row hashes stay non-linear."""
    h = np.zeros(columns[0].shape[0], dtype=np.uint64)
    for j, col in enumerate(columns):
        np.add(h, col.view(np.uint64), out=h)
        np.multiply(h, _HASH_MULTIPLIERS[j % len(_HASH_MULTIPLIERS)], out=h)
    h ^= h >> np.uint64(29)
    h *= _HASH_MULTIPLIERS[-1]
    h ^= h >> np.uint64(32)
    return h


def _tensor_layout_ids(layout: Layout, hint: np.ndarray | None) -> np.ndarray:
    """``Layout.tensor_layout_ids``. ``hint``: ids under which equal ids are known to mean
    equal layouts here (those of a layout this one was derived from by dropping ranks);
    then only the first tensor of each hinted group needs comparing."""
    num_tensors = len(layout.tensors)
    if hint is None:
        leader = _first_equal_tensor(layout, np.arange(num_tensors))
    else:
        _, first, inverse = np.unique(hint, return_index=True, return_inverse=True)
        firsts = np.sort(first)
        leader = np.empty(num_tensors, dtype=np.int64)
        leader[firsts] = _first_equal_tensor(layout, firsts)
        leader = leader[first[inverse]]
    # Number the layouts by first tensor.
    is_first = leader == np.arange(num_tensors)
    return (np.cumsum(is_first) - 1)[leader]


def _first_equal_tensor(layout: Layout, tensors: np.ndarray) -> np.ndarray:
    """For each of ``tensors`` (ascending ids), the first of them with an equal layout.

    Tensors are grouped by a hash of their pieces, then every member is verified against
    the first tensor of its group, so a collision splits a group instead of merging
    different layouts.
    """
    if tensors.size == 0:
        return tensors.copy()
    starts = np.searchsorted(layout.piece_tensor, np.arange(len(layout.tensors) + 1))
    start, count = starts[tensors], starts[tensors + 1] - starts[tensors]
    # rows of the selected tensors, back to back; `local` = their start in that order
    local = np.cumsum(count) - count
    num_rows = int(count.sum())
    if num_rows == layout.num_pieces:
        rows = None
    else:
        rows = np.repeat(start - local, count) + np.arange(num_rows)
    k = layout.ndim
    columns = [layout.piece_rank, layout.piece_offsets, layout.piece_lengths]
    if rows is not None:
        columns = [np.take(c, rows, axis=0) for c in columns]
    flat = [columns[0]] + [columns[1][:, j] for j in range(k)] + [columns[2][:, j] for j in range(k)]
    # Sum of per-row hashes: pieces are sorted canonically, so order rarely matters; when
    # it does, the exact check below catches it.
    tensor_hash = np.zeros(tensors.size, dtype=np.uint64)
    nonempty = np.flatnonzero(count)
    if num_rows:
        tensor_hash[nonempty] = np.add.reduceat(_row_hashes(flat), local[nonempty])
    dtype = np.array([_DTYPE_INDEX[layout.tensors[t].dtype] for t in tensors.tolist()], dtype=np.int64)
    keys = np.column_stack([tensor_hash.view(np.int64), count, dtype, layout.tensor_shape[tensors]])
    _, first, candidate = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    leader = first[candidate.reshape(-1)]  # position (in `tensors`) of the group's first

    # Exact check of every non-leader against its leader.
    check = np.flatnonzero(leader != np.arange(tensors.size))
    if check.size:
        n = int(count[check].sum())
        mine = np.repeat(local[check] - (np.cumsum(count[check]) - count[check]), count[check]) + np.arange(n)
        theirs = mine + np.repeat(local[leader[check]] - local[check], count[check])
        if not all(np.array_equal(np.take(c, mine, axis=0), np.take(c, theirs, axis=0)) for c in columns):
            leader = _split_collisions(columns, local, count, leader)
    return tensors[leader]


def _split_collisions(columns, local, count, leader) -> np.ndarray:
    """Exact regrouping (by content) of the hash groups where some member differs."""
    leader = leader.copy()
    exact: dict[tuple[int, bytes], int] = {}
    for i in range(leader.size):
        a, b = int(local[i]), int(local[i] + count[i])
        content = b"".join(np.ascontiguousarray(c[a:b]).tobytes() for c in columns)
        leader[i] = exact.setdefault((int(leader[i]), content), i)
    return leader


def _canonical_piece_order(p_tensor, p_rank, p_buffer, p_off, p_loff) -> np.ndarray:
    """The builder's row order: (tensor, rank, global box, buffer, local box). Most (tensor,
    rank) pairs hold one piece, so one sort of a packed (tensor, rank) key orders nearly all
    rows; only runs of equal pairs are then sorted by the other columns (the same order as a
    lexsort of every column, at a fraction of its passes)."""
    k = p_off.shape[1]
    primary = p_tensor * (int(p_rank.max(initial=0)) + 1) + p_rank
    order = np.argsort(primary, kind="stable")
    sorted_primary = primary[order]
    same = np.flatnonzero(sorted_primary[1:] == sorted_primary[:-1])
    if same.size:
        tied = np.zeros(order.size, dtype=bool)
        tied[same] = tied[same + 1] = True
        sub = order[tied]  # runs stay in place: sort them by every column, primary first
        order[tied] = sub[np.lexsort(tuple(p_loff[sub, j] for j in reversed(range(k))) + (p_buffer[sub],)
                                     + tuple(p_off[sub, j] for j in reversed(range(k))) + (primary[sub],))]
    return order


def _squeeze_dim_map(g_len: np.ndarray, l_len: np.ndarray) -> np.ndarray:
    """For each local dim, the global dim it corresponds to (-1 for size-1 local dims)."""
    g_big = g_len > 1
    l_big = l_len > 1
    g_ord = np.cumsum(g_big, axis=1) - 1
    l_ord = np.cumsum(l_big, axis=1) - 1
    n, k = l_len.shape
    dim_map = np.full((n, k), -1, dtype=np.int64)
    for j in range(k):
        # global dim whose ordinal among the >1 dims equals this local dim's ordinal
        match = g_big & (g_ord == l_ord[:, j : j + 1])
        has = l_big[:, j] & match.any(axis=1)
        dim_map[has, j] = np.argmax(match[has], axis=1)
    return dim_map


def _pad_columns(a: np.ndarray, k: int, fill: int) -> np.ndarray:
    """``a`` widened to ``k`` columns, the new ones set to ``fill``."""
    if a.shape[1] == k:
        return a
    out = np.full((a.shape[0], k), fill, dtype=np.int64)
    out[:, : a.shape[1]] = a
    return out


def _canonical_buffer_order(b_rank: np.ndarray, b_name: np.ndarray,
                            buffer_names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Buffers sorted by (rank, name): the order and the old-id -> new-id map. A (rank, name)
    declared twice is a ``ValueError``."""
    b_order = np.lexsort((b_name, b_rank))
    sorted_keys = np.stack([b_rank[b_order], b_name[b_order]], axis=1)
    dup = np.flatnonzero(np.all(sorted_keys[1:] == sorted_keys[:-1], axis=1)) if b_rank.size > 1 else []
    if len(dup):
        r, nm = sorted_keys[dup[0]]
        raise ValueError(f"buffer {buffer_names[int(nm)]!r} declared twice on rank {int(r)}")
    b_new = np.empty_like(b_order)
    b_new[b_order] = np.arange(b_order.size)
    return b_order, b_new


class LayoutBuilder:
    """Accumulates tensors, buffers and pieces (vectorised) and validates them in ``build``."""

    def __init__(self, ndim: int | None = None) -> None:
        self._ndim = ndim
        self._tensors: list[LogicalTensor] = []
        self._tensor_index: dict[str, int] = {}
        self._buffer_names: list[str] = []
        self._buffer_name_index: dict[str, int] = {}
        self._buffer_chunks: list[tuple[np.ndarray, int, np.ndarray, int, int]] = []
        self._num_buffers = 0
        self._piece_chunks: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]] = []

    # ---- declarations --------------------------------------------------------------------
    def tensor(self, name: str, shape: Sequence[int], dtype: object) -> int:
        """Declare a logical tensor (idempotent for identical declarations); returns its id."""
        t = LogicalTensor(name, tuple(shape), dtype)  # type: ignore[arg-type]
        existing = self._tensor_index.get(name)
        if existing is not None:
            if self._tensors[existing] != t:
                old = self._tensors[existing]
                raise ValueError(
                    f"tensor {name!r} declared twice with different shape/dtype: "
                    f"{old.shape} {old.dtype} vs {t.shape} {t.dtype}"
                )
            return existing
        self._tensor_index[name] = len(self._tensors)
        self._tensors.append(t)
        return len(self._tensors) - 1

    def buffers(self, name: str, ranks: Sequence[int] | np.ndarray, shape: Sequence[int] | np.ndarray,
                dtype: object) -> np.ndarray:
        """Declare buffer ``name`` on each of ``ranks``; ``shape`` is one shape or one per rank.

        Returns the buffer ids, in the order of ``ranks``.
        """
        ranks_arr = np.asarray(ranks, dtype=np.int64).reshape(-1)
        shape_arr = np.asarray(shape, dtype=np.int64)
        if shape_arr.ndim == 1:
            shape_arr = np.broadcast_to(shape_arr, (ranks_arr.size, shape_arr.size))
        if shape_arr.shape[0] != ranks_arr.size:
            raise ValueError(f"buffer {name!r}: {shape_arr.shape[0]} shapes for {ranks_arr.size} ranks")
        if (shape_arr < 0).any() or (ranks_arr < 0).any():
            raise ValueError(f"buffer {name!r}: ranks and shapes must be >= 0")
        name_id = self._buffer_name_index.setdefault(name, len(self._buffer_names))
        if name_id == len(self._buffer_names):
            self._buffer_names.append(name)
        ids = np.arange(self._num_buffers, self._num_buffers + ranks_arr.size, dtype=np.int64)
        self._num_buffers += ranks_arr.size
        self._buffer_chunks.append(
            (ranks_arr, name_id, np.array(shape_arr), shape_arr.shape[1], _DTYPE_INDEX[canonical_dtype(dtype)])
        )
        return ids

    def pieces(self, tensor: int | str, buffer_ids: np.ndarray | Sequence[int],
               offsets: np.ndarray | Sequence[Sequence[int]], lengths: np.ndarray | Sequence[Sequence[int]],
               local_offsets: np.ndarray | Sequence[Sequence[int]],
               local_lengths: np.ndarray | Sequence[Sequence[int]] | None = None) -> None:
        """Add pieces of one tensor: row i maps global box i into buffer ``buffer_ids[i]``.

        ``local_lengths`` defaults to ``lengths`` (same rank, same extents).
        """
        if isinstance(tensor, str):
            if tensor not in self._tensor_index:
                raise ValueError(f"tensor {tensor!r} is not declared; call tensor() first")
            t = self._tensor_index[tensor]
        else:
            t = int(tensor)
        if not 0 <= t < len(self._tensors):
            raise ValueError(f"unknown tensor id {tensor!r}")
        ids = np.asarray(buffer_ids, dtype=np.int64).reshape(-1)
        off = np.atleast_2d(np.asarray(offsets, dtype=np.int64))
        ln = np.atleast_2d(np.asarray(lengths, dtype=np.int64))
        loff = np.atleast_2d(np.asarray(local_offsets, dtype=np.int64))
        lln = None if local_lengths is None else np.atleast_2d(np.asarray(local_lengths, dtype=np.int64))
        n = ids.size
        for what, arr in (("offsets", off), ("lengths", ln), ("local offsets", loff)) + (
            (("local lengths", lln),) if lln is not None else ()
        ):
            if arr.shape[0] != n:
                raise ValueError(
                    f"tensor {self._tensors[t].name!r}: {arr.shape[0]} {what} for {n} pieces"
                )
        if lln is None and loff.shape[1] != ln.shape[1]:
            raise ValueError(
                f"tensor {self._tensors[t].name!r}: local boxes of rank {loff.shape[1]} need "
                f"explicit local lengths (global rank {ln.shape[1]})"
            )
        self._piece_chunks.append((t, ids, off, ln, loff, lln))

    def piece(self, tensor: int | str, buffer_id: int, box: Box, local_box: Box) -> None:
        """Add one piece (convenience for hand-written layouts)."""
        self.pieces(tensor, [buffer_id], [box.offsets], [box.lengths], [local_box.offsets],
                    [local_box.lengths])

    # ---- build ---------------------------------------------------------------------------
    def build(self) -> Layout:
        """Validate and freeze; rows are sorted canonically (tensors and buffer names by name, so
        declaration order does not matter); empty pieces are dropped."""
        k = self._common_rank()
        tensors, tensor_new, buffer_names, name_new = self._canonical_names()
        b_rank, b_name, b_shape, b_ndim, b_dtype = self._buffer_rows(k, name_new)
        b_order, b_new = _canonical_buffer_order(b_rank, b_name, buffer_names)
        p_tensor, p_buffer, p_off, p_len, p_loff, p_llen = self._piece_rows(k, tensor_new)

        if p_buffer.size and ((p_buffer < 0) | (p_buffer >= self._num_buffers)).any():
            raise ValueError("piece refers to an unknown buffer id")
        p_buffer = b_new[p_buffer] if p_buffer.size else p_buffer
        b_rank, b_name, b_shape = b_rank[b_order], b_name[b_order], b_shape[b_order]
        b_ndim, b_dtype = b_ndim[b_order], b_dtype[b_order]

        t_shape = np.ones((len(tensors), k), dtype=np.int64)
        for i, t in enumerate(tensors):
            t_shape[i, : len(t.shape)] = t.shape
        self._validate(tensors, buffer_names, p_tensor, p_buffer, p_off, p_len, p_loff, p_llen, t_shape,
                       b_rank, b_name, b_shape, b_dtype)

        nonempty = np.all(p_len > 0, axis=1)
        p_tensor, p_buffer = p_tensor[nonempty], p_buffer[nonempty]
        p_off, p_len, p_loff, p_llen = p_off[nonempty], p_len[nonempty], p_loff[nonempty], p_llen[nonempty]
        order = _canonical_piece_order(p_tensor, b_rank[p_buffer], p_buffer, p_off, p_loff)
        return Layout(
            tensors=tensors,
            buffer_names=buffer_names,
            buffer_rank=b_rank,
            buffer_name=b_name,
            buffer_shape=b_shape,
            buffer_ndim=b_ndim,
            buffer_dtype=b_dtype,
            piece_tensor=p_tensor[order],
            piece_buffer=p_buffer[order],
            piece_offsets=p_off[order],
            piece_lengths=p_len[order],
            piece_local_offsets=p_loff[order],
            piece_local_lengths=p_llen[order],
        )

    def _common_rank(self) -> int:
        """The one box rank every row is padded to: the largest of tensors, buffers and ``ndim``."""
        return max(
            [self._ndim or 1]
            + [len(t.shape) for t in self._tensors]
            + [c[3] for c in self._buffer_chunks]
        )

    def _canonical_names(self) -> tuple[tuple[LogicalTensor, ...], np.ndarray, tuple[str, ...], np.ndarray]:
        """Tensors and buffer names sorted by name, each with its old-id -> new-id map."""
        # Canonical order, whatever the declaration order: two ranks (or two sides) that declare
        # one layout differently agree on its rows and fingerprint.
        tensor_order = sorted(range(len(self._tensors)), key=lambda i: self._tensors[i].name)
        tensors = tuple(self._tensors[i] for i in tensor_order)
        tensor_new = np.empty(len(tensor_order), dtype=np.int64)
        tensor_new[tensor_order] = np.arange(len(tensor_order))
        name_order = sorted(range(len(self._buffer_names)), key=lambda i: self._buffer_names[i])
        buffer_names = tuple(self._buffer_names[i] for i in name_order)
        name_new = np.empty(len(name_order), dtype=np.int64)
        name_new[name_order] = np.arange(len(name_order))
        return tensors, tensor_new, buffer_names, name_new

    def _buffer_rows(self, k: int, name_new: np.ndarray) -> tuple[np.ndarray, ...]:
        """The declared buffers as (rank, name, shape, ndim, dtype) columns, in declaration order."""
        chunks = self._buffer_chunks
        if not chunks:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, np.zeros((0, k), dtype=np.int64), empty, empty
        b_rank = np.concatenate([c[0] for c in chunks])
        b_name = np.concatenate([np.full(c[0].size, name_new[c[1]], dtype=np.int64) for c in chunks])
        b_shape = np.concatenate([_pad_columns(c[2], k, 1) for c in chunks])
        b_ndim = np.concatenate([np.full(c[0].size, c[3], dtype=np.int64) for c in chunks])
        b_dtype = np.concatenate([np.full(c[0].size, c[4], dtype=np.int64) for c in chunks])
        return b_rank, b_name, b_shape, b_ndim, b_dtype

    def _piece_rows(self, k: int, tensor_new: np.ndarray) -> tuple[np.ndarray, ...]:
        """The added pieces as (tensor, buffer, offsets, lengths, local offsets, local lengths)
        columns, in the order they were added; buffers keep their declaration ids."""
        chunks = self._piece_chunks
        if not chunks:
            empty, boxes = np.zeros(0, dtype=np.int64), np.zeros((0, k), dtype=np.int64)
            return empty, empty, boxes, boxes, boxes, boxes
        p_tensor = np.concatenate([np.full(c[1].size, tensor_new[c[0]], dtype=np.int64) for c in chunks])
        p_buffer = np.concatenate([c[1] for c in chunks])
        p_off = np.concatenate([_pad_columns(c[2], k, 0) for c in chunks])
        p_len = np.concatenate([_pad_columns(c[3], k, 1) for c in chunks])
        p_loff = np.concatenate([_pad_columns(c[4], k, 0) for c in chunks])
        p_llen = np.concatenate([_pad_columns(c[5] if c[5] is not None else c[3], k, 1) for c in chunks])
        return p_tensor, p_buffer, p_off, p_len, p_loff, p_llen

    @staticmethod
    def _validate(tensors, names, p_tensor, p_buffer, p_off, p_len, p_loff, p_llen, t_shape, b_rank, b_name,
                  b_shape, b_dtype) -> None:

        def where(row: int) -> str:
            t = tensors[int(p_tensor[row])]
            b = int(p_buffer[row])
            return f"tensor {t.name!r} on rank {int(b_rank[b])} (buffer {names[int(b_name[b])]!r})"

        if p_tensor.size == 0:
            return
        bad = np.flatnonzero((p_off < 0).any(axis=1) | (p_len < 0).any(axis=1))
        if bad.size:
            raise ValueError(f"{where(bad[0])}: negative box {p_off[bad[0]].tolist()}+{p_len[bad[0]].tolist()}")
        bad = np.flatnonzero((p_off + p_len > t_shape[p_tensor]).any(axis=1))
        if bad.size:
            i = bad[0]
            t = tensors[int(p_tensor[i])]
            nd = len(t.shape)
            raise ValueError(
                f"{where(i)}: box {Box(tuple(p_off[i, :nd]), tuple(p_len[i, :nd]))} is out of "
                f"bounds of shape {t.shape}"
            )
        bad = np.flatnonzero((p_loff < 0).any(axis=1) | (p_loff + p_llen > b_shape[p_buffer]).any(axis=1))
        if bad.size:
            i = bad[0]
            raise ValueError(
                f"{where(i)}: local box {p_loff[i].tolist()}+{p_llen[i].tolist()} is out of bounds "
                f"of buffer shape {b_shape[p_buffer[i]].tolist()}"
            )
        t_dtype = np.array([_DTYPE_INDEX[t.dtype] for t in tensors], dtype=np.int64)
        bad = np.flatnonzero(t_dtype[p_tensor] != b_dtype[p_buffer])
        if bad.size:
            i = bad[0]
            raise ValueError(
                f"{where(i)}: tensor dtype {tensors[int(p_tensor[i])].dtype} differs from "
                f"buffer dtype {DTYPES[int(b_dtype[p_buffer[i]])]}"
            )
        differ = np.flatnonzero(~np.all(p_len == p_llen, axis=1))
        if differ.size:
            g = np.where(p_len[differ] > 1, p_len[differ], 0)
            lc = np.where(p_llen[differ] > 1, p_llen[differ], 0)
            # Compare the sequences of extents > 1 (push zeros to the back, keep order).
            g_sorted = np.take_along_axis(g, np.argsort(g == 0, axis=1, kind="stable"), axis=1)
            l_sorted = np.take_along_axis(lc, np.argsort(lc == 0, axis=1, kind="stable"), axis=1)
            bad = differ[~np.all(g_sorted == l_sorted, axis=1)]
            if bad.size:
                i = bad[0]
                raise ValueError(
                    f"{where(i)}: global extents {p_len[i].tolist()} and local extents "
                    f"{p_llen[i].tolist()} differ beyond size-1 dims"
                )


def combine_layouts(parts: Sequence[tuple[Layout, Mapping[int, int]]]) -> Layout:
    """One layout from the buffers of several layouts, with ranks renamed.

    Each part is ``(layout, rank_map)``: the buffers of ranks in ``rank_map`` are kept and
    moved to ``rank_map[rank]``. Tensors are matched by name (shapes and dtypes must
    agree). The runtime uses this to plan over survivors: the training layout of live
    trainers plus the pieces of inference ranks that already hold a version, on the ranks
    of the current communicator.
    """
    b = LayoutBuilder()
    for layout, rank_map in parts:
        # Tensors are declared even for an empty part, so an empty side reads as "nothing
        # covers tensor X" rather than "unknown tensor X".
        tensor_ids = np.array([b.tensor(t.name, t.shape, t.dtype) for t in layout.tensors], dtype=np.int64)
        if not rank_map:
            continue
        lookup = np.full(int(max(layout.buffer_rank.max(initial=0), max(rank_map))) + 1, -1, dtype=np.int64)
        for old, new in rank_map.items():
            if old < lookup.size:
                lookup[old] = new
        new_rank = lookup[layout.buffer_rank]
        keep = new_rank >= 0
        new_id = np.full(layout.num_buffers, -1, dtype=np.int64)
        groups = np.column_stack([layout.buffer_name, layout.buffer_ndim, layout.buffer_dtype])
        for name_id, nd, dtype in np.unique(groups[keep], axis=0).tolist():
            rows = np.flatnonzero(keep & (layout.buffer_name == name_id) & (layout.buffer_ndim == nd)
                                  & (layout.buffer_dtype == dtype))
            new_id[rows] = b.buffers(layout.buffer_names[name_id], new_rank[rows],
                                     layout.buffer_shape[rows, :nd], DTYPES[dtype])
        kept_pieces = np.flatnonzero(keep[layout.piece_buffer])
        for t in np.unique(layout.piece_tensor[kept_pieces]).tolist():
            rows = kept_pieces[layout.piece_tensor[kept_pieces] == t]
            nd = len(layout.tensors[t].shape)
            b.pieces(int(tensor_ids[t]), new_id[layout.piece_buffer[rows]], layout.piece_offsets[rows, :nd],
                     layout.piece_lengths[rows, :nd], layout.piece_local_offsets[rows],
                     layout.piece_local_lengths[rows])
    return b.build()
