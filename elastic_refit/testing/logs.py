"""Readers of the JSON event logs member processes write (one ``*.log`` per incarnation).

Every event is one JSON object per line with a dotted ``event`` name and an ISO-8601
``timestamp`` (see docs/LOGS.md); readers add ``_t``, the unix time of the event. Lines
cut by a SIGKILL, and C++ noise, are skipped.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["parse_log_lines", "read_logs"]


def _timestamp(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def parse_log_lines(lines: list[str]) -> list[dict[str, Any]]:
    """JSON events of one log (non-JSON lines skipped), each with ``_t`` (unix seconds)."""
    out = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line cut by SIGKILL
        event["_t"] = _timestamp(event.get("timestamp"))
        out.append(event)
    return out


def read_logs(log_dir: str | Path, incarnation: str = "*") -> dict[str, list[dict[str, Any]]]:
    """``{incarnation: events}`` from every ``*.log`` in ``log_dir`` (one file per incarnation),
    or only from ``incarnation``'s."""
    out = {}
    for path in sorted(Path(log_dir).glob(f"{incarnation}.log")):
        out[path.stem] = parse_log_lines(path.read_text(errors="replace").splitlines())
    return out
