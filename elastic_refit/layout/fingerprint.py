"""The canonical layout fingerprint: per tensor and per buffer name, shifted to its first rank.

A layout's fingerprint must be the same however the layout was built: from explicit pieces
(``LayoutBuilder``, a decoded ``ERL1``, a DTensor or preset constructor) or from rules
(``SymbolicLayout``), so that ranks that hold it in either form agree on plans. A hash of
every rank's rows (the scheme before) costs a symbolic layout all its ranks' pieces; this
one is made of blocks that a rule gives whole:

* per logical tensor, its pieces in layout order (canonical: by rank, global box, buffer,
  local box) with the rank less the tensor's first rank ``r0``, the buffer as the index of
  its name among the names this tensor's pieces use, and both boxes at the layout's width;
* per buffer name, its buffers in rank order with the rank less the name's first rank;
* on top: the width, the tensors, the buffer names, each tensor's ``r0`` and names, each
  name's ``r0``, the block digests, and (only for layouts not in canonical row order) the
  order of the rows, since plans address pieces by row.

Every block is hashed in the narrowest integer dtype that holds its values, so the bytes
depend only on the values. Layers of a model laid out alike on other ranks (pipeline
stages) give equal blocks: a symbolic layout hashes each distinct one once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from elastic_refit.layout.digest import dtype_for_range, update_int_arrays

__all__ = ["FINGERPRINT_SCHEME", "block_digest", "block_digests", "buffer_block", "combine_fingerprint",
           "piece_block"]

FINGERPRINT_SCHEME = "erl-fp2"


def piece_block(rank: np.ndarray, name_index: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
                local_offsets: np.ndarray, local_lengths: np.ndarray) -> tuple[int, np.ndarray]:
    """``(r0, rows)``: one tensor's pieces (in layout order) as the matrix its digest reads."""
    r0 = int(rank.min()) if rank.size else 0
    rows = np.empty((rank.size, 2 + 4 * offsets.shape[1]), dtype=np.int64)
    rows[:, 0] = rank - r0
    rows[:, 1] = name_index
    k = offsets.shape[1]
    for j, column in enumerate((offsets, lengths, local_offsets, local_lengths)):
        rows[:, 2 + j * k: 2 + (j + 1) * k] = column
    return r0, rows


def buffer_block(rank: np.ndarray, ndim: np.ndarray, dtype: np.ndarray, shape: np.ndarray) -> tuple[int, np.ndarray]:
    """``(r0, rows)``: one buffer name's buffers (in rank order) as the matrix its digest reads."""
    r0 = int(rank.min()) if rank.size else 0
    rows = np.empty((rank.size, 3 + shape.shape[1]), dtype=np.int64)
    rows[:, 0], rows[:, 1], rows[:, 2] = rank - r0, ndim, dtype
    rows[:, 3:] = shape
    return r0, rows


def block_digest(kind: str, rows: np.ndarray) -> bytes:
    """sha256 of a block in the narrowest dtype of its own values."""
    dtype = dtype_for_range(int(rows.min()), int(rows.max())) if rows.size else np.dtype("<u1")
    digest = hashlib.sha256(f"{kind}:{dtype.str}:{rows.shape};".encode())
    digest.update(np.ascontiguousarray(rows, dtype=dtype))
    return digest.digest()


_WIDTHS = tuple(np.dtype(f"<{kind}{size}") for kind in "ui" for size in (1, 2, 4, 8))


def block_digests(kind: str, rows: np.ndarray, starts: np.ndarray) -> list[bytes]:
    """``block_digest(kind, rows[starts[g]:starts[g + 1]])`` of every group ``g`` of consecutive
    rows, at a fraction of the per-block cost: each group's dtype from per-group minima and
    maxima in one pass, the rows cast once per dtype used, then one hash per group."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    num, width = starts.size - 1, rows.shape[1]
    counts = np.diff(starts)
    lo = np.zeros(num, dtype=np.int64)
    hi = np.zeros(num, dtype=np.int64)
    full = np.flatnonzero(counts > 0)
    if full.size:
        flat_lo, flat_hi = rows[:, 0].copy(), rows[:, 0].copy()
        for j in range(1, width):  # column by column: far faster than min(axis=1) on narrow rows
            np.minimum(flat_lo, rows[:, j], out=flat_lo)
            np.maximum(flat_hi, rows[:, j], out=flat_hi)
        lo[full] = np.minimum.reduceat(flat_lo, starts[full])
        hi[full] = np.maximum.reduceat(flat_hi, starts[full])
    # the first of _WIDTHS (unsigned first, narrowest first) that holds lo..hi, as dtype_for_range
    fits = np.stack([(lo >= np.iinfo(d).min) & (hi <= np.iinfo(d).max) & ((lo >= 0) | (d.kind == "i"))
                     & ((lo < 0) | (d.kind == "u")) for d in _WIDTHS], axis=1)
    choice = np.argmax(fits, axis=1)
    choice[counts == 0] = 0  # an empty block hashes as uint8
    cast = {int(c): rows.astype(_WIDTHS[c]) for c in np.unique(choice).tolist()}
    out = []
    for a, b, c in zip(starts[:-1].tolist(), starts[1:].tolist(), choice.tolist(), strict=True):
        digest = hashlib.sha256(f"{kind}:{_WIDTHS[c].str}:{(b - a, width)};".encode())
        digest.update(cast[c][a:b])
        out.append(digest.digest())
    return out


def combine_fingerprint(ndim: int, tensors: Sequence, buffer_names: Sequence[str],
                        tensor_blocks: Sequence[tuple[int, tuple[int, ...], bytes]],
                        buffer_blocks: Sequence[tuple[int, bytes]], order: Sequence[tuple[str, np.ndarray]] = ()) -> str:
    """The fingerprint from its parts (module docstring): ``tensor_blocks[t]`` is ``(r0, name
    ids, digest)``, ``buffer_blocks[n]`` is ``(r0, digest)``; ``order`` names the row-order
    columns of a layout whose rows are not in canonical order (empty otherwise)."""
    digest = hashlib.sha256(f"{FINGERPRINT_SCHEME};ndim={ndim};".encode())
    digest.update(repr([(t.name, t.shape, t.dtype) for t in tensors]).encode())
    digest.update(repr(tuple(buffer_names)).encode())
    digest.update(repr([(r0, names) for r0, names, _ in tensor_blocks]).encode())
    digest.update(repr([r0 for r0, _ in buffer_blocks]).encode())
    digest.update(b"".join(d for _, _, d in tensor_blocks))
    digest.update(b"".join(d for _, d in buffer_blocks))
    if order:
        digest.update(b"order;")
        update_int_arrays(digest, order)
    return digest.hexdigest()[:32]
