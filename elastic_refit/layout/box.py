"""Boxes (N-d regions) and the dtype table shared by every layer."""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic_refit._validate import is_integer

__all__ = ["DTYPES", "DTYPE_ITEMSIZE", "Box", "canonical_dtype"]

# Canonical dtype names (torch's, without the `torch.` prefix) and their sizes in bytes.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
DTYPES: tuple[str, ...] = tuple(DTYPE_ITEMSIZE)


def canonical_dtype(dtype: object) -> str:
    """Normalise ``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"bf16"`` to ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32", "fp8": "float8_e4m3fn"}.get(name, name)
    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    return name


def _as_int_tuple(values: object, what: str) -> tuple[int, ...]:
    try:
        items = tuple(values)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{what} must be a sequence of integers, got {values!r}") from None
    out = []
    for v in items:
        if not is_integer(v, numpy=True):
            raise ValueError(f"{what} must be integers, got {values!r}")
        out.append(int(v))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Box:
    """An N-d region ``[offsets, offsets + lengths)`` of a tensor or a local buffer."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        offsets = _as_int_tuple(self.offsets, "box offsets")
        lengths = _as_int_tuple(self.lengths, "box lengths")
        if len(offsets) != len(lengths):
            raise ValueError(f"box offsets {offsets} and lengths {lengths} differ in rank")
        if any(o < 0 for o in offsets) or any(n < 0 for n in lengths):
            raise ValueError(f"box offsets {offsets} and lengths {lengths} must be >= 0")
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "lengths", lengths)

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.offsets)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths, strict=True))

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def is_empty(self) -> bool:
        return any(n == 0 for n in self.lengths)

    def intersect(self, other: Box) -> Box | None:
        """The common region, or ``None`` when the boxes do not overlap."""
        if other.ndim != self.ndim:
            raise ValueError(f"cannot intersect boxes of rank {self.ndim} and {other.ndim}")
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.ends, other.ends, strict=True))
        if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True)))

    def contains(self, other: Box) -> bool:
        return all(
            so <= oo and oe <= se
            for so, se, oo, oe in zip(self.offsets, self.ends, other.offsets, other.ends, strict=True)
        )

    def fits(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == self.ndim and all(e <= s for e, s in zip(self.ends, shape, strict=True))

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths, strict=True))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.lengths, strict=True)) + "]"
