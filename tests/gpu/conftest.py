"""Shared pieces of the GPU tests."""

from __future__ import annotations

import os
import tempfile


def chaos_root(prefix: str) -> dict[str, str]:
    """``ChaosRun`` keywords that put a run's trial folders under the GPU session's ``$OUT``
    (a failed trial's logs, which the run keeps, then come back with the session's files),
    one folder per process (pytest-xdist workers each open their own run); none elsewhere."""
    out = os.environ.get("OUT")
    return {"root": tempfile.mkdtemp(prefix=prefix, dir=out)} if out and os.path.isdir(out) else {}
