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
    parser.add_argument("--log-dir", help="put every member's JSON log in this folder (default: a new temporary "
                                          "folder); the logs are kept, and the summary says where")
    parser.add_argument("--trace", metavar="FILE",
                        help="write a Chrome / Perfetto trace of the run (as `elastic-refit timeline` does)")
    parser.add_argument("--timeout", type=float, default=90.0, help="give up after this many seconds")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit status 0 only if every version committed, recovered and verified."""
    import logging

    from elastic_refit.chaos.demo import DemoConfig, run_demo
    from elastic_refit.log import configure_logging

    # The demo's own narrative is the progress on stderr; the parent's library events
    # (etcd start/stop) only matter when something goes wrong. Members log to files.
    configure_logging(level=logging.WARNING)

    kill_inference = None if args.no_faults else min(3, args.versions)
    kill_trainer = None if args.no_faults else min(5, args.versions)
    config = DemoConfig(num_versions=args.versions, num_inference=args.inference, kill_inference_at=kill_inference,
                        kill_trainer_at=kill_trainer, timeout_s=args.timeout, log_dir=args.log_dir)
    summary = run_demo(config, progress=progress)
    data = summary.to_json()
    if args.trace:  # built from the member logs, which the demo keeps
        from elastic_refit.cli.timeline_cmd import write_trace

        data["trace"] = write_trace([data["log_dir"]], args.trace)
        progress(f"trace written to {args.trace} ({data['trace']['num_trace_events']} events): "
                 "open it at ui.perfetto.dev")
    if args.json:
        print_json(data)
    else:
        print(render_summary(data))
    ok = (data["num_versions_committed"] == config.num_versions and data["verified"] and data["recovered"])
    return 0 if ok else 1


# Each term the summary uses, defined once, in the order it first appears.
TERMS = (
    ("domain", "ranks that copy among themselves without the network (an NVLink domain; here: "
               "the trainers are one, the inference ranks another)"),
    ("TP=2 replica", "two inference ranks that hold one copy of the model between them (tensor parallel)"),
    ("version", "the weights after one training step; committed once every live inference rank holds it, "
                "checked"),
    ("epoch", "one generation of the job's membership: every kill, restart or join starts a new one"),
    ("attempt", "one try at moving a version within an epoch; a fault fails it and the next epoch retries"),
    ("recovery", "from a kill to the next version committed without the killed rank"),
    ("reshard", "this library's refit: each destination gets only its shard's intersections, each byte "
                "once across domains"),
    ("gather-and-broadcast", "the classic refit: every tensor gathered whole, then broadcast whole to every "
                             "inference rank"),
    ("lower bound", "the fewest bytes any refit must send across domains: what a domain needs and does not "
                    "hold"),
)


def render_summary(data: dict) -> str:
    """The human-readable summary: the model, when things happened (one clock: seconds since
    the job started, start-up apart from the refits), faults and recovery, bytes, terms."""
    plan = data["plan"]
    lines = [f"model: {plan['num_tensors']} tensors, {plan['num_parameters']:,} parameters, "
             f"{format_bytes(plan['model_bytes'])} ({', '.join(plan['dtypes'])}); times below are seconds since "
             f"the job started",
             "", render_table(["summary", "value"], _outcome_rows(data))]
    if data["faults"]:
        lines += ["", render_table(["killed", "during", "killed at", "next commit", "recovery", "kill -> serving again"],
                                   _fault_rows(data["faults"]))]
    lines += ["", *_bytes_lines(data)]
    if data["committed"]:
        lines += ["", render_table(["version", "epoch", "committed at", "digest"], [
            [f"v{c['version']}", c["epoch"], f"{c['at_s']:.2f} s", c["digest"][:12]] for c in data["committed"]])]
    lines += ["", "terms:", *(f"  {term}: {meaning}" for term, meaning in TERMS)]
    lines.append(f"\nmember logs: {data['log_dir']} (`elastic-refit timeline {data['log_dir']} -o trace.json` "
                 f"draws them)")
    lines += [f"! {e}" for e in data["errors"] + data["problems"] + data["violations"]]
    return "\n".join(lines)


def _at(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def _outcome_rows(data: dict) -> list[tuple[str, str]]:
    p50 = data["recovery_p50_s"]
    startup, first, last = data.get("startup_s"), data.get("first_proposal_s"), data.get("last_commit_s")
    refits = "-" if first is None or last is None else f"{first:.2f} s -> {last:.2f} s ({last - first:.2f} s)"
    # start-up ends with the first refit: processes, registration, the first epoch and its communicator
    ready = "-" if first is None else f"0 -> {first:.2f} s (every member registered at {_at(startup)})"
    return [
        ("versions committed", f"{data['num_versions_committed']} / {data['num_versions_published']}"),
        ("ranks", f"{data['num_trainers']} trainers (replicas, one domain) -> {data['num_inference']} inference "
                  f"({data['num_inference'] // 2} TP=2 replicas, another domain)"),
        ("start-up (etcd, processes, joining)", ready),
        ("refits (first proposed -> last committed)", refits),
        ("epochs / attempts / failed attempts",
         f"{data['num_epochs']} / {data['num_attempts']} / {data['num_failed_attempts']}"),
        ("faults injected", str(data["num_faults"])),
        ("recovered", "yes" if data["recovered"] else "NO"),
        ("recovery p50 (kill -> next commit)", "-" if p50 is None else format_seconds(p50)),
        ("verified bit-exact", f"{'yes' if data['verified'] else 'NO'} ({data['num_checks']} rank-version checks)"),
        ("torn / lost / hung / leaked", "none" if not data["violations"] else f"{len(data['violations'])} violations"),
        ("ended at (members stopped, etcd down)", _at(data["wall_s"])),
    ]


def _fault_rows(faults: list[dict]) -> list[list[str]]:
    return [[f"{f['member_id']} ({f['role']})", f"v{f['version']} {f['phase']}", _at(f["killed_at_s"]),
             "-" if f["committed_version"] is None else f"v{f['committed_version']} at {_at(f['recovered_at_s'])}",
             "-" if f["recovery_s"] is None else format_seconds(f["recovery_s"]),
             "- (not restarted)" if not f["restarted"] else
             "NO" if f.get("serving_again_s") is None else format_seconds(f["serving_again_s"])]
            for f in faults]


def _bytes_lines(data: dict) -> list[str]:
    plan, moved = data["plan"], data["moved"]
    gb = plan["gather_broadcast_bytes"]
    net_ratio = gb / max(1, plan["cross_domain_bytes"])
    all_ratio = gb / max(1, plan["cross_domain_bytes"] + plan["intra_domain_bytes"])
    return [render_table(["bytes", "reshard", "gather-and-broadcast"], [
        ["one refit, across domains", format_bytes(plan["cross_domain_bytes"]), format_bytes(gb)],
        ["one refit, within the domain", format_bytes(plan["intra_domain_bytes"]), "-"],
        ["one refit, lower bound", format_bytes(plan["lower_bound_bytes"]), "-"],
        ["whole run, received", format_bytes(moved["network_recv_bytes"] + moved["intra_recv_bytes"]),
         format_bytes(moved["gather_broadcast_bytes"])],
    ]), f"per refit, the reshard sends {net_ratio:.2f}x fewer bytes across domains than gather-and-broadcast "
        f"moves in all ({all_ratio:.2f}x fewer counting the copies within the domain too)"]
