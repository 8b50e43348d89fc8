"""Symbolic layouts: a tensor's placement over a mesh kept as a rule, not as pieces.

A ``Layout`` lists one piece per tensor per rank that holds it; a frontier model on 65,536
GPUs is millions of pieces, and every rank would build (and read from etcd) all of them. A
``SymbolicLayout`` keeps, per tensor, *rules*: a mesh of ranks (an affine map from mesh
coordinates to ranks, or a rank table where no affine map fits) and the splits that cut the
tensor over the mesh's axes, as DTensor placements do. Its size is O(tensors), whatever
the number of ranks; what no rule describes stays explicit (``SymbolicLayout.explicit``).

Splits (``Split``), each applied in order to the current local extent of one tensor dim,
at every mesh position (``torch.distributed.tensor`` semantics for the first two):

* ``chunk`` over a mesh axis: ``Shard(dim)``, ``torch.chunk`` (chunks of ``ceil(n / k)``);
* ``strided`` over a mesh axis: ``_StridedShard(dim, split_factor=size)``;
* ``block`` over a mesh axis: position ``c`` keeps ``[c * size, (c + 1) * size)`` clipped
  (vocab padded to a multiple, then split evenly: the last shards hold padding);
* ``balanced`` over a mesh axis: the first ``n % k`` positions keep one more (vLLM's
  linear expert map);
* ``slice``: keep ``[size, size + length)`` (no mesh axis; fused QKV's kv groups).

A ``PieceRule`` places the resulting local shard in buffer ``buffer`` of each position's
rank, shifted by ``local_start`` along ``local_dim`` (fused QKV, gate/up, stacked experts).
A ``BufferRule`` declares the buffer: its local shape is that of a virtual tensor of
``shape`` under its own splits. ``SymbolicLayout.layout_of_ranks`` derives the explicit
pieces of some ranks only (what one rank needs), ``to_layout`` all of them; both equal
what the explicit constructors build, row for row, and ``fingerprint`` equals the explicit
layout's (``layout.fingerprint``) while hashing each distinct rule once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from elastic_refit.layout.box import DTYPES
from elastic_refit.layout.core import (
    _DTYPE_INDEX,
    Layout,
    LayoutBuilder,
    LogicalTensor,
    _canonical_piece_order,
)
from elastic_refit.layout.symbolic_digest import symbolic_fingerprint, symbolic_layout_ids
from elastic_refit.layout.symbolic_rules import (
    SPLIT_KINDS,
    BufferRule,
    Mesh,
    PieceRule,
    Split,
    _check_splits,
    _local_shape,
    _rule_pieces,
)

__all__ = ["SPLIT_KINDS", "BufferRule", "Mesh", "PieceRule", "Split", "SymbolicLayout", "rules_of"]

@dataclass(frozen=True, eq=False)
class SymbolicLayout:
    """All pieces of one side as rules (module docstring): O(tensors), whatever the ranks.

    ``tensors`` are sorted by name; ``explicit`` holds pieces (and buffers) no rule
    describes, with every tensor of the layout declared. Build one with ``SymbolicBuilder``
    (``layout.symbolic_presets``, ``SymbolicBuilder.sharded_tensor``) or ``decode_symbolic``.
    """

    tensors: tuple[LogicalTensor, ...]
    buffers: tuple[BufferRule, ...]
    rules: tuple[PieceRule, ...]
    explicit: Layout | None = None
    _memo: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if names != sorted(set(names)):
            raise ValueError("symbolic layout tensors must be sorted by name and distinct")
        index = {t.name: t for t in self.tensors}
        for rule in self.rules:
            if rule.tensor not in index:
                raise ValueError(f"rule for unknown tensor {rule.tensor!r}")
            shape = index[rule.tensor].shape
            _check_splits(f"tensor {rule.tensor!r}", shape, rule.mesh, rule.splits)
            if rule.local_dim >= len(shape):
                raise ValueError(f"tensor {rule.tensor!r}: local dim {rule.local_dim} is out of range for {shape}")
        if self.explicit is not None and self.explicit.tensors != self.tensors:
            raise ValueError("the explicit part of a symbolic layout must declare the same tensors")
        seen: dict[str, BufferRule] = {}
        for b in self.buffers:
            if b.name in seen and seen[b.name].dtype != b.dtype:
                raise ValueError(f"buffer {b.name!r} declared with dtypes {seen[b.name].dtype} and {b.dtype}")
            seen[b.name] = b

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def buffer_names(self) -> tuple[str, ...]:
        names = {b.name for b in self.buffers} | set(self.explicit.buffer_names if self.explicit else ())
        return tuple(sorted(names))

    @property
    def ndim(self) -> int:
        widths = [1] + [len(t.shape) for t in self.tensors] + [len(b.shape) for b in self.buffers]
        return max(widths + ([self.explicit.ndim] if self.explicit is not None else []))

    @property
    def num_positions(self) -> int:
        """Pieces and buffers the rules stand for, at most (positions summed over rules)."""
        return sum(r.mesh.size for r in self.rules) + sum(b.mesh.size for b in self.buffers)

    # ---- explicit pieces -------------------------------------------------------------------
    def to_layout(self) -> Layout:
        """Every piece, explicit (what the explicit constructors build, row for row). The
        layout keeps these rules (``rules_of``): a member that holds it publishes the rules
        (``ERL3``), and its fingerprint is theirs (equal, hashed from the distinct rules)."""
        layout = self._build(None)
        object.__setattr__(layout, "_rules", self)
        return layout

    def layout_of_ranks(self, ranks: Sequence[int] | np.ndarray) -> Layout:
        """The pieces and buffers of ``ranks`` only (``to_layout().restrict_to_ranks(ranks)``,
        row for row, with the same tensors and buffer names), at a cost in proportion to the
        rules and the ranks asked for."""
        return self._build(np.unique(np.asarray(ranks, dtype=np.int64).reshape(-1)))

    def layout_of_tensor_ranks(self, ranks_of: Mapping[str, np.ndarray]) -> Layout:
        """The pieces of each tensor ``t`` on the ranks ``ranks_of[t]`` only (None: all its ranks;
        none for a tensor not named), and the buffers those pieces lie in; every tensor and buffer name is
        declared. Rows in layout order, as ``to_layout()`` has them (what a per-rank planner
        needs of a side: some tensors on some ranks). Layouts with explicit pieces: ``ValueError``."""
        if self.explicit is not None:
            raise ValueError("layout_of_tensor_ranks needs a layout of rules only (this one has explicit pieces)")
        distinct: dict[bytes, np.ndarray] = {}  # equal sets as one array: decoded once per mesh
        sets = {}
        for name, r in ranks_of.items():
            if r is not None:
                r = np.unique(np.asarray(r, dtype=np.int64).reshape(-1))
                r = distinct.setdefault(r.tobytes(), r)
            sets[name] = r
        by_buffer: dict[str, list] = {}
        for rule in self.rules:
            if rule.tensor in sets:
                by_buffer.setdefault(rule.buffer, []).append(sets[rule.tensor])
        buffer_sets = {}
        for name, parts in by_buffer.items():
            union = None if any(p is None for p in parts) else np.unique(np.concatenate(parts))
            buffer_sets[name] = union if union is None else distinct.setdefault(union.tobytes(), union)
        empty = np.zeros(0, dtype=np.int64)
        return self._build(None, lambda rule: sets.get(rule.tensor, empty),
                           lambda rule: buffer_sets.get(rule.name, empty))

    def piece_table(self, ranks_of: Mapping[str, np.ndarray | None]) -> Layout:
        """The pieces ``layout_of_tensor_ranks(ranks_of)`` has, in its row order, each in a
        buffer row of its own (its rank, its buffer's name, the piece's local extent): what a
        planner reads of a side (ranks, boxes, order), at a fraction of the cost of real
        buffers; not a layout to write into (a name may repeat on a rank)."""
        if self.explicit is not None:
            raise ValueError("piece_table needs a layout of rules only (this one has explicit pieces)")
        k, names = self.ndim, self.buffer_names
        name_id = {n: i for i, n in enumerate(names)}
        index = {t.name: i for i, t in enumerate(self.tensors)}
        distinct: dict[bytes, np.ndarray] = {}
        memo: dict = {}
        parts = []
        for rule in self.rules:
            if rule.tensor not in ranks_of:
                continue
            ranks = ranks_of[rule.tensor]
            if ranks is not None:
                ranks = np.unique(np.asarray(ranks, dtype=np.int64).reshape(-1))
                ranks = distinct.setdefault(ranks.tobytes(), ranks)
            shape = self.tensors[index[rule.tensor]].shape
            key = (shape, rule.mesh, rule.splits, rule.local_dim, rule.local_start, id(ranks))
            if key not in memo:
                positions = self._positions(rule.mesh, ranks, memo)
                at, off, ln, loff = _rule_pieces(shape, rule, positions)
                memo[key] = (rule.mesh.ranks(positions[at]), _pad(off, k, 0), _pad(ln, k, 1), _pad(loff, k, 0))
            rank, off, ln, loff = memo[key]
            parts.append((rank, np.full(rank.size, index[rule.tensor]), np.full(rank.size, name_id[rule.buffer]),
                          off, ln, loff))
        if parts:
            rank, tensor, name = (np.concatenate([p[j] for p in parts]) for j in range(3))
            off, ln, loff = (np.concatenate([p[j] for p in parts]) for j in range(3, 6))
        else:
            rank = tensor = name = np.zeros(0, dtype=np.int64)
            off = ln = loff = np.zeros((0, k), dtype=np.int64)
        order = _canonical_piece_order(tensor, rank, name, off, loff)
        dtype = np.array([DTYPES.index(t.dtype) for t in self.tensors], dtype=np.int64)
        return Layout(tensors=self.tensors, buffer_names=names, buffer_rank=rank[order], buffer_name=name[order],
                      buffer_shape=ln[order], buffer_ndim=np.full(order.size, k), buffer_dtype=dtype[tensor[order]],
                      piece_tensor=tensor[order], piece_buffer=np.arange(order.size), piece_offsets=off[order],
                      piece_lengths=ln[order], piece_local_offsets=loff[order], piece_local_lengths=ln[order])

    @property
    def tensor_layout_ids(self) -> np.ndarray:
        """``to_layout().tensor_layout_ids()`` from the rules (each distinct rule, shifted to
        its first rank, enumerated once). Layouts with explicit pieces: ``ValueError``."""
        cached = self._memo.get("layout_ids")
        if cached is None:
            if self.explicit is not None:
                raise ValueError("tensor_layout_ids of a symbolic layout needs rules only (this one has explicit "
                                 "pieces): use to_layout().tensor_layout_ids()")
            self.fingerprint  # noqa: B018 - fills the per-tensor boxes
            cached = self._memo["layout_ids"] = symbolic_layout_ids(self.ndim, self.tensors, self._memo["boxes"])
        return cached

    def _positions(self, mesh: Mesh, ranks: np.ndarray | None, cache: dict | None = None) -> np.ndarray:
        if ranks is None:
            return np.arange(mesh.size, dtype=np.int64)
        key = (mesh, id(ranks))
        hit = None if cache is None else cache.get(key)
        if hit is None:  # layers repeat a few meshes: decode each once
            found = mesh.positions_of(ranks)
            hit = np.sort(found[found >= 0])
            if cache is not None:
                cache[key] = (hit, ranks)  # keeps ranks alive, so its id stays its own
            return hit
        return hit[0]

    def _build(self, ranks: np.ndarray | None, rule_ranks=None, buffer_ranks=None) -> Layout:
        """Pieces and buffers of ``ranks`` (None: all), or of ``rule_ranks(rule)`` per piece
        rule and ``buffer_ranks(rule)`` per buffer rule where those are given."""
        rule_ranks = rule_ranks or (lambda rule: ranks)
        buffer_ranks = buffer_ranks or (lambda rule: ranks)
        k = self.ndim
        rows = _Rows(self.buffer_names)
        ids: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        meshes: dict = {}
        shapes_of: dict = {}  # (shape, mesh, splits) -> (ranks, local shapes): layers repeat them
        for rule in self.buffers:
            rank_set = buffer_ranks(rule)
            key = (rule.shape, rule.mesh, rule.splits, id(rank_set))
            if key not in shapes_of:
                positions = self._positions(rule.mesh, rank_set, meshes)
                shapes_of[key] = (rule.mesh.ranks(positions),
                                  _local_shape(rule.shape, rule.mesh, rule.splits, positions))
            rank, local_shape = shapes_of[key]
            got = rows.buffers(rule.name, rank, local_shape, rule.dtype)
            prev = ids.get(rule.name)
            ids[rule.name] = (rank, got) if prev is None else (np.concatenate([prev[0], rank]),
                                                               np.concatenate([prev[1], got]))
        lookup = {name: (rank[np.argsort(rank)], got[np.argsort(rank)]) for name, (rank, got) in ids.items()}
        index = {t.name: i for i, t in enumerate(self.tensors)}
        pieces_of: dict = {}
        for rule in self.rules:
            rank_set = rule_ranks(rule)
            shape = self.tensors[index[rule.tensor]].shape
            key = (shape, rule.mesh, rule.splits, rule.local_dim, rule.local_start, id(rank_set))
            if key not in pieces_of:
                positions = self._positions(rule.mesh, rank_set, meshes)
                at, offsets, lengths, local = _rule_pieces(shape, rule, positions)
                # padded to the layout's width once per distinct rule
                pieces_of[key] = (rule.mesh.ranks(positions[at]), _pad(offsets, k, 0), _pad(lengths, k, 1),
                                  _pad(local, k, 0))
            rank, offsets, lengths, local = pieces_of[key]
            rows.pieces(index[rule.tensor], _buffer_ids(lookup, rule, rank), offsets, lengths, local)
        if self.explicit is None:
            return rows.layout(self.tensors, k)
        b = rows.builder(self.tensors, k)
        for name in self.buffer_names:  # names only the explicit part declares
            if name not in ids:
                b.buffers(name, np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64), _buffer_dtype(self, name))
        _add_explicit(b, self.explicit if ranks is None else self.explicit.restrict_to_ranks(ranks.tolist()))
        return b.build()

    # ---- fingerprint ---------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """``to_layout().fingerprint``, hashing each distinct rule (up to its first rank) once."""
        cached = self._memo.get("fingerprint")
        if cached is None:
            cached = self._memo["fingerprint"] = symbolic_fingerprint(
                self.ndim, self.buffer_names, self.tensors, self.buffers, self.rules, self.explicit,
                self._memo.setdefault("blocks", {}), self._memo.setdefault("boxes", []))
        return cached


def _buffer_dtype(layout: SymbolicLayout, name: str) -> str:
    for rule in layout.buffers:
        if rule.name == name:
            return rule.dtype
    ex = layout.explicit  # a name only the explicit part declares (it has a buffer row)
    assert ex is not None
    rows = np.flatnonzero(ex.buffer_name == ex.buffer_names.index(name))
    return DTYPES[int(ex.buffer_dtype[rows[0]])] if rows.size else "uint8"  # no rows: the dtype is moot


def _buffer_ids(lookup, rule: PieceRule, rank: np.ndarray) -> np.ndarray:
    if rule.buffer not in lookup:
        raise ValueError(f"tensor {rule.tensor!r}: no rule declares buffer {rule.buffer!r}")
    ranks, ids = lookup[rule.buffer]
    at = np.minimum(np.searchsorted(ranks, rank), max(ranks.size - 1, 0))
    missing = (ranks.size == 0) | (ranks[at] != rank) if rank.size else np.zeros(0, dtype=bool)
    if np.any(missing):
        r = int(rank[np.flatnonzero(missing)[0]])
        raise ValueError(f"tensor {rule.tensor!r}: buffer {rule.buffer!r} is not declared on rank {r}")
    return ids[at]


def _add_explicit(b: LayoutBuilder, layout: Layout) -> None:
    """Declare ``layout``'s buffers and pieces in ``b`` (its tensors are declared already)."""
    new_id = np.full(layout.num_buffers, -1, dtype=np.int64)
    groups = np.column_stack([layout.buffer_name, layout.buffer_ndim, layout.buffer_dtype])
    for name_id, nd, dtype in (np.unique(groups, axis=0).tolist() if layout.num_buffers else []):
        rows = np.flatnonzero((layout.buffer_name == name_id) & (layout.buffer_ndim == nd)
                              & (layout.buffer_dtype == dtype))
        new_id[rows] = b.buffers(layout.buffer_names[name_id], layout.buffer_rank[rows],
                                 layout.buffer_shape[rows, :nd], DTYPES[dtype])
    for t in np.unique(layout.piece_tensor).tolist():
        rows = np.flatnonzero(layout.piece_tensor == t)
        b.pieces(layout.tensors[t].name, new_id[layout.piece_buffer[rows]], layout.piece_offsets[rows],
                 layout.piece_lengths[rows], layout.piece_local_offsets[rows], layout.piece_local_lengths[rows])


def _pad(array: np.ndarray, k: int, fill: int) -> np.ndarray:
    if array.shape[1] == k:
        return array
    out = np.full((array.shape[0], k), fill, dtype=np.int64)
    out[:, : array.shape[1]] = array
    return out


def rules_of(layout: Layout) -> SymbolicLayout | None:
    """The rules an explicit layout was built from (``SymbolicLayout.to_layout``), else None
    (a layout built piece by piece, or derived from one: ``without_ranks`` drops them)."""
    return layout.__dict__.get("_rules")


class _Rows:
    """Buffers and pieces of rules, gathered as ``LayoutBuilder`` gathers them (``buffers``
    returns ids in declaration order) and assembled into the layout ``LayoutBuilder.build``
    makes of them (the same validation, row order and errors), without its per-call chunks:
    a model's rules are a thousand calls. Tensors (sorted by name) and the sorted buffer
    names are the symbolic layout's."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.name_id = {n: i for i, n in enumerate(names)}
        self.buffer_parts: list[tuple] = []
        self.piece_parts: list[tuple] = []
        self.num_buffers = 0

    def buffers(self, name: str, ranks: np.ndarray, shape: np.ndarray, dtype: str) -> np.ndarray:
        ids = np.arange(self.num_buffers, self.num_buffers + ranks.size, dtype=np.int64)
        self.num_buffers += ranks.size
        self.buffer_parts.append((name, ranks, shape, dtype))
        return ids

    def pieces(self, tensor: int, buffer_ids: np.ndarray, offsets, lengths, local) -> None:
        self.piece_parts.append((tensor, buffer_ids, offsets, lengths, local))

    def builder(self, tensors, k: int) -> LayoutBuilder:
        """A ``LayoutBuilder`` holding the rows gathered (where more rows follow: an explicit part)."""
        b = LayoutBuilder(k)
        for t in tensors:
            b.tensor(t.name, t.shape, t.dtype)
        for name, ranks, shape, dtype in self.buffer_parts:
            b.buffers(name, ranks, shape, dtype)
        for tensor, ids, offsets, lengths, local in self.piece_parts:
            b.pieces(tensor, ids, offsets, lengths, local)
        return b

    def layout(self, tensors, k: int) -> Layout:
        def column(parts, j, pad_with=None):
            if pad_with is not None:
                return np.concatenate([_pad(p[j], k, pad_with) for p in parts])
            return np.concatenate([p[j] for p in parts])

        sizes = np.array([p[1].size for p in self.buffer_parts], dtype=np.int64)
        if self.buffer_parts:
            b_rank = column(self.buffer_parts, 1)
            b_name = np.repeat([self.name_id[p[0]] for p in self.buffer_parts], sizes).astype(np.int64)
            b_shape = column(self.buffer_parts, 2, 1)
            b_ndim = np.repeat([p[2].shape[1] for p in self.buffer_parts], sizes).astype(np.int64)
            b_dtype = np.repeat([_DTYPE_INDEX[p[3]] for p in self.buffer_parts], sizes).astype(np.int64)
        else:
            b_rank = b_name = b_ndim = b_dtype = np.zeros(0, dtype=np.int64)
            b_shape = np.zeros((0, k), dtype=np.int64)
        key = b_rank * max(len(self.names), 1) + b_name  # canonical buffer order: (rank, name)
        b_order = np.argsort(key, kind="stable")
        dup = np.flatnonzero(key[b_order][1:] == key[b_order][:-1])
        if dup.size:
            at = b_order[dup[0]]
            raise ValueError(f"buffer {self.names[int(b_name[at])]!r} declared twice on rank {int(b_rank[at])}")
        b_new = np.empty_like(b_order)
        b_new[b_order] = np.arange(b_order.size)
        b_rank, b_name, b_shape, b_ndim, b_dtype = (a[b_order] for a in (b_rank, b_name, b_shape, b_ndim, b_dtype))
        counts = np.array([p[1].size for p in self.piece_parts], dtype=np.int64)
        if self.piece_parts:
            p_tensor = np.repeat([p[0] for p in self.piece_parts], counts).astype(np.int64)
            p_buffer = b_new[column(self.piece_parts, 1)]
            p_off, p_len, p_loff = (column(self.piece_parts, j) for j in (2, 3, 4))
        else:
            p_tensor = p_buffer = np.zeros(0, dtype=np.int64)
            p_off = p_len = p_loff = np.zeros((0, k), dtype=np.int64)
        t_shape = np.ones((len(tensors), k), dtype=np.int64)
        for i, t in enumerate(tensors):
            t_shape[i, : len(t.shape)] = t.shape
        LayoutBuilder._validate(tensors, self.names, p_tensor, p_buffer, p_off, p_len, p_loff, p_len, t_shape,
                                b_rank, b_name, b_shape, b_dtype)
        keep = np.flatnonzero(np.all(p_len > 0, axis=1))  # rules make no empty piece; the builder drops them
        if keep.size < p_tensor.size:
            p_tensor, p_buffer, p_off, p_len, p_loff = (a[keep] for a in (p_tensor, p_buffer, p_off, p_len, p_loff))
        order = _canonical_piece_order(p_tensor, b_rank[p_buffer], p_buffer, p_off, p_loff)
        return Layout(tensors=tensors, buffer_names=self.names, buffer_rank=b_rank, buffer_name=b_name,
                      buffer_shape=b_shape, buffer_ndim=b_ndim, buffer_dtype=b_dtype, piece_tensor=p_tensor[order],
                      piece_buffer=p_buffer[order], piece_offsets=p_off[order], piece_lengths=p_len[order],
                      piece_local_offsets=p_loff[order], piece_local_lengths=p_len[order])
