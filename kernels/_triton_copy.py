"""Triton source of the many-box copy kernel (private).

This file is imported twice by ``kernels._triton_backend``: once normally, where ``_jit`` is
``triton.jit`` (GPU), and once as a separate module object with ``_KERNELS_INTERPRET`` preset,
where ``_jit`` is Triton's ``InterpretedFunction`` (CPU). The interpreter resolves helper calls
through the module's globals, so the two flavours must never share one module.

Descriptor row (int64, ``DESC_WORDS`` wide) of one collapsed region, resolved for one set of
addresses (the host rebuilds it when the tensors or the buffer move), all sizes in bytes:

==  ==============================================================================
0   ``tensor_ptr - buf_ptr``: every address is formed from the one buffer argument,
    which keeps Triton's alignment analysis sound and works in the interpreter, where
    addresses are real host addresses
1   byte offset of the box's first element inside its tensor
2   byte offset of the region inside the packed buffer
3   bytes per contiguous row
4   n1: extent of the middle strided dim        (n0 is implicit: rows / (n1 * n2))
5   n2: extent of the innermost strided dim
6   s0, 7 s1, 8 s2: byte strides of the three strided dims (outermost first)
9   log2 of the widest access (1..16 bytes) that the box geometry and both pointers allow
10  first tile (program id) of this region
11  total bytes of the region
==  ==============================================================================

Resolving the pointers into the descriptor host-side saves the kernel one dependent load
round trip per program, which matters for buckets of many small regions.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["DESC_WORDS", "box_copy_kernel"]

if globals().get("_KERNELS_INTERPRET", False):
    from triton.runtime.interpreter import InterpretedFunction as _jit
else:
    _jit = triton.jit

DESC_WORDS = 12


@_jit
def _row_bytes(t_base, row, n1, n2, s0, s1, s2):
    """Byte offset from ``buf_ptr`` of the start of ``row`` (of the region's n0 x n1 x n2
    rows); divides in the type of ``row``, ``n1`` and ``n2`` (int32, or uint32 per lane)."""
    q = row // n2
    i = q // n1
    return (
        t_base
        + i.to(tl.int64) * s0
        + (q - i * n1).to(tl.int64) * s1
        + (row - q * n2).to(tl.int64) * s2
    )


@_jit
def _move(base, t_units, p_units, e, mask, PACK: tl.constexpr):
    """One access per lane: units ``t_units + e`` of the tensor side and ``p_units + e`` of
    the packed side, tensor to packed when ``PACK``; ``mask`` (None: all) picks the lanes."""
    t_ptrs = base + (t_units[:, None] + e[None, :])
    p_ptrs = base + (p_units[:, None] + e[None, :])
    if PACK:
        tl.store(p_ptrs, tl.load(t_ptrs, mask=mask, eviction_policy="evict_first"), mask=mask)
    else:
        tl.store(t_ptrs, tl.load(p_ptrs, mask=mask, eviction_policy="evict_first"), mask=mask)


@_jit
def _copy_tile(
    buf_ptr,
    t_base,
    p_off,
    row_bytes,
    n1,
    n2,
    s0,
    s1,
    s2,
    total,
    start,
    PACK: tl.constexpr,
    WLOG: tl.constexpr,
    NV: tl.constexpr,
):
    """Copy bytes [start, start + NV*16) of one region with accesses of W = 2**WLOG bytes.

    ``t_base`` is the byte offset of the box's first element from ``buf_ptr``; the other
    runtime arguments are descriptor words (module docstring).

    An access is VEC units of UNIT bytes (UNIT = min(W, 4)); ITERS iterations of NV accesses
    each cover the tile: (WLOG, UNIT, VEC, ITERS) = (4, 4, 4, 1), (3, 4, 2, 2), (2, 4, 1, 4),
    (1, 2, 1, 8), (0, 1, 1, 16).
    """
    W: tl.constexpr = 1 << WLOG
    UNIT: tl.constexpr = 4 if WLOG >= 2 else W
    VEC: tl.constexpr = W // UNIT
    ITERS: tl.constexpr = 16 // W
    if UNIT == 4:
        base = buf_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    elif UNIT == 2:
        base = buf_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
    else:
        base = buf_ptr.to(tl.pointer_type(tl.int8), bitcast=True)
    # Everything inside one region fits int32 in access units (the host splits regions
    # >= 1 GiB); only the final byte offsets are int64.
    rv = (row_bytes // W).to(tl.int32)
    tv = (total // W).to(tl.int32)
    v_start = (start // W).to(tl.int32)
    row0 = v_start // rv
    col0 = v_start - row0 * rv
    p_base = p_off // UNIT
    lane = tl.arange(0, NV)
    e = tl.arange(0, VEC)
    if col0 + ITERS * NV <= rv:
        # Fast path: the tile lies inside one row (long rows, single-row regions), so the
        # row is located once per program and no lane needs a mask or a division.
        frow = _row_bytes(t_base, row0, n1, n2, s0, s1, s2)
        for fit in tl.range(ITERS):
            ft = tl.multiple_of((frow + (col0 + fit * NV + lane).to(tl.int64) * W) // UNIT, VEC)
            fv = v_start + fit * NV + lane
            fp = tl.multiple_of(p_base + fv.to(tl.int64) * VEC, VEC)
            _move(base, ft, fp, e, None, PACK)
    else:
        # General path: rows shorter than a tile, or a tile that crosses rows; each lane
        # finds its row (unsigned int32 divisions: ~3 per access, well under the issue
        # budget of a memory-bound copy).
        rvu = rv.to(tl.uint32)
        n1u = n1.to(tl.uint32)
        n2u = n2.to(tl.uint32)
        for it in tl.range(ITERS):
            c = (col0 + it * NV + lane).to(tl.uint32)
            dr = c // rvu
            col = c - dr * rvu
            row = row0.to(tl.uint32) + dr
            t_bytes = _row_bytes(t_base, row, n1u, n2u, s0, s1, s2) + col.to(tl.int64) * W
            t_units = tl.multiple_of(t_bytes // UNIT, VEC)
            v = v_start + it * NV + lane
            p_units = tl.multiple_of(p_base + v.to(tl.int64) * VEC, VEC)
            _move(base, t_units, p_units, e, (v < tv)[:, None], PACK)


@_jit
def box_copy_kernel(
    buf_ptr,
    desc_ptr,
    tile_region_ptr,
    PACK: tl.constexpr,
    TILE_BYTES: tl.constexpr,
):
    """One program copies one tile (TILE_BYTES of the packed side) of one region.

    Every width moves TILE_BYTES // 16 accesses per iteration, so no branch needs more
    registers than the 16-byte one (registers are allocated for the worst branch and set the
    occupancy); narrower widths just loop more.
    """
    pid = tl.program_id(0)
    r = tl.load(tile_region_ptr + pid).to(tl.int64)
    d = desc_ptr + r * 12
    delta = tl.load(d)
    t_off = tl.load(d + 1)
    p_off = tl.load(d + 2)
    row_bytes = tl.load(d + 3)
    n1 = tl.load(d + 4).to(tl.int32)
    n2 = tl.load(d + 5).to(tl.int32)
    s0 = tl.load(d + 6)
    s1 = tl.load(d + 7)
    s2 = tl.load(d + 8)
    wlog = tl.load(d + 9)
    tile0 = tl.load(d + 10)
    total = tl.load(d + 11)
    start = (pid - tile0) * TILE_BYTES
    t_base = t_off + delta  # tensor_ptr - buf_ptr + the box's first byte
    NV: tl.constexpr = TILE_BYTES // 16
    # Widest access first; the narrower branches only run for misaligned boxes.
    if wlog == 4:
        _copy_tile(buf_ptr, t_base, p_off, row_bytes, n1, n2, s0, s1, s2, total, start, PACK, 4, NV)
    elif wlog == 3:
        _copy_tile(buf_ptr, t_base, p_off, row_bytes, n1, n2, s0, s1, s2, total, start, PACK, 3, NV)
    elif wlog == 2:
        _copy_tile(buf_ptr, t_base, p_off, row_bytes, n1, n2, s0, s1, s2, total, start, PACK, 2, NV)
    elif wlog == 1:
        _copy_tile(buf_ptr, t_base, p_off, row_bytes, n1, n2, s0, s1, s2, total, start, PACK, 1, NV)
    else:
        _copy_tile(buf_ptr, t_base, p_off, row_bytes, n1, n2, s0, s1, s2, total, start, PACK, 0, NV)
