"""Shared output helpers for the CLI: readable tables, JSON, byte and time formatting."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

__all__ = ["format_bytes", "format_seconds", "print_json", "progress", "render_table"]


def format_bytes(num_bytes: float) -> str:
    """Human-readable bytes in powers of 1024 (``1.50 GiB``)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024.0 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024.0
    raise AssertionError("unreachable")


def format_seconds(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.3f} s"


def render_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain aligned table; the first column is left-aligned, the rest right-aligned."""
    text_rows = [[str(cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text_rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
            for i, cell in enumerate(cells)
        ]
        return "  ".join(parts).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(row) for row in text_rows)
    return "\n".join(out)


def print_json(payload: dict[str, Any], stream: TextIO | None = None) -> None:
    # Resolve stdout at call time so redirections made after import are honoured.
    (stream or sys.stdout).write(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def progress(message: str) -> None:
    """Progress for long work goes to stderr so `--json` output stays clean."""
    print(message, file=sys.stderr, flush=True)
