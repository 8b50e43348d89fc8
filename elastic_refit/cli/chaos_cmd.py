"""`elastic-refit chaos`: run the fault matrix against a real etcd and local processes."""

from __future__ import annotations

import argparse

from elastic_refit.cli._output import print_json, progress, render_table

__all__ = ["register", "render_summary", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chaos", help="kill, stop, slow and restart ranks (and etcd) at every refit phase; check invariants",
        description="Run the chaos matrix (victim x fault x phase) against a real etcd and local member "
                    "processes (2 trainer replicas, inference replicas, tiny tensors); the oracle checks "
                    "members' logs and etcd: no torn, lost or hung version, nothing leaked.")
    parser.add_argument("--matrix", choices=("quick", "full", "none"), default="quick",
                        help="quick: one trial per key cell (CI); full: every cell, repeated; none: nothing "
                             "dies (no fault, or a slow rank) on a loaded machine, fails if any member is fenced "
                             "(default quick)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="none: run trials for this long (default: --trials, 20)")
    parser.add_argument("--burn", type=int, default=None,
                        help="CPU burner processes for the whole run (default: one per core with --matrix none, "
                             "else 0)")
    parser.add_argument("--ttl", type=int, default=None,
                        help="the members' lease TTL in seconds (default: RefitConfig's); the fault durations "
                             "stay those of the default TTL, so use it with --matrix none")
    parser.add_argument("--trials", type=int, default=None,
                        help="number of trials (full: default 200; quick: at most this many)")
    parser.add_argument("--faults", default=None,
                        help="keep only cells of these fault names, comma-separated (e.g. kill or kill+kill,"
                             "restart<ttl); the full matrix repeats them until --trials")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice (default 0)")
    parser.add_argument("--inference", type=int, default=2, help="inference ranks per trial (default 2)")
    parser.add_argument("--etcd-cluster", action="store_true", help="run against a 3-node etcd cluster (adds cells with an etcd member down for the rest of a trial)")
    parser.add_argument("--deadline", type=float, default=60.0, help="a trial past this many seconds is hung")
    parser.add_argument("--keep-logs", action="store_true", help="keep every trial's member logs")
    parser.add_argument("--backend", choices=("gloo", "nccl", "nccl4py"), default="gloo",
                        help="members' communicators: gloo on the CPU (default), or NCCL with every member on "
                             "GPU 0 as a host of its own")
    parser.add_argument("--results", help="append each trial's verdict to this file as a JSON line")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument("--deltas", action="store_true",
                        help="deltas on: every member sets delta_base_bytes (relay off) and each version changes "
                             "~2%% of the one before, so refits go as deltas where a rank holds the latest commit")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Run the matrix; exit status 0 only if every trial passed."""
    import logging
    import os

    from elastic_refit.chaos.faults import build_matrix
    from elastic_refit.chaos.runner import run_matrix
    from elastic_refit.log import configure_logging

    configure_logging(level=logging.WARNING)
    if args.inference < 2:
        raise ValueError(f"--inference must be >= 2 (a replica makes recovery possible), got {args.inference}")
    faults = [f.strip() for f in args.faults.split(",") if f.strip()] if args.faults is not None else None
    if args.minutes is not None and (args.matrix != "none" or args.minutes <= 0):
        raise ValueError(f"--minutes is for --matrix none and must be > 0, got {args.minutes} with {args.matrix}")
    burn = args.burn if args.burn is not None else (os.cpu_count() or 1) if args.matrix == "none" else 0
    if burn < 0:
        raise ValueError(f"--burn must be >= 0, got {burn}")
    trials = args.trials
    if args.minutes is not None and trials is None:
        trials = max(1, int(args.minutes * 60))  # more than fit: the time budget ends the run
    scenarios = build_matrix(args.matrix, trials=trials, seed=args.seed, num_inference=args.inference,
                             etcd_nodes=3 if args.etcd_cluster else 1, faults=faults)
    if args.deltas:
        from elastic_refit.chaos.faults import with_deltas

        scenarios = with_deltas(scenarios)
    if args.ttl is not None:
        from dataclasses import replace

        from elastic_refit.runtime.settings import Timeouts

        Timeouts(ttl_s=args.ttl)  # refused here, naming the value, if no member could run with it
        scenarios = [replace(s, member_config={**(s.member_config or {}), "ttl_s": args.ttl}) for s in scenarios]
    summary = run_matrix(scenarios, progress=progress, deadline_s=args.deadline, keep_logs=args.keep_logs,
                          results_path=args.results, backend=args.backend, cpu_burners=burn,
                          until_s=None if args.minutes is None else args.minutes * 60)
    summary["cpu_burners"] = burn
    summary["ttl_s"] = args.ttl
    if args.json:
        print_json(summary)
    else:
        print(render_summary(summary))
    return 0 if summary["passed"] == summary["trials"] else 1


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render_summary(summary: dict) -> str:
    """The table by victim x fault x phase, then totals and failures."""
    rows = [[c["victim"], c["fault"], c["phase"], c["trials"], c["passed"], c["torn"], c["lost"], c["hung"],
             c["leaked"], c["unsafe"], c["error"], _s(c["recovery_p50_s"]), _s(c["recovery_max_s"])]
            for c in summary["cells"]]
    lines = [render_table(["victim", "fault", "phase", "trials", "passed", "torn", "lost", "hung", "leaked",
                           "unsafe", "error", "rec p50 s", "rec max s"], rows), ""]
    lines.append(render_table(["total", "value"], [
        ["trials / passed", f"{summary['trials']} / {summary['passed']}"],
        ["torn / lost / hung / leaked", f"{summary['torn']} / {summary['lost']} / {summary['hung']} / "
                                        f"{summary['leaked']}"],
        ["unsafe / member errors", f"{summary['unsafe']} / {summary['error']}"],
        ["members fenced / of them live", f"{summary.get('fenced', 0)} / {summary.get('fenced_live', 0)}"],
        ["leases lost / rejoined / rejoin retries", f"{summary.get('leases_lost', 0)} / {summary.get('rejoined', 0)} / "
                                                   f"{summary.get('rejoin_failed', 0)}"],
        ["keepalives late (past the TTL)", summary.get("keepalive_late", 0)],
        ["longest keepalive wait per member p50 / p99 / max", f"{_s(summary.get('keepalive_silence_p50_s'))} / "
                                                           f"{_s(summary.get('keepalive_silence_p99_s'))} / "
                                                           f"{_s(summary.get('keepalive_silence_max_s'))} s"],
        ["versions failed", summary.get("versions_failed", 0)],
        ["recovery p50 / p99 / max", f"{_s(summary['recovery_p50_s'])} / {_s(summary['recovery_p99_s'])} / "
                                     f"{_s(summary['recovery_max_s'])} s"],
        ["wall time", f"{summary['wall_s']:.0f} s"],
    ]))
    for f in summary["failures"]:
        lines.append(f"! {f['name']} (seed {f['seed']}): " + "; ".join(
            f"{v['category']}/{v['check']}: {v['detail']}"[:240] for v in f["violations"][:3])
            + (f" [logs: {f['log_dir']}]" if f.get("log_dir") else ""))
    return "\n".join(lines)
