"""The `elastic-refit` command line: plan, bench, demo, chaos, status.

Each subcommand lives in its own module and registers itself through ``register``;
user errors (``ValueError``, ``FileNotFoundError``) become one ``error:`` line and exit
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

# Modules that define `register(subparsers)`; each adds one top-level subcommand.
_COMMAND_MODULES = ("plan_cmd", "bench_cmd", "demo_cmd", "status_cmd", "chaos_cmd")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-refit",
        description="Minimal-bytes weight refit between training and inference layouts.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in _COMMAND_MODULES:
        module = importlib.import_module(f"{__name__}.{module_name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `elastic-refit` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"elastic-refit: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("elastic-refit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
