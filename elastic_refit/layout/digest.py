"""Content hashing of integer columns (layout and plan fingerprints)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["dtype_for_range", "narrowest_dtype", "update_int_arrays"]

_UNSIGNED = tuple(np.dtype(f"<u{n}") for n in (1, 2, 4, 8))
_SIGNED = tuple(np.dtype(f"<i{n}") for n in (1, 2, 4, 8))


def narrowest_dtype(array: np.ndarray) -> np.dtype:
    """The smallest little-endian integer dtype that holds every value of ``array``."""
    if array.size == 0:
        return _UNSIGNED[0]
    # One pass for the usual non-negative case: the OR of all values has the maximum's bit
    # length, and its sign bit is set exactly when some value is negative.
    bits = int(np.bitwise_or.reduce(array, axis=None))
    if bits >= 0:
        return dtype_for_range(0, bits)
    return dtype_for_range(int(array.min()), int(array.max()))


def dtype_for_range(lo: int, hi: int) -> np.dtype:
    """The smallest little-endian integer dtype that holds ``lo..hi``."""
    for dtype in _UNSIGNED if lo >= 0 else _SIGNED:
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return dtype
    raise ValueError(f"values {lo}..{hi} do not fit in 64 bits")


def update_int_arrays(digest, arrays: Iterable[tuple[str, np.ndarray]]) -> None:
    """Feed named integer arrays to a ``hashlib`` digest, each in its narrowest dtype.

    Every array is preceded by a header with its name, dtype and shape, so the byte stream
    decodes to exactly one sequence of arrays and the digest covers every value. Narrowing
    only shrinks what the hash reads: int64 columns of ids, ranks and box coordinates are
    mostly zero bytes, and sha256 costs ~0.7 ns per byte here.
    """
    for name, array in arrays:
        array = np.asarray(array)
        if array.dtype.kind not in "iu":
            raise TypeError(f"array {name!r} has dtype {array.dtype}, expected integers")
        dtype = narrowest_dtype(array)
        digest.update(f"{name}:{dtype.str}:{array.shape};".encode())
        digest.update(np.ascontiguousarray(array, dtype=dtype))
