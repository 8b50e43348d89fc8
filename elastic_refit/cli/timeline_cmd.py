"""`elastic-refit timeline LOGS... -o trace.json`: a Chrome / Perfetto trace of a run's logs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from elastic_refit.cli._output import print_json, render_table

__all__ = ["register", "run", "write_trace"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "timeline", help="turn a run's JSON logs into a Chrome / Perfetto trace",
        description="Read the refit.* and membership.* JSON log events of a run (every *.log and chaos "
                    "faults.jsonl under the given folders or files: a demo's --log-dir, a chaos trial, a bench's "
                    "logs, a job's) and write a trace: one row per member and incarnation, versions, epochs, "
                    "attempts, transfers, serving pauses, faults and the recovery after each. Open it at "
                    "ui.perfetto.dev or chrome://tracing.")
    parser.add_argument("logs", nargs="+", metavar="LOGS", help="log folders or files")
    parser.add_argument("-o", "--output", required=True, help="the trace file to write (JSON)")
    parser.add_argument("--json", action="store_true", help="print the trace's summary as JSON")
    parser.set_defaults(handler=run)


def write_trace(logs: list[str | Path], output: str | Path) -> dict[str, Any]:
    """Build the trace of the run logged under ``logs`` into ``output``; returns its summary
    (events read, faults, members, versions committed, pauses)."""
    from elastic_refit.cli.timeline import build_trace, read_run

    events, faults = read_run(logs)
    if not events:
        raise ValueError(f"no JSON log events under {', '.join(map(str, logs))} (expected *.log files with one "
                         "JSON object per line, see docs/LOGS.md)")
    trace = build_trace(events, faults)
    Path(output).write_text(json.dumps(trace))
    paused = [float(e.get("seconds", 0.0)) for e in events if e.get("event") == "refit.serving.paused"]
    return {"output": str(output), "num_log_events": len(events), "num_trace_events": len(trace["traceEvents"]),
            "num_members": len({e.get("member_id") for e in events if e.get("member_id")}),
            "num_faults": len(faults),
            "num_versions_committed": len({e.get("version") for e in events
                                           if e.get("event") == "refit.version.committed"}),
            "max_pause_s": max(paused) if paused else None}


def run(args: argparse.Namespace) -> int:
    summary = write_trace(args.logs, args.output)
    if args.json:
        print_json(summary)
    else:
        pause = summary["max_pause_s"]
        print(render_table(["trace", "value"], [
            ["written to", summary["output"]],
            ["log events read", str(summary["num_log_events"])],
            ["trace events", str(summary["num_trace_events"])],
            ["members", str(summary["num_members"])],
            ["versions committed", str(summary["num_versions_committed"])],
            ["faults", str(summary["num_faults"])],
            ["longest serving pause", "-" if pause is None else f"{pause * 1e3:.2f} ms"],
        ]))
        print("open it at ui.perfetto.dev (or chrome://tracing)")
    return 0
