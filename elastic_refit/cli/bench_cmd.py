"""`elastic-refit bench ...`: data-path benchmarks, `bench membership`, `bench soak` and `bench control-plane`."""

from __future__ import annotations

import argparse
import importlib

__all__ = ["register"]

# Sub-benchmarks that register themselves as `bench <name>`; each module defines
# `register(bench_subparsers)`.
_BENCH_MODULES: tuple[str, ...] = ("bench_membership", "bench_soak", "bench_control_plane")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmarks (data path, membership)",
        description="Without a TARGET: the refit benchmark (--spec or --model), reshard vs gather-and-broadcast "
                    "on this machine. With one: membership, soak or control-plane (each has its own --help).")
    # optional: `bench --model ...` runs the refit benchmark
    targets = parser.add_subparsers(dest="bench_target", metavar="[TARGET]", required=False)
    for module_name in _BENCH_MODULES:
        importlib.import_module(f"elastic_refit.cli.{module_name}").register(targets)
    # `bench --spec FILE` / `bench --model ...` (no target): reshard vs gather-and-broadcast.
    from elastic_refit.cli import bench_refit

    bench_refit.add_arguments(parser)
    parser.set_defaults(handler=_no_target(parser))


def _no_target(parser: argparse.ArgumentParser):
    def handler(args: argparse.Namespace) -> int:
        if getattr(args, "spec", None) or getattr(args, "model", None):
            from elastic_refit.cli import bench_refit

            return bench_refit.run(args)
        parser.print_help()
        return 2

    return handler
