"""Triton source of the segmented digest (private; ``kernels.digests`` launches it).

Loaded by ``kernels._triton_backend.load_source`` twice, like ``_triton_copy.py``: compiled
for CUDA and as a separate interpreted module for CPU tests.

``segment_digest_kernel``: program ``p`` reads tile ``p`` of the tile table, one row of
three int64 (the box's first byte in ``data``, the tile's first word within the box, the
box's byte count), and writes the tile's two partial sums of the digest
(``transport.buffers.digest``): ``sum x_w`` and ``sum w * x_w`` over its ``WORDS`` words,
``w`` the word's index within its box, the box's last word zero-padded past its end (mod
2**64, as int64 arithmetic wraps). ``ALIGNED``: every box starts on an 8-byte address, so
words are loaded whole; otherwise bytes are loaded and assembled (any packed offset).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.standard import _sum_combine

__all__ = ["segment_digest_kernel"]

if globals().get("_KERNELS_INTERPRET", False):
    from triton.runtime.interpreter import InterpretedFunction as _jit
else:
    _jit = triton.jit


@_jit
def _sum(x, axis: tl.constexpr):
    """``tl.sum`` without the standard library's jit wrapper (see ``_triton_delta._sum``)."""
    return tl.reduce(x, axis, _sum_combine)


@_jit
def segment_digest_kernel(data_ptr, tiles_ptr, partial_ptr, WORDS: tl.constexpr, ALIGNED: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    start = tl.load(tiles_ptr + 3 * p)
    word0 = tl.load(tiles_ptr + 3 * p + 1)
    nbytes = tl.load(tiles_ptr + 3 * p + 2)
    w = word0 + tl.arange(0, WORDS).to(tl.int64)
    left = nbytes - w * 8  # the box's bytes from word w on
    if ALIGNED:
        words = (data_ptr + start).to(tl.pointer_type(tl.int64), bitcast=True)
        x = tl.load(words + w, mask=left > 0, other=0)
        # The last word keeps only the box's bytes (the staging after them is another box's).
        shift = tl.minimum(tl.maximum(left, 1), 8) * 8
        keep = tl.where(left >= 8, -1, (tl.full(left.shape, 1, tl.int64) << (shift % 64)) - 1)
        x = x & keep
    else:
        b = tl.arange(0, 8).to(tl.int64)
        at = w[:, None] * 8 + b[None, :]
        raw = tl.load(data_ptr + start + at, mask=at < nbytes, other=0).to(tl.int64)
        x = _sum((raw & 0xFF) << (b[None, :] * 8), 1)
    tl.store(partial_ptr + 2 * p, _sum(x, 0))
    tl.store(partial_ptr + 2 * p + 1, _sum(x * w, 0))
