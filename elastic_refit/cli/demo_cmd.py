"""`elastic-refit demo`: a real elastic job on this machine, with faults, and its summary."""

from __future__ import annotations

import argparse

from elastic_refit.cli._output import (
    format_bytes,
    format_seconds,
    print_json,
    progress,
    render_table,
)

__all__ = ["register", "render_summary", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="run a local elastic job (etcd, trainers, inference), kill ranks mid-refit, show recovery",
        description="Start a real etcd, 2 trainer replicas and TP=2 inference replicas (CPU, gloo); "
                    "refit several versions while one inference rank and one trainer rank are SIGKILLed "
                    "mid-transfer; the killed inference rank restarts and catches up from its peers.")
    parser.add_argument("--versions", type=int, default=6, help="versions to publish (default 6)")
    parser.add_argument("--inference", type=int, default=4,
                        help="inference ranks, replicas of TP=2 (even, >= 4; default 4)")
    parser.add_argument("--no-faults", action="store_true", help="do not kill anything")
    parser.add_argument("--log-dir", help="keep every member's JSON log in this directory")
    parser.add_argument("--trace", metavar="FILE",
                        help="write a Chrome / Perfetto trace of the run (as `elastic-refit timeline` does)")
    parser.add_argument("--timeout", type=float, default=90.0, help="give up after this many seconds")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit status 0 only if every version committed, recovered and verified."""
    import logging
    import shutil
    import tempfile

    from elastic_refit.chaos.demo import DemoConfig, run_demo
    from elastic_refit.log import configure_logging

    # The demo's own narrative is the progress on stderr; the parent's library events
    # (etcd start/stop) only matter when something goes wrong. Members log to files.
    configure_logging(level=logging.WARNING)

    kill_inference = None if args.no_faults else min(3, args.versions)
    kill_trainer = None if args.no_faults else min(5, args.versions)
    # The trace is built from the member logs: keep them (in a temporary folder if not asked to).
    log_dir = args.log_dir or (tempfile.mkdtemp(prefix="elastic-refit-demo-") if args.trace else None)
    config = DemoConfig(num_versions=args.versions, num_inference=args.inference, kill_inference_at=kill_inference,
                        kill_trainer_at=kill_trainer, timeout_s=args.timeout, log_dir=log_dir)
    summary = run_demo(config, progress=progress)
    data = summary.to_json()
    if args.trace:
        from elastic_refit.cli.timeline_cmd import write_trace

        data["trace"] = write_trace([log_dir], args.trace)
        progress(f"trace written to {args.trace} ({data['trace']['num_trace_events']} events): "
                 "open it at ui.perfetto.dev")
        if args.log_dir is None and data["verified"] and data["recovered"]:
            shutil.rmtree(log_dir, ignore_errors=True)
    if args.json:
        print_json(data)
    else:
        print(render_summary(data))
    ok = (data["num_versions_committed"] == config.num_versions and data["verified"] and data["recovered"])
    return 0 if ok else 1


def render_summary(data: dict) -> str:
    """The human-readable summary: outcome, faults and recovery, bytes."""
    lines = []
    p50 = data["recovery_p50_s"]
    outcome = [
        ("versions committed", f"{data['num_versions_committed']} / {data['num_versions_published']}"),
        ("ranks", f"{data['num_trainers']} trainers (DP replicas) -> {data['num_inference']} inference "
                   f"({data['num_inference'] // 2} x TP=2)"),
        ("epochs / attempts / failed", f"{data['num_epochs']} / {data['num_attempts']} / {data['num_failed_attempts']}"),
        ("faults injected", str(data["num_faults"])),
        ("recovered", "yes" if data["recovered"] else "NO"),
        ("recovery p50 (kill -> next commit)", "-" if p50 is None else format_seconds(p50)),
        ("verified bit-exact", f"{'yes' if data['verified'] else 'NO'} ({data['num_checks']} rank-version checks)"),
        ("torn / lost / hung / leaked", "none" if not data["violations"] else f"{len(data['violations'])} violations"),
        ("wall time", format_seconds(data["wall_s"])),
    ]
    lines.append(render_table(["summary", "value"], outcome))
    if data["faults"]:
        rows = []
        for f in data["faults"]:
            rows.append([f"{f['member_id']} ({f['role']})", f"v{f['version']} {f['phase']}",
                         f"{f['killed_at_s']:.2f} s",
                         "-" if f["committed_version"] is None else f"v{f['committed_version']}",
                         "-" if f["recovery_s"] is None else format_seconds(f["recovery_s"]),
                         "-" if f["caught_up_at_s"] is None
                         else format_seconds(f["caught_up_at_s"] - f["restarted_at_s"])])
        lines.append("")
        lines.append(render_table(["killed", "during", "at", "next commit", "recovery", "restart -> serving"], rows))
    plan, moved = data["plan"], data["moved"]
    gb = plan["gather_broadcast_bytes"]
    net_ratio = gb / max(1, plan["cross_domain_bytes"])
    all_ratio = gb / max(1, plan["cross_domain_bytes"] + plan["intra_domain_bytes"])
    lines.append("")
    lines.append(render_table(["bytes", "reshard", "gather+broadcast"], [
        ["one refit, network", format_bytes(plan["cross_domain_bytes"]), format_bytes(plan["gather_broadcast_bytes"])],
        ["one refit, intra-domain", format_bytes(plan["intra_domain_bytes"]), "-"],
        ["one refit, lower bound", format_bytes(plan["lower_bound_bytes"]), "-"],
        ["whole run, received", format_bytes(moved["network_recv_bytes"] + moved["intra_recv_bytes"]),
         format_bytes(moved["gather_broadcast_bytes"])],
    ]))
    lines.append(f"\nper refit, reshard sends {net_ratio:.2f}x fewer bytes across domains than gather-and-broadcast "
                 f"moves in all ({all_ratio:.2f}x fewer counting intra-domain copies too)")
    if data["committed"]:
        lines.append("")
        lines.append(render_table(["version", "epoch", "committed at", "digest"], [
            [f"v{c['version']}", c["epoch"], f"{c['at_s']:.2f} s", c["digest"][:12]] for c in data["committed"]]))
    for e in data["errors"] + data["problems"] + data["violations"]:
        lines.append(f"! {e}")
    return "\n".join(lines)
