"""``SymbolicLayout.fingerprint``: the explicit layout's fingerprint, from the rules.

The fingerprint (``layout.fingerprint``) is made of one block per tensor and one per
buffer name, each with ranks counted from its own first rank. A tensor's block follows from
its rules shifted to their first rank, and models repeat a few of those over all their
layers and pipeline stages, so each distinct one is enumerated (all its positions) once
and its digest reused: the cost is the distinct rules times their positions, not the
layout's pieces.
"""

from __future__ import annotations

import numpy as np

from elastic_refit.layout.box import DTYPES
from elastic_refit.layout.core import Layout, LogicalTensor
from elastic_refit.layout.fingerprint import (
    block_digest,
    buffer_block,
    combine_fingerprint,
    piece_block,
)
from elastic_refit.layout.symbolic_rules import BufferRule, PieceRule, _local_shape, _rule_pieces

__all__ = ["symbolic_fingerprint", "symbolic_layout_ids"]

_DTYPE_INDEX = {name: i for i, name in enumerate(DTYPES)}


def symbolic_fingerprint(k: int, names: tuple[str, ...], tensors: tuple[LogicalTensor, ...],
                         buffers: tuple[BufferRule, ...], rules: tuple[PieceRule, ...], explicit: Layout | None,
                         memo: dict, boxes: list | None = None) -> str:
    """The fingerprint a symbolic layout's ``to_layout()`` has (``layout.fingerprint``
    scheme), from its parts: ``k`` dims, buffer ``names``, ``tensors``, buffer and piece
    rules, the ``explicit`` part; ``memo`` keeps each distinct rule's block. ``boxes`` (a
    layout of rules only) receives per tensor what ``symbolic_layout_ids`` compares: its
    first rank, its number of pieces and a digest of its (rank, box) rows in layout order."""
    name_id = {n: i for i, n in enumerate(names)}
    explicit_tensors = set()
    if explicit is not None and explicit.num_pieces:
        explicit_tensors = {explicit.tensors[t].name for t in np.unique(explicit.piece_tensor).tolist()}
    by_tensor: dict[str, list[PieceRule]] = {}
    for rule in rules:
        by_tensor.setdefault(rule.tensor, []).append(rule)
    tensor_blocks = []
    for t in tensors:
        tensor_rules = by_tensor.get(t.name, [])
        if t.name in explicit_tensors:
            tensor_blocks.append(_explicit_tensor_block(explicit, t, tensor_rules, k, name_id))
            continue
        candidates = sorted({r.buffer for r in tensor_rules})
        shift = min((r.mesh.min_rank for r in tensor_rules), default=0)
        # the rules up to their tensor, buffer names (by index among the tensor's) and first rank
        key = ("t", t.shape, k, tuple((candidates.index(r.buffer), r.mesh.shifted_key(shift), r.splits, r.local_dim,
                                       r.local_start) for r in tensor_rules))
        hit = memo.get(key)
        if hit is None:
            rows = [_enumerate(t.shape, PieceRule("", "", r.mesh.shifted(shift), r.splits, r.local_dim, r.local_start),
                               k, candidates.index(r.buffer)) for r in tensor_rules]
            hit = memo[key] = _tensor_block(rows, k)
        r0, used, digest, box_digest = hit
        if boxes is not None:
            boxes.append((r0 + shift, box_digest))
        tensor_blocks.append((r0 + shift if used else r0, tuple(name_id[candidates[c]] for c in used), digest))
    buffer_blocks = []
    by_name: dict[str, list[BufferRule]] = {}
    for b in buffers:
        by_name.setdefault(b.name, []).append(b)
    for name in names:
        named = by_name.get(name, [])
        if explicit is not None and name in explicit.buffer_names and np.any(
                explicit.buffer_name == explicit.buffer_names.index(name)):
            buffer_blocks.append(_buffer_block_of(named, k, explicit, name))
            continue
        shift = min((r.mesh.min_rank for r in named), default=0)
        key = ("b", k, tuple((r.mesh.shifted_key(shift), r.shape, r.dtype, r.splits) for r in named))
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = _buffer_block_of([BufferRule("b", r.mesh.shifted(shift), r.shape, r.dtype, r.splits)
                                                for r in named], k)
        r0, digest = hit
        buffer_blocks.append((r0 + shift if named else r0, digest))
    return combine_fingerprint(k, tensors, names, tensor_blocks, buffer_blocks)


def _enumerate(shape, rule: PieceRule, k: int, candidate: int):
    """Rows ``(rank, candidate, offsets, lengths, local offsets)`` of every piece of ``rule``."""
    positions = np.arange(rule.mesh.size, dtype=np.int64)
    index, offsets, lengths, local = _rule_pieces(shape, rule, positions)
    rank = rule.mesh.ranks(positions[index])
    return rank, np.full(rank.size, candidate, dtype=np.int64), _pad(offsets, k, 0), _pad(lengths, k, 1), \
        _pad(local, k, 0)


def _pad(array: np.ndarray, k: int, fill: int) -> np.ndarray:
    out = np.full((array.shape[0], k), fill, dtype=np.int64)
    out[:, : array.shape[1]] = array
    return out


def _tensor_block(parts, k: int):
    """``(r0, used candidates, digest)`` of a tensor's pieces given as enumerated parts."""
    if parts:
        rank, cand, off, ln, loff = (np.concatenate([p[j] for p in parts]) for j in range(5))
    else:
        rank = cand = np.zeros(0, dtype=np.int64)
        off = ln = loff = np.zeros((0, k), dtype=np.int64)
    used = np.unique(cand)
    local_name = np.searchsorted(used, cand)
    # The builder's row order inside a tensor: rank, global box, buffer, local box.
    order = np.lexsort(tuple(loff[:, j] for j in reversed(range(k))) + (local_name,)
                       + tuple(off[:, j] for j in reversed(range(k))) + (rank,))
    r0, rows = piece_block(rank[order], local_name[order], off[order], ln[order], loff[order], ln[order])
    # (rank, box) in layout order, as Layout.tensor_layout_ids compares tensors
    box_rows = np.concatenate([rows[:, :1], rows[:, 2: 2 + 2 * k]], axis=1)
    return r0, tuple(used.tolist()), block_digest("pieces", rows), (rows.shape[0], block_digest("boxes", box_rows))


def _explicit_tensor_block(explicit: Layout, t, rules, k: int, name_id: dict[str, int]):
    """A tensor with explicit pieces too: every piece enumerated (no memo)."""
    names = sorted({r.buffer for r in rules}
                   | {explicit.buffer_names[int(n)] for n in
                      explicit.buffer_name[explicit.piece_buffer[explicit.piece_tensor == explicit.tensor_index(t.name)]]})
    parts = [_enumerate(t.shape, r, k, names.index(r.buffer)) for r in rules]
    rows = np.flatnonzero(explicit.piece_tensor == explicit.tensor_index(t.name))
    buf = explicit.piece_buffer[rows]
    cand = np.array([names.index(explicit.buffer_names[int(n)]) for n in explicit.buffer_name[buf]], dtype=np.int64)
    parts.append((explicit.buffer_rank[buf], cand, _pad(explicit.piece_offsets[rows], k, 0),
                  _pad(explicit.piece_lengths[rows], k, 1), _pad(explicit.piece_local_offsets[rows], k, 0)))
    llen = _pad(explicit.piece_local_lengths[rows], k, 1)
    if not np.array_equal(llen, parts[-1][3]):
        return _tensor_block_local(parts, llen, k, names, name_id)
    r0, used, digest, _ = _tensor_block(parts, k)
    return r0, tuple(name_id[names[c]] for c in used), digest


def _tensor_block_local(parts, explicit_llen, k, names, name_id):
    """``_tensor_block`` where explicit pieces have local extents of their own."""
    rank, cand, off, ln, loff = (np.concatenate([p[j] for p in parts]) for j in range(5))
    llen = np.concatenate([p[3] for p in parts[:-1]] + [explicit_llen])
    used = np.unique(cand)
    local_name = np.searchsorted(used, cand)
    order = np.lexsort(tuple(loff[:, j] for j in reversed(range(k))) + (local_name,)
                       + tuple(off[:, j] for j in reversed(range(k))) + (rank,))
    r0, rows = piece_block(rank[order], local_name[order], off[order], ln[order], loff[order], llen[order])
    return r0, tuple(name_id[names[c]] for c in used.tolist()), block_digest("pieces", rows)


def _buffer_block_of(rules, k: int, explicit=None, name: str | None = None):
    """``(r0, digest)`` of one buffer name's buffers (rules, plus an explicit part's)."""
    ranks, ndims, dtypes, shapes = [], [], [], []
    for r in rules:
        positions = np.arange(r.mesh.size, dtype=np.int64)
        ranks.append(r.mesh.ranks(positions))
        ndims.append(np.full(positions.size, len(r.shape), dtype=np.int64))
        dtypes.append(np.full(positions.size, _DTYPE_INDEX[r.dtype], dtype=np.int64))
        shapes.append(_pad(_local_shape(r.shape, r.mesh, r.splits, positions), k, 1))
    if explicit is not None:
        rows = np.flatnonzero(explicit.buffer_name == explicit.buffer_names.index(name))
        ranks.append(explicit.buffer_rank[rows])
        ndims.append(explicit.buffer_ndim[rows])
        dtypes.append(explicit.buffer_dtype[rows])
        shapes.append(_pad(explicit.buffer_shape[rows], k, 1))
    if not ranks:
        r0, block = buffer_block(*(np.zeros(0, dtype=np.int64),) * 3, np.zeros((0, k), dtype=np.int64))
        return r0, block_digest("buffers", block)
    rank = np.concatenate(ranks)
    order = np.argsort(rank, kind="stable")
    r0, block = buffer_block(rank[order], np.concatenate(ndims)[order], np.concatenate(dtypes)[order],
                             np.concatenate(shapes)[order])
    return r0, block_digest("buffers", block)



def symbolic_layout_ids(k: int, tensors: tuple[LogicalTensor, ...], boxes: list) -> np.ndarray:
    """``Layout.tensor_layout_ids`` of the layout the rules stand for, from ``boxes`` (what
    ``symbolic_fingerprint`` gives per tensor): equal ids exactly when shapes, dtypes and
    (rank, box) rows in layout order agree, numbered by first tensor. As the explicit ids,
    shapes are compared at the layout's width ``k`` (padded with 1), so ``(n,)`` and
    ``(n, 1)`` laid out alike share an id."""
    ids: dict[tuple, int] = {}
    out = np.empty(len(tensors), dtype=np.int64)
    for i, (t, (r0, digest)) in enumerate(zip(tensors, boxes, strict=True)):
        padded = tuple(t.shape) + (1,) * (k - len(t.shape))
        out[i] = ids.setdefault((padded, t.dtype, r0 if digest[0] else 0, digest), len(ids))
    return out
