"""Triton source of the fused pack + quantize kernel (private).

Loaded by ``kernels._triton_backend.load_source`` twice, like ``_triton_copy.py``: compiled
for CUDA and as an interpreted module for CPU tests. It follows ``kernels.quantize``'s
arithmetic step by step (see there); every step is an integer operation, an IEEE division
(``div_rn``), a max, a multiplication by a power of two, or the reciprocal-and-correction
step that stands for the per-element division of the fp8-block formats and gives its
correctly rounded result (``_divide``), so the compiled kernel (which flushes denormals) and
the CPU reference agree bit for bit.

Descriptor row (int64, ``DESC_WORDS`` wide) of one 2-D slice of a box (the host expands the
box's leading dims), addresses resolved for one set of tensors and buffer:

==  ==============================================================================
0   ``tensor_ptr - buf_ptr`` in bytes (even: both are bf16/16-byte aligned)
1   element offset of the slice's first element in its tensor
2   the tensor's row stride in elements (its last dim)
3   rows of the slice, 4 columns of the slice
5   byte offset of the slice's FP8 bytes in the buffer (rows ``p_stride`` bytes apart)
6   byte offset of the slice's scales in the buffer (rows of its block grid ``s_stride`` apart)
7   tiles per tile row of the slice, 8 first tile (program id) of the slice
9   scale blocks per row of the slice (``ceil(cols / BC)``)
10  ``p_stride``: bytes from one FP8 row to the next (``cols`` when packed)
11  ``s_stride``: scales from one block row to the next (word 9 when packed)
==  ==============================================================================

One program quantizes one tile of ``TR x TC`` elements (whole blocks). When a block is
taller than the rows one pass can hold in registers (fp8-block128: TR = BR = 128), the tile
is read in ``CR``-row chunks twice: once for the block amax, once to quantize (the second
read mostly hits L2).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.standard import _elementwise_max

__all__ = ["DESC_WORDS", "quant_pack_kernel"]

if globals().get("_KERNELS_INTERPRET", False):
    from triton.runtime.interpreter import InterpretedFunction as _jit
else:
    _jit = triton.jit

DESC_WORDS = 12
# Triton's CPU interpreter evaluates an FMA as a rounded multiply and a rounded add, which
# breaks ``_divide``'s exactness; interpreted, the kernel divides (the same result, slower).
_FUSED_FMA = tl.constexpr(not globals().get("_KERNELS_INTERPRET", False))


@_jit
def _max(x, axis: tl.constexpr):
    """``tl.max`` without the standard library's jit wrapper, which the interpreter (run
    per module here, not by ``TRITON_INTERPRET``) cannot call; it knows this combine_fn."""
    return tl.reduce(x, axis, _elementwise_max)


@_jit
def _row_mask(rows, n_r):
    """The mask of a tile cut across its rows only, as one column: tl.load/store broadcast it
    along the row, and a mask constant along a row keeps the row's accesses vectorised (a
    full 2-D mask, which Triton cannot prove constant over a vector, makes every access
    scalar: 2-3x slower for a [576, 7168] tensor measured on an H200)."""
    return (rows < n_r)[:, None]


@_jit
def _load(src, s_base, stride, rows, cols, n_r, n_c, EVEN_ROWS: tl.constexpr, EVEN_COLS: tl.constexpr,
          ALIGNED: tl.constexpr, EVICT: tl.constexpr):
    """The tile's values as float32 (subnormals flushed to signed zero), their magnitudes
    (0 for non-finite values) and the non-finite mask (int32). ``rows``: the tile's rows (1-D),
    ``cols``: its columns shaped as a row of the tile (``[1, TC]``). ``EVICT``: the cache
    policy (``evict_last`` for a first pass whose bytes the second pass reads again)."""
    x = _load_raw(src, s_base, stride, rows, cols, n_r, n_c, EVEN_ROWS, EVEN_COLS, ALIGNED, EVICT)
    v = _flushed(x)
    nonfinite = (_magnitude_bits(x) & 0x7F80) == 0x7F80
    mag = (v.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    return v, mag, nonfinite.to(tl.int32)


@_jit
def _flushed(x):
    """BF16 values as float32, subnormals and non-finite values flushed to signed zero."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    expo = bits & 0x7F800000
    return tl.where((expo == 0) | (expo == 0x7F800000), bits & -2147483648, bits).to(tl.float32, bitcast=True)


@_jit
def _load_raw(src, s_base, stride, rows, cols, n_r, n_c, EVEN_ROWS: tl.constexpr, EVEN_COLS: tl.constexpr,
              ALIGNED: tl.constexpr, EVICT: tl.constexpr):
    """The tile's BF16 values as loaded (masked elements 0), for :func:`_magnitude_bits`."""
    r_off = rows.to(tl.int64) * stride
    if ALIGNED:
        r_off = tl.multiple_of(r_off, 8)
    ptrs = src + s_base + r_off[:, None] + cols
    if EVEN_ROWS and EVEN_COLS:
        return tl.load(ptrs, eviction_policy=EVICT)
    elif EVEN_COLS:
        return tl.load(ptrs, mask=_row_mask(rows, n_r), other=0.0, eviction_policy=EVICT)
    mask = _row_mask(rows, n_r) & (cols < n_c)
    return tl.load(ptrs, mask=mask, other=0.0, eviction_policy=EVICT)


@_jit
def _magnitude_bits(x):
    """BF16 magnitudes as int32 bits: their integer order is the values' order, and a
    non-finite value is >= 0x7F80, so one integer max per block gives both the amax and the
    poison flag (:func:`_amax_of_bits`), at one AND per element instead of a float32
    widening, a flush and a second reduction."""
    return x.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF


@_jit
def _amax_of_bits(bits):
    """Per-block (amax as float32, poisoned as int32) from the max of :func:`_magnitude_bits`:
    a subnormal maximum is a zero block (the flush), a poisoned block's amax is 0 (its bytes
    and scale are replaced anyway; 0 keeps the scale arithmetic finite)."""
    bad = bits >= 0x7F80
    amax = tl.where((bits < 0x80) | bad, 0, bits << 16).to(tl.float32, bitcast=True)
    return amax, bad.to(tl.int32)


@_jit
def _e4m3_soft(y):
    """float32 in [-448, 448] to E4M3 codes (int32) by integer arithmetic, round to nearest
    even (``kernels.quantize.e4m3_bits_reference``)."""
    b = y.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
    sub = ((a.to(tl.float32, bitcast=True) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    return sign | tl.where(a >= 0x3C800000, normal, sub)


@_jit
def _scales(amax, bad, KIND: tl.constexpr):
    """Per-block (value used to quantize, its reciprocal, power of two, stored bits as
    int32): fp8-block scale_inv ``s`` scaled into [1, 2) by the power of two ``2**-e(s)``,
    RN(1 / that) and the scale's float32 bits; or mxfp8's factor 2**(127 - code) (twice; a
    power of two 1) and the E8M0 code. See ``_divide`` for why fp8-block scales are cut so."""
    if KIND == 0:
        s = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)
        s = tl.where(amax == 0.0, 1.0, s)
        stored = tl.where(bad > 0, 0x7FC00000, s.to(tl.int32, bitcast=True))
        bits = s.to(tl.int32, bitcast=True)
        # s is normal and positive: 2**-e(s) is exact, and so is s * 2**-e(s) in [1, 2).
        pow2 = (254 * 8388608 - (bits & 0x7F800000)).to(tl.float32, bitcast=True)
        unit = ((bits & 0x007FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
        return unit, tl.math.div_rn(1.0, unit), pow2, stored
    else:
        biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        code = tl.minimum(tl.maximum(biased - 8, 0), 254)
        code = tl.where(amax == 0.0, 127, code)
        factor = ((254 - code) << 23).to(tl.float32, bitcast=True)
        stored = tl.where(bad > 0, 255, code)
        return factor, factor, tl.full(factor.shape, 1.0, tl.float32), stored


@_jit
def _divide(v, unit, rcp, pow2):
    """``div_rn(v, s)`` for the fp8-block scale ``s = unit / pow2`` without a division per
    element: ``v * pow2`` and ``unit`` are ``v`` and ``s`` scaled by the same power of two
    (exact while ``v * pow2`` stays normal; where it does not, the quotient is far below
    E4M3's smallest subnormal and either way becomes a zero byte of ``v``'s sign), then one
    correction step from the correctly rounded reciprocal: ``q = RN(x * r)``,
    ``e = x - q * unit`` (exact in an FMA), ``RN(q + e * r)`` is the correctly rounded
    ``x / unit`` (Markstein's theorem, radix 2, round to nearest) wherever ``e`` is a normal
    number, which holds for every quotient of 2**-100 and above (with ``unit`` in [1, 2));
    smaller quotients may be an ulp off but are zero bytes in E4M3 either way.
    tests/gpu/test_fp8_divide_gpu.py checks the E4M3 bytes against ``div_rn`` for every pair
    of BF16 value and BF16 block amax, and the float32 quotients wherever they matter."""
    x = v * pow2
    if _FUSED_FMA:
        q = x * rcp
        e = tl.fma(-q, unit, x)
        # A zero q keeps its sign (div_rn's -0 for a negative v whose quotient flushes);
        # the correction would turn it into +0.
        x = tl.where(q == 0.0, q, tl.fma(e, rcp, q))
    else:
        x = tl.math.div_rn(x, tl.broadcast_to(unit, x.shape))
    return x


@_jit
def _quantize(v, per, rcp, pow2, bad_el, KIND: tl.constexpr, SOFT_CAST: tl.constexpr):
    """E4M3 bytes (int32 0..255) of values ``v`` with per-element ``_scales`` values."""
    if KIND == 0:  # noqa: SIM108 - constexpr branches (compile-time), kept as statements
        y = _divide(v, per, rcp, pow2)
    else:
        y = v * per
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if SOFT_CAST:  # noqa: SIM108
        q = _e4m3_soft(y)
    else:
        q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    return tl.where(bad_el > 0, 0x7F, q)


@_jit
def _store_q(dst, p_off, p_stride, rows, cols, n_r, n_c, q, EVEN_ROWS: tl.constexpr, EVEN_COLS: tl.constexpr,
             ALIGNED: tl.constexpr):
    """Store E4M3 bytes ``q`` of the tile (``rows``, ``cols`` as for ``_load``)."""
    p_row = p_off + rows.to(tl.int64) * p_stride
    if ALIGNED:
        p_row = tl.multiple_of(p_row, 16)
    ptrs = dst + p_row[:, None] + cols
    if EVEN_ROWS and EVEN_COLS:
        tl.store(ptrs, q.to(tl.int8))
    elif EVEN_COLS:
        tl.store(ptrs, q.to(tl.int8), mask=_row_mask(rows, n_r))
    else:
        mask = _row_mask(rows, n_r) & (cols < n_c)
        tl.store(ptrs, q.to(tl.int8), mask=mask)


@_jit
def quant_pack_kernel(
    buf_ptr,
    desc_ptr,
    tile_entry_ptr,
    KIND: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    TR: tl.constexpr,
    TC: tl.constexpr,
    CR: tl.constexpr,
    EVEN_ROWS: tl.constexpr,
    EVEN_COLS: tl.constexpr,
    ALIGNED: tl.constexpr,
    SOFT_CAST: tl.constexpr,
):
    """One program quantizes one ``TR x TC`` tile of one slice into the buffer.

    ``KIND`` 0: fp8-block (float32 scale_inv), 1: mxfp8 (E8M0 codes). ``EVEN_ROWS`` /
    ``EVEN_COLS``: every slice of the launch is whole tiles down / across (no mask there); ``ALIGNED``: every address and row is
    16-byte aligned (vector accesses); ``SOFT_CAST``: integer E4M3 conversion instead of
    the hardware one (the interpreter's is inexact for E4M3 subnormals).
    """
    pid = tl.program_id(0)
    e = tl.load(tile_entry_ptr + pid).to(tl.int64)
    d = desc_ptr + e * 12
    delta = tl.load(d)
    t_off = tl.load(d + 1)
    stride = tl.load(d + 2)
    n_r = tl.load(d + 3).to(tl.int32)
    n_c = tl.load(d + 4).to(tl.int32)
    p_off = tl.load(d + 5)
    s_off = tl.load(d + 6)
    tpr = tl.load(d + 7).to(tl.int32)
    tile0 = tl.load(d + 8).to(tl.int32)
    n_bc = tl.load(d + 9).to(tl.int32)
    p_stride = tl.load(d + 10)
    s_stride = tl.load(d + 11)
    t = pid - tile0
    tr = t // tpr
    tc = t - tr * tpr
    src = buf_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    dst = buf_ptr.to(tl.pointer_type(tl.int8), bitcast=True)
    s_base = delta // 2 + t_off
    if ALIGNED:
        s_base = tl.multiple_of(s_base, 8)
        p_off = tl.multiple_of(p_off, 16)
    cols = tc * TC + tl.arange(0, TC)
    NBR: tl.constexpr = TR // BR
    NBC: tl.constexpr = TC // BC
    n_br = (n_r + BR - 1) // BR
    if CR == TR:
        # One pass: the tile holds NBR x NBC whole blocks.
        rows = tr * TR + tl.arange(0, TR)
        # (Float magnitudes here: an integer reduction over this 4-D reshape sends LLVM's O3
        # into minutes of compile time, measured on an H200 with Triton 3.6.)
        v, mag, nf = _load(src, s_base, stride, rows, cols[None, :], n_r, n_c, EVEN_ROWS, EVEN_COLS, ALIGNED, "evict_first")
        amax = _max(_max(tl.reshape(mag, (NBR, BR, NBC, BC)), axis=3), axis=1)
        bad = _max(_max(tl.reshape(nf, (NBR, BR, NBC, BC)), axis=3), axis=1)
        scale, rcp, pow2, stored = _scales(amax, bad, KIND)
        per = tl.reshape(tl.broadcast_to(tl.reshape(scale, (NBR, 1, NBC, 1)), (NBR, BR, NBC, BC)), (TR, TC))
        per_rcp = tl.reshape(tl.broadcast_to(tl.reshape(rcp, (NBR, 1, NBC, 1)), (NBR, BR, NBC, BC)), (TR, TC))
        per_pow2 = tl.reshape(tl.broadcast_to(tl.reshape(pow2, (NBR, 1, NBC, 1)), (NBR, BR, NBC, BC)), (TR, TC))
        bad_el = tl.reshape(tl.broadcast_to(tl.reshape(bad, (NBR, 1, NBC, 1)), (NBR, BR, NBC, BC)), (TR, TC))
        q = _quantize(v, per, per_rcp, per_pow2, bad_el, KIND, SOFT_CAST)
        _store_q(dst, p_off, p_stride, rows, cols[None, :], n_r, n_c, q, EVEN_ROWS, EVEN_COLS, ALIGNED)
        b_r = tr * NBR + tl.arange(0, NBR)
    else:
        # Blocks as tall as the tile (NBR == 1), read in CR-row chunks: amax, then quantize.
        bits = tl.full((NBC,), 0, tl.int32)
        for c in tl.range(TR // CR):
            rows = tr * TR + c * CR + tl.arange(0, CR)
            x = _load_raw(src, s_base, stride, rows, cols[None, :], n_r, n_c, EVEN_ROWS, EVEN_COLS, ALIGNED, "evict_last")
            bits = tl.maximum(bits, _max(_max(tl.reshape(_magnitude_bits(x), (CR, NBC, BC)), axis=2), axis=0))
        amax, bad = _amax_of_bits(bits)
        scale, rcp, pow2, stored = _scales(amax, bad, KIND)
        per = tl.reshape(tl.broadcast_to(tl.reshape(scale, (1, NBC, 1)), (CR, NBC, BC)), (CR, TC))
        per_rcp = tl.reshape(tl.broadcast_to(tl.reshape(rcp, (1, NBC, 1)), (CR, NBC, BC)), (CR, TC))
        per_pow2 = tl.reshape(tl.broadcast_to(tl.reshape(pow2, (1, NBC, 1)), (CR, NBC, BC)), (CR, TC))
        bad_el = tl.reshape(tl.broadcast_to(tl.reshape(bad, (1, NBC, 1)), (CR, NBC, BC)), (CR, TC))
        for c in tl.range(TR // CR):
            rows = tr * TR + c * CR + tl.arange(0, CR)
            v, _mag, _nf = _load(src, s_base, stride, rows, cols[None, :], n_r, n_c, EVEN_ROWS, EVEN_COLS, ALIGNED, "evict_first")
            q = _quantize(v, per, per_rcp, per_pow2, bad_el, KIND, SOFT_CAST)
            _store_q(dst, p_off, p_stride, rows, cols[None, :], n_r, n_c, q, EVEN_ROWS, EVEN_COLS, ALIGNED)
        stored = tl.reshape(stored, (1, NBC))
        b_r = tr + tl.arange(0, 1)
    b_c = tc * NBC + tl.arange(0, NBC)
    s_mask = (b_r < n_br)[:, None] & (b_c < n_bc)[None, :]
    s_idx = b_r.to(tl.int64)[:, None] * s_stride + b_c[None, :]
    if KIND == 0:
        s_ptr = buf_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + s_off // 4
        tl.store(s_ptr + s_idx, stored, mask=s_mask)
    else:
        tl.store(dst + s_off + s_idx, stored.to(tl.int8), mask=s_mask)
