"""The runtime's event log: structlog events that every listener (metrics, tests) also
receives, so events are defined once, where they are logged."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

__all__ = ["EventListener", "EventLog"]

EventListener = Callable[[str, dict[str, Any]], None]


class EventLog:
    """A structlog logger that also hands every event to a listener (metrics, tests), so
    events are defined once, where they are logged."""

    def __init__(self, logger: Any, listener: EventListener | None, context: dict[str, Any] | None = None) -> None:
        self._logger = logger
        self._listener = listener
        self._context = context or {}

    def bind(self, **context: Any) -> EventLog:
        return EventLog(self._logger.bind(**context), self._listener, {**self._context, **context})

    def _emit(self, level: str, event: str, fields: dict[str, Any]) -> None:
        getattr(self._logger, level)(event, **fields)
        if self._listener is not None:
            with contextlib.suppress(Exception):  # a metrics bug must not break a refit
                self._listener(event, {**self._context, **fields})

    def info(self, event: str, **fields: Any) -> None:
        self._emit("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit("error", event, fields)
