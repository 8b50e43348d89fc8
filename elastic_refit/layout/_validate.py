"""Argument checks shared by the layout's frozen dataclasses and constructors (private)."""

from __future__ import annotations

__all__ = ["is_integer"]


def is_integer(value: object, *, numpy: bool = False) -> bool:
    """``value`` is an ``int`` (with ``numpy``, also a numpy integer), never a ``bool``."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    if not numpy:
        return False
    import numpy as np  # numpy is optional for the lowest layer (boxes); imported lazily

    return isinstance(value, np.integer)
