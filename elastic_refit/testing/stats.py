"""Small statistics the benches share (kept apart so a bench's worker imports no more)."""

from __future__ import annotations

import numpy as np


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (NaN for none): the benches' p50 / p99."""
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")
