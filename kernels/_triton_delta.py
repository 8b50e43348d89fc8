"""Triton source of the delta kernels (private; ``kernels.delta_triton`` launches them).

Loaded by ``kernels._triton_backend.load_source`` twice, like ``_triton_copy.py``: compiled
for CUDA and as a separate interpreted module for CPU tests.

Every kernel is 1-D and blocked: program ``p`` owns elements ``[p * BLOCK, (p + 1) * BLOCK)``
of a flat run of integers (one integer per element: int8, int16, int32 or int64 views, so
the comparison is bit for bit).

- ``flag_kernel``: compare ``current`` with ``base``; per block the number of changed
  elements (``counts[p]``) and one bit per element (``bits``, 8 per byte, element ``j`` of a
  block in bit ``j % 8`` of byte ``j // 8``). It reads both inputs once and writes 1/8 byte
  per element, so the second pass need not read ``base`` again.
- ``compact_sparse_kernel`` / ``compact_dense_kernel``: from the bits and each block's
  first output slot (``starts``: an exclusive scan of ``counts``, torch's cumsum on the
  host side), write each changed element's index (int64, ascending) and, with ``VALUES``,
  its value from ``current`` (loads masked to the changed elements: only their sectors are
  read). The sparse form gives a lane each 32-bit word of bits, the dense one a lane each
  element (see :func:`kernels.delta_triton.encode_changes` for which runs when).
- ``scatter_kernel``: ``target[index[i]] = values[i]`` (the apply).
- ``gather_many_kernel`` / ``scatter_many_kernel``: the same over several buffers at once,
  element ``i`` in buffer ``ref[i]`` (its address in ``table``, as int64): one launch for a
  message whose boxes lie in tens of buffers, not one or more per buffer.

Offsets are int64 when ``WIDE`` (runs of 2**31 elements or more), int32 otherwise.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.standard import _sum_combine

__all__ = ["compact_dense_kernel", "compact_sparse_kernel", "flag_kernel", "gather_many_kernel", "scatter_kernel",
           "scatter_many_kernel"]

if globals().get("_KERNELS_INTERPRET", False):
    from triton.runtime.interpreter import InterpretedFunction as _jit

    def _jit_sized(**options):
        return lambda fn: _jit(fn, **options)
else:
    _jit = triton.jit
    _jit_sized = triton.jit


def _one_variant(*, sizes: tuple[str, ...], unaligned: tuple[str, ...] = ()):
    """A kernel compiled once per element size, whatever it is called with: Triton would
    otherwise compile a variant per size argument divisible by 16 (or equal to 1) and per
    pointer aligned to 16 bytes, and a refit meets new ones version after version (H100,
    8 ranks: a sender's first delta code 0.30 s, later ones 0.02 s with 0.12 s outliers).
    ``sizes``: element counts, used only for masks; ``unaligned``: pointers that may be
    slices of a message at any offset (gathers and scatters are bound by their random
    accesses, not by vector width)."""
    return _jit_sized(do_not_specialize=list(sizes), do_not_specialize_on_alignment=list(unaligned))


@_jit
def _sum(x, axis: tl.constexpr):
    """``tl.sum`` without the standard library's jit wrapper, which the interpreter (run per
    module here, not by ``TRITON_INTERPRET``) cannot call; it knows this combine_fn."""
    return tl.reduce(x, axis, _sum_combine)


@_jit
def _cumsum(x):
    """``tl.cumsum`` of a 1-D tensor (inclusive), callable interpreted as ``_sum``."""
    return tl.associative_scan(x, 0, _sum_combine)


@_jit
def _first(pid, SIZE: tl.constexpr, WIDE: tl.constexpr):
    """Program ``pid``'s first element of runs of ``SIZE``: ``pid * SIZE``, in int64 when
    ``WIDE`` (a run of 2**31 elements or more)."""
    if WIDE:
        return pid.to(tl.int64) * SIZE
    else:
        return pid * SIZE


@_one_variant(sizes=("n",))
def flag_kernel(cur_ptr, base_ptr, bits_ptr, counts_ptr, n, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    pid = tl.program_id(0)
    start = _first(pid, BLOCK, WIDE)
    offs = start + tl.arange(0, BLOCK)
    inside = offs < n
    a = tl.load(cur_ptr + offs, mask=inside, other=0)
    b = tl.load(base_ptr + offs, mask=inside, other=0)
    flag = (a != b).to(tl.int32)  # lanes past n load 0 and 0: never flagged
    tl.store(counts_ptr + pid, _sum(flag, 0))
    shifts = tl.arange(0, 8)
    packed = _sum(tl.reshape(flag, (BLOCK // 8, 8)) << shifts[None, :], 1)
    tl.store(bits_ptr + _first(pid, BLOCK // 8, WIDE) + tl.arange(0, BLOCK // 8), packed.to(tl.uint8))


@_jit
def _popcount(x):
    """Set bits per lane of a uint32 tensor (the classic shift-and-add, no intrinsic: the
    interpreter runs it too)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    return (((x + (x >> 4)) & 0x0F0F0F0F) * 0x01010101) >> 24


@_jit
def compact_sparse_kernel(cur_ptr, words_ptr, starts_ptr, index_ptr, values_ptr, BLOCK: tl.constexpr,
                          WIDE: tl.constexpr, VALUES: tl.constexpr):
    pid = tl.program_id(0)
    start = _first(pid, BLOCK, WIDE)
    # One lane per 32 elements (a word of bits, element j of a word in its bit j): the scan
    # runs over BLOCK / 32 counts, and each lane then walks its 32 bits, writing only where
    # one is set. Per element that is a shift, a test and a predicated store, where a lane
    # per element pays a block-wide scan of every element; but a lane's stores land apart
    # from its neighbours', which costs more than that scan once changes are dense.
    word = tl.arange(0, BLOCK // 32)
    bits = tl.load(words_ptr + start // 32 + word).to(tl.uint32, bitcast=True)
    counts = _popcount(bits)
    slot = tl.load(starts_ptr + pid) + (_cumsum(counts) - counts).to(tl.int64)
    first = start + word * 32
    for j in tl.static_range(32):
        hit = ((bits >> j) & 1) != 0
        tl.store(index_ptr + slot, (first + j).to(tl.int64), mask=hit)
        if VALUES:
            tl.store(values_ptr + slot, tl.load(cur_ptr + first + j, mask=hit, other=0), mask=hit)
        slot += hit.to(tl.int64)


@_jit
def compact_dense_kernel(cur_ptr, bits_ptr, starts_ptr, index_ptr, values_ptr, BLOCK: tl.constexpr,
                         WIDE: tl.constexpr, VALUES: tl.constexpr):
    pid = tl.program_id(0)
    start = _first(pid, BLOCK, WIDE)
    lane = tl.arange(0, BLOCK)
    # A lane per element: each reads its element's byte of bits (8 lanes share one), and
    # neighbouring lanes' changes go to neighbouring slots (stores that coalesce).
    byte = tl.load(bits_ptr + (start // 8) + (lane // 8)).to(tl.int32)
    flag = (byte >> (lane % 8)) & 1
    changed = flag != 0
    slot = tl.load(starts_ptr + pid) + (_cumsum(flag) - flag).to(tl.int64)
    offs = start + lane
    tl.store(index_ptr + slot, offs.to(tl.int64), mask=changed)
    if VALUES:
        value = tl.load(cur_ptr + offs, mask=changed, other=0)
        tl.store(values_ptr + slot, value, mask=changed)


@_one_variant(sizes=("k",), unaligned=("target_ptr", "index_ptr", "values_ptr"))
def scatter_kernel(target_ptr, index_ptr, values_ptr, k, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < k
    at = tl.load(index_ptr + offs, mask=inside, other=0)
    value = tl.load(values_ptr + offs, mask=inside, other=0)
    tl.store(target_ptr + at, value, mask=inside)


@_jit
def _typed(addr, U: tl.constexpr):
    """Buffer addresses (int64) as pointers to elements of ``U`` bytes."""
    if U == 1:
        return addr.to(tl.pointer_type(tl.int8), bitcast=True)
    elif U == 2:
        return addr.to(tl.pointer_type(tl.int16), bitcast=True)
    elif U == 4:
        return addr.to(tl.pointer_type(tl.int32), bitcast=True)
    else:
        return addr.to(tl.pointer_type(tl.int64), bitcast=True)


@_jit
def _many(table_ptr, ref_ptr, index_ptr, k, U: tl.constexpr, BLOCK: tl.constexpr):
    """This program's lanes of a many-buffer kernel: each element's pointer, its place
    ``offs`` in the flat inputs, and which lanes hold one."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < k
    ref = tl.load(ref_ptr + offs, mask=inside, other=0)
    at = tl.load(index_ptr + offs, mask=inside, other=0)
    return _typed(tl.load(table_ptr + ref, mask=inside, other=0), U) + at, offs, inside


@_one_variant(sizes=("k",), unaligned=("ref_ptr", "index_ptr", "out_ptr"))
def gather_many_kernel(table_ptr, ref_ptr, index_ptr, out_ptr, k, U: tl.constexpr, BLOCK: tl.constexpr):
    ptrs, offs, inside = _many(table_ptr, ref_ptr, index_ptr, k, U, BLOCK)
    tl.store(out_ptr + offs, tl.load(ptrs, mask=inside, other=0), mask=inside)


@_one_variant(sizes=("k",), unaligned=("ref_ptr", "index_ptr", "values_ptr"))
def scatter_many_kernel(table_ptr, ref_ptr, index_ptr, values_ptr, k, U: tl.constexpr, BLOCK: tl.constexpr):
    ptrs, offs, inside = _many(table_ptr, ref_ptr, index_ptr, k, U, BLOCK)
    tl.store(ptrs, tl.load(values_ptr + offs, mask=inside, other=0), mask=inside)
