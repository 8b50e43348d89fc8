"""`elastic-refit bench membership`: kill members of a real etcd-backed job, time recovery."""

from __future__ import annotations

import argparse

from elastic_refit.cli._output import format_seconds, print_json, progress, render_table

__all__ = ["register"]


def register(targets: argparse._SubParsersAction) -> None:
    """Add ``bench membership`` to the ``bench`` sub-commands."""
    parser = targets.add_parser(
        "membership",
        help="SIGKILL members of a live job; time detection, new epoch and gloo rebuild",
    )
    parser.add_argument("--members", type=int, default=4, help="member processes (default 4)")
    parser.add_argument("--trials", type=int, default=10, help="kills to time (default 10)")
    parser.add_argument("--ttl", type=int, default=2, help="lease TTL in seconds (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="victim choice seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    import sys

    from elastic_refit.log import configure_logging
    from elastic_refit.testing.membership_bench import BenchConfig, run_membership_bench

    configure_logging(json=True, stream=sys.stderr)  # stdout stays the table or the JSON object

    cfg = BenchConfig(members=args.members, trials=args.trials, ttl_s=args.ttl, seed=args.seed)
    result = run_membership_bench(cfg, progress=progress)
    if args.json:
        print_json(result)
        return 0
    rows = [
        ("detect (lease expiry seen)", format_seconds(result["detect_p50_s"]),
         format_seconds(result["detect_p99_s"])),
        ("new epoch published", format_seconds(result["epoch_p50_s"]),
         format_seconds(result["epoch_p99_s"])),
        ("gloo rebuild (slowest survivor)", format_seconds(result["rebuild_p50_s"]),
         format_seconds(result["rebuild_p99_s"])),
        ("all survivors verified", format_seconds(result["ready_p50_s"]),
         format_seconds(result["ready_p99_s"])),
    ]
    print(f"membership recovery: {result['members']} members, {result['trials']} SIGKILLs, "
          f"lease TTL {result['ttl_s']} s (times from the kill)")
    print(render_table(["phase", "p50", "p99"], rows))
    verdict = "met" if result["goal_met"] else "NOT met"
    print(f"goal: new epoch within TTL + 0.5 s = {result['goal_epoch_p99_s']:.1f} s at p99: "
          f"{verdict}; leases left after exit: {result['leases_left']}")
    return 0
