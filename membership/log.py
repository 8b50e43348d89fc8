"""structlog set-up for the membership layer: JSON lines, dotted event names."""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


def configure_json_logging(stream=None, level: int = logging.INFO) -> None:
    """Render every structlog event as one JSON line (idempotent, process-wide).

    Called by member processes, the benchmark and tests; a library user who configured
    structlog already can skip it.
    """
    global _configured
    if _configured:
        return
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=True),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=True,
    )
    _configured = True


def get_logger(**context):
    """A structlog logger with ``context`` bound once (job, role, member_id, ...)."""
    return structlog.get_logger("membership").bind(**context)
