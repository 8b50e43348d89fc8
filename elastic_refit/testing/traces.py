"""The Chrome Trace Event Format as a JSON schema (the part ``elastic-refit timeline``
writes: complete, instant, counter, async and metadata events), to check a trace file
loads in chrome://tracing and Perfetto."""

from __future__ import annotations

from typing import Any

__all__ = ["CHROME_TRACE_SCHEMA", "check_chrome_trace"]

_NUMBER = {"type": "number"}
_ID = {"type": "integer", "minimum": 0}
_COMMON = {"name": {"type": "string", "minLength": 1}, "pid": _ID, "tid": _ID, "cat": {"type": "string"},
           "args": {"type": "object"}}


def _event(phase: str, required: list[str], **extra: Any) -> dict[str, Any]:
    return {"if": {"properties": {"ph": {"const": phase}}, "required": ["ph"]},
            "then": {"required": ["name", "pid", "tid", *required],
                     "properties": {**_COMMON, **extra}}}


CHROME_TRACE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "otherData": {"type": "object"},
        "traceEvents": {"type": "array", "items": {
            "type": "object",
            "required": ["ph"],
            "properties": {"ph": {"enum": ["X", "B", "E", "i", "I", "C", "b", "e", "n", "M"]}},
            "allOf": [
                _event("X", ["ts", "dur"], ts=_NUMBER, dur={"type": "number", "minimum": 0}),
                _event("i", ["ts", "s"], ts=_NUMBER, s={"enum": ["g", "p", "t"]}),
                _event("C", ["ts", "args"], ts=_NUMBER,
                       args={"type": "object", "minProperties": 1, "additionalProperties": _NUMBER}),
                _event("b", ["ts", "id", "cat"], ts=_NUMBER, id={"type": ["integer", "string"]}),
                _event("e", ["ts", "id", "cat"], ts=_NUMBER, id={"type": ["integer", "string"]}),
                _event("M", ["args"], name={"enum": ["process_name", "thread_name", "process_sort_index",
                                                     "thread_sort_index", "process_labels"]}),
            ],
        }},
    },
}


def check_chrome_trace(trace: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``trace`` is a valid Chrome trace; also
    every async begin has its end (same cat, id and pid) after it."""
    import jsonschema

    jsonschema.validate(trace, CHROME_TRACE_SCHEMA)
    begun: dict[tuple[Any, Any, Any], float] = {}
    for event in trace["traceEvents"]:
        key = (event.get("cat"), event.get("id"), event.get("pid"))
        if event["ph"] == "b":
            begun[key] = event["ts"]
        elif event["ph"] == "e" and (key not in begun or begun.pop(key) > event["ts"]):
            raise jsonschema.ValidationError(f"async end without an earlier begin: {event}")
    if begun:
        raise jsonschema.ValidationError(f"async begins without an end: {sorted(map(str, begun))}")
