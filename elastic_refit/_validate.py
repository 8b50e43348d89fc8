"""Argument checks shared by the frozen dataclasses and constructors of every layer (private).

A leaf module: it imports nothing of the project (and numpy only lazily), so the lowest
layer (boxes) can use it as freely as the testing toolkit does.
"""

from __future__ import annotations

__all__ = ["check_timeout", "is_integer", "require_at_least"]


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


def require_at_least(name: str, value: float, minimum: float, why: str = "") -> None:
    """Raise ``ValueError`` unless ``value >= minimum`` (NaN never is); ``why`` says in a few
    words what the bound is for, e.g. ``"one survivor at least"``."""
    if not value >= minimum:
        reason = f" ({why})" if why else ""
        raise ValueError(f"{name} must be >= {minimum}{reason}, got {value!r}")


def check_timeout(name: str, value: float | None) -> float | None:
    """``value`` unless it is neither ``None`` nor a finite number > 0 (NaN, inf, 0, a
    string): then ``ValueError`` naming ``name``. A NaN deadline never passes, so a wait
    bounded by one would never end."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite number of seconds > 0 (or None), got {value!r}")
    return float(value)
