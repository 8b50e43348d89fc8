"""Destination dtypes: a destination that holds a tensor in another dtype than its source.

A trainer may keep FP32 weights where its inference engines hold BF16. Each side's layout
declares the dtype it holds (its ``LogicalTensor.dtype`` and its buffers'); where the two
differ for a tensor, the refit casts it on the way: the sender casts in its pack, exactly as
``tensor.to(dtype)`` would (torch's round-to-nearest-even), and the bytes on the wire are
the destination's. Casts are between floating dtypes (float64, float32, bfloat16, float16,
float8_e4m3fn, float8_e5m2); an integer or bool tensor must match exactly.

``source_casts`` finds the casts two layouts need (pure, by name), ``cast_layout`` is the
source layout as it travels (the same pieces, every cast tensor and its buffers in the
destination dtype): the planner plans on it, so every figure is in the destination's bytes,
and keeps the layout as given (``SourceCast.logical_source``) for the senders, whose buffers
are in the source dtype. A source buffer holding tensors cast to different dtypes is refused.

Plain data here (the layout layer imports no torch); the cast itself is the pack kernel's
(``elastic_refit.kernels.PackProgram(..., packed_dtypes=...)``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from elastic_refit.layout.box import DTYPES
from elastic_refit.layout.core import Layout, LogicalTensor, readonly_column

__all__ = ["CAST_DTYPES", "SourceCast", "cast_layout", "check_cast", "source_casts"]

CAST_DTYPES = ("float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
_DTYPE_INDEX = {d: i for i, d in enumerate(DTYPES)}


def check_cast(tensor: str, source_dtype: str, destination_dtype: str) -> None:
    """``ValueError`` naming ``tensor`` unless a refit can cast it from ``source_dtype`` to
    ``destination_dtype`` (equal dtypes, or both floating)."""
    if source_dtype == destination_dtype:
        return
    if source_dtype not in CAST_DTYPES or destination_dtype not in CAST_DTYPES:
        raise ValueError(f"tensor {tensor!r}: source is {source_dtype}, destination is {destination_dtype}; a refit "
                         f"casts between floating dtypes only ({', '.join(CAST_DTYPES)})")


def source_casts(source: Layout, destination: Layout) -> dict[str, tuple[str, str]]:
    """``{tensor: (source dtype, destination dtype)}`` for every tensor both layouts name in
    different dtypes (``{}``: none); ``ValueError`` for a pair no refit casts."""
    casts: dict[str, tuple[str, str]] = {}
    for t in destination.tensors:
        try:
            theirs = source.tensor(t.name)
        except KeyError:
            continue  # the planner names tensors one side lacks
        if theirs.dtype != t.dtype and theirs.shape == t.shape:  # the planner names other shapes
            try:
                check_cast(t.name, theirs.dtype, t.dtype)
            except ValueError:
                raise ValueError(f"tensor {t.name!r}: source is {list(theirs.shape)} {theirs.dtype}, destination is "
                                 f"{list(t.shape)} {t.dtype}; a refit casts between floating dtypes only "
                                 f"({', '.join(CAST_DTYPES)})") from None
            casts[t.name] = (theirs.dtype, t.dtype)
    return casts


def cast_layout(layout: Layout, dtypes: Mapping[str, str]) -> Layout:
    """``layout`` with each tensor ``name`` in ``dtypes`` (and every buffer holding its pieces)
    in ``dtypes[name]``; the pieces are unchanged. ``ValueError`` for a buffer holding tensors
    that would end up in different dtypes (a buffer has one dtype)."""
    if not dtypes:
        return layout
    tensors = tuple(LogicalTensor(t.name, t.shape, dtypes.get(t.name, t.dtype)) for t in layout.tensors)
    tensor_dtype = np.array([_DTYPE_INDEX[t.dtype] for t in tensors], dtype=np.int64)
    buffer_dtype = np.array(layout.buffer_dtype, dtype=np.int64)
    if layout.num_pieces:
        want = tensor_dtype[layout.piece_tensor]
        order = np.lexsort((want, layout.piece_buffer))
        sb, sw = layout.piece_buffer[order], want[order]
        mixed = np.flatnonzero((sb[1:] == sb[:-1]) & (sw[1:] != sw[:-1]))
        if mixed.size:
            b = int(sb[mixed[0]])
            names = [tensors[int(layout.piece_tensor[p])] for p in order[[mixed[0], mixed[0] + 1]]]
            raise ValueError(f"buffer {layout.buffer_names[int(layout.buffer_name[b])]!r} on rank "
                             f"{int(layout.buffer_rank[b])} holds {names[0].name!r} and {names[1].name!r}, which the "
                             f"destination holds as {names[0].dtype} and {names[1].dtype}: a buffer is cast whole")
        buffer_dtype[sb] = sw
    return Layout(
        tensors=tensors, buffer_names=layout.buffer_names, buffer_rank=layout.buffer_rank,
        buffer_name=layout.buffer_name, buffer_shape=layout.buffer_shape, buffer_ndim=layout.buffer_ndim,
        buffer_dtype=readonly_column(buffer_dtype), piece_tensor=layout.piece_tensor,
        piece_buffer=layout.piece_buffer, piece_offsets=layout.piece_offsets, piece_lengths=layout.piece_lengths,
        piece_local_offsets=layout.piece_local_offsets, piece_local_lengths=layout.piece_local_lengths,
    )


@dataclass(frozen=True, eq=False)
class SourceCast:
    """What a plan with casts adds: the source layout as the caller gave it (its buffers in
    the source dtypes, what senders read) and the casts, ``(tensor, source dtype,
    destination dtype)`` sorted by tensor. The plan's ``source`` is ``cast_layout`` of it."""

    logical_source: Layout
    casts: tuple[tuple[str, str, str], ...]

    def __post_init__(self) -> None:
        if not self.casts:
            raise ValueError("a SourceCast needs at least one cast")
        for name, src, dst in self.casts:
            check_cast(name, src, dst)
        object.__setattr__(self, "casts", tuple(sorted(self.casts)))

    @classmethod
    def between(cls, source: Layout, destination: Layout) -> SourceCast | None:
        """The casts from ``source`` to ``destination``, or None when every dtype matches."""
        casts = source_casts(source, destination)
        if not casts:
            return None
        return cls(source, tuple((n, s, d) for n, (s, d) in casts.items()))

    @property
    def dtypes(self) -> dict[str, str]:
        """``{tensor: destination dtype}``."""
        return {name: dst for name, _, dst in self.casts}

    @property
    def fingerprint(self) -> str:
        """A stable hash of the casts (plans fold it into theirs: a plan that casts differs
        from one whose source already holds the destination dtype)."""
        text = ";".join(f"{n}:{s}>{d}" for n, s, d in self.casts)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def describe(self) -> str:
        """``"3 tensor(s) float32 -> bfloat16"`` per pair of dtypes."""
        pairs: dict[tuple[str, str], int] = {}
        for _, src, dst in self.casts:
            pairs[(src, dst)] = pairs.get((src, dst), 0) + 1
        return ", ".join(f"{n} tensor(s) {s} -> {d}" for (s, d), n in sorted(pairs.items()))
