"""`elastic-refit bench control-plane`: many simulated members on one real etcd, no bytes moved."""

from __future__ import annotations

import argparse

from elastic_refit.cli._output import (
    format_bytes,
    format_seconds,
    print_json,
    progress,
    render_table,
)

__all__ = ["register"]


def register(targets: argparse._SubParsersAction) -> None:
    """Add ``bench control-plane`` to the ``bench`` sub-commands."""
    parser = targets.add_parser(
        "control-plane",
        help="simulated members (real leases, watches, epochs, attempts, acks, commits) on one etcd: "
             "commit rounds, epoch convergence after a SIGKILL, idle etcd requests, db size")
    parser.add_argument("--members", type=int, default=1024, help="members in all (default 1024)")
    parser.add_argument("--versions", type=int, default=5, help="commit rounds to time (default 5)")
    parser.add_argument("--kills", type=int, default=1, help="members SIGKILLed one after another (default 1)")
    parser.add_argument("--processes", type=int, default=4,
                        help="worker processes the members are spread over (default 4)")
    parser.add_argument("--trainers", type=int, default=0, help="trainers among the members (default: 1 per 16)")
    parser.add_argument("--ttl", type=int, default=2, help="lease TTL in seconds (default 2)")
    parser.add_argument("--join-rate", type=float, default=32.0,
                        help="members joining per second at start-up, job-wide (default 32; 0: all at once)")
    parser.add_argument("--idle", type=float, default=5.0,
                        help="seconds the etcd requests of the idle job are counted (default 5; 0 skips it)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    import logging
    import sys

    from elastic_refit.log import configure_logging
    from elastic_refit.testing.control_plane import ControlPlaneConfig, run_control_plane

    # stdout stays the table or the JSON object; the members log only warnings and errors
    configure_logging(json=True, stream=sys.stderr, level=logging.WARNING)
    cfg = ControlPlaneConfig(num_members=args.members, num_versions=args.versions, num_kills=args.kills,
                             num_processes=args.processes, num_trainers=args.trainers, ttl_s=args.ttl,
                             idle_s=args.idle, join_rate=args.join_rate)
    result = run_control_plane(cfg, progress=progress)
    ok = not result["members_lost"] and not result["num_errors"] and result["kill_seen_by_all"]
    if args.json:
        print_json(result)
        return 0 if ok else 1
    conv_goal, round_goal = result["goal_epoch_convergence_s"], result["goal_commit_round_s"]

    def verdict(value: float, goal: float) -> str:
        return "met" if value <= goal else "NOT met"

    rows = [
        ("commit round (publish -> commit seen by all)", format_seconds(result["commit_round_p50_s"]),
         format_seconds(result["commit_round_p99_s"]), f"<= {round_goal:.1f} s",
         verdict(result["commit_round_p99_s"], round_goal)),
    ]
    if result["kills"]:
        rows.append(("epoch convergence (kill -> new epoch seen by all)",
                     format_seconds(result["epoch_convergence_p50_s"]),
                     format_seconds(result["epoch_convergence_p99_s"]), f"<= {conv_goal:.1f} s",
                     verdict(result["epoch_convergence_p99_s"], conv_goal)))
    print(f"control plane: {result['members']} members ({result['trainers']} trainers) in "
          f"{result['processes']} processes, lease TTL {result['ttl_s']} s, {result['versions']} versions, "
          f"{result['kills']} SIGKILLs")
    print(render_table(["", "p50", "p99", "goal", ""], rows))
    methods = ", ".join(f"{m} {r:.3f}" for m, r in result["etcd_requests_by_method"].items())
    print(f"idle member: {result['etcd_requests_per_s_per_member']:.3f} etcd requests/s ({methods or 'none'}); "
          f"etcd db {format_bytes(result['etcd_db_bytes'])}, {result['etcd_keys_final']} keys at the end; "
          f"start-up {result['startup_s']:.1f} s")
    if not ok:
        print(f"PROBLEMS: members lost {result['members_lost'][:10]}, {result['num_errors']} errors "
              f"{result['errors'][:3]}")
    return 0 if ok else 1
