"""The one structlog set-up of elastic-refit processes: JSON lines, or a console view on a terminal.

Every event has a dotted name (``refit.version.committed``) and numbers as fields; the
schema is in docs/LOGS.md. Call :func:`configure_logging` once per process (member
processes, the demo, examples); a library user who configured structlog already can skip it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

__all__ = ["configure_logging", "ensure_configured", "get_logger"]


class _CurrentStderr:
    """The process's ``sys.stderr`` as it is when a line is written, not when logging was
    configured (tools and test harnesses swap it, and may close the one they replaced)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure_logging(json: bool | None = None, *, stream: TextIO | None = None,
                      level: int = logging.INFO) -> None:
    """Route every structlog event of this process to ``stream`` (default: the process's
    stderr at the time of each write).

    ``json=True`` renders one JSON object per line (timestamps ISO-8601 UTC); ``json=False``
    renders a human-readable console line; ``None`` picks the console view only when the
    stream is a terminal, so redirected output stays machine-readable. Calling it again
    replaces the previous configuration (a process may switch its stream, e.g. to a file).
    """
    out: Any = stream if stream is not None else _CurrentStderr()
    if json is None:
        isatty = getattr(out, "isatty", None)
        json = not (callable(isatty) and isatty())
    renderer = (structlog.processors.JSONRenderer(sort_keys=True) if json
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(out),
        # Not cached: loggers created before a re-configuration must follow it.
        cache_logger_on_first_use=False,
    )


def get_logger(name: str = "elastic_refit", **context: Any) -> Any:
    """A structlog logger with ``context`` bound once (job, role, member_id, epoch, ...).

    If nobody configured structlog yet, this configures it as :func:`configure_logging`
    does (JSON lines on stderr): structlog's own default prints to stdout, where a
    program's output (a table, JSON, a worker's report) must not get log lines mixed in. A
    program that configures structlog itself, before or after, keeps its configuration."""
    ensure_configured()
    return structlog.get_logger(name).bind(**context)


def ensure_configured() -> None:
    """:func:`configure_logging` unless structlog is configured already (by anyone)."""
    if not structlog.is_configured():
        configure_logging()
