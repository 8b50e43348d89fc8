"""The `elastic-refit` command line: etcd, plan, bench, demo, chaos, status, worker, timeline.

Each subcommand lives in its own module and registers itself through ``register``;
every failure becomes one ``elastic-refit: error: ...`` line on stderr (exit status 2 for
bad input, 1 for a runtime fault), never a traceback unless ``--debug``. Logs go to stderr
too: stdout carries only the command's table or JSON.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from collections.abc import Sequence

__all__ = ["build_parser", "describe_failure", "main"]

# Modules that define `register(subparsers)`; each adds one top-level subcommand.
_COMMAND_MODULES = ("etcd_cmd", "plan_cmd", "bench_cmd", "demo_cmd", "status_cmd", "job_cmd", "chaos_cmd",
                    "worker_cmd", "timeline_cmd")


class _Parser(argparse.ArgumentParser):
    """Usage errors are one ``elastic-refit: error:`` line too (exit 2); ``--help`` has the
    usage. Subcommand parsers are of this class as well."""

    def error(self, message: str):  # type: ignore[override]
        command = self.prog.removeprefix("elastic-refit").strip()
        self.exit(2, f"elastic-refit: error: {command + ': ' if command else ''}{message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="elastic-refit",
        description="Minimal-bytes weight refit between training and inference layouts.",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in _COMMAND_MODULES:
        module = importlib.import_module(f"{__name__}.{module_name}")
        module.register(subparsers)
    return parser


def describe_failure(exc: BaseException) -> tuple[int, str]:
    """The exit status and the one line a failure is reported with (pure): 2 for bad input
    (a value, a file, input nested too deeply), 1 for a runtime fault (etcd, a peer, a
    timeout, anything unexpected)."""
    from elastic_refit.errors import RefitError, brief

    if isinstance(exc, KeyError):
        return 2, str(exc.args[0] if exc.args else exc)
    first = brief(exc, limit=None)  # the one line a person reads: never cut
    if isinstance(exc, FileNotFoundError | IsADirectoryError | NotADirectoryError | PermissionError):
        return 2, f"{exc.filename}: {exc.strerror}" if exc.filename is not None else first
    if isinstance(exc, RecursionError):
        return 2, "input nested too deeply to read"
    if isinstance(exc, ValueError):
        return 2, first
    if isinstance(exc, RefitError | ConnectionError | TimeoutError):
        return 1, first or type(exc).__name__
    return 1, f"{type(exc).__name__}: {first} (run with --debug for the traceback)"


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C."""


def _terminate(_signum: int, _frame: object) -> None:
    raise _Terminated


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `elastic-refit` console script."""
    from elastic_refit.log import configure_logging

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, its one line printed)
        return exc.code if isinstance(exc.code, int) else 2
    configure_logging()  # to stderr: stdout is for the table or the JSON only
    # SIGTERM unwinds like Ctrl-C, so a bench or a demo stops the etcd and the member
    # processes it started (the default action would leave them running, orphaned).
    # `worker` installs its own handler (a member leaves its job cleanly).
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        return int(args.handler(args) or 0)
    except _Terminated:
        print("elastic-refit: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("elastic-refit: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        code, message = describe_failure(exc)
        print(f"elastic-refit: error: {message}", file=sys.stderr)
        return code
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
