"""`elastic-refit bench soak`: many versions through one job; nothing may grow with them."""

from __future__ import annotations

import argparse

from elastic_refit.cli._output import format_seconds, print_json, progress, render_table

__all__ = ["register"]


def register(targets: argparse._SubParsersAction) -> None:
    """Add ``bench soak`` to the ``bench`` sub-commands."""
    parser = targets.add_parser(
        "soak", help="publish many versions through a real job (2 trainers, 4 inference ranks); "
                     "per-version overhead, etcd keys and member memory, first against last")
    parser.add_argument("--versions", type=int, default=20_000, help="versions to publish (default 20000)")
    parser.add_argument("--window", type=int, default=1_000,
                        help="versions averaged at the start and at the end (default 1000, at most half)")
    parser.add_argument("--block", type=int, default=100,
                        help="versions per turn while the long job's last window and a fresh reference job "
                             "take turns (default 100)")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="no reference job: the last window is compared with the first only")
    parser.add_argument("--etcd-compaction", default="periodic:10s", metavar="MODE:RETENTION",
                        help="the soak's etcd auto-compaction (default periodic:10s: at ~10 versions a second, "
                             "as many versions of history as minutes hold in a real job; revision:10000 is the "
                             "tests' default)")
    parser.add_argument("--idle", type=float, default=10.0,
                        help="seconds the members then stay idle in the job while their etcd requests are "
                             "counted (default 10; 0 skips it)")
    parser.add_argument("--timeout", type=float, default=7_200.0, help="give up after this many seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=_run)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / (1 << 20):.1f} MiB"


def _seconds_or_dash(value: float | None) -> str:
    return "-" if value is None else format_seconds(value)


def _compaction(text: str) -> tuple[str, str]:
    mode, _, retention = text.partition(":")
    if mode not in ("revision", "periodic") or not retention:
        raise ValueError(f"--etcd-compaction must be revision:N or periodic:DURATION (etcd's units, e.g. 10s), "
                         f"got {text!r}")
    return mode, retention


def _run(args: argparse.Namespace) -> int:
    import sys

    from elastic_refit.log import configure_logging
    from elastic_refit.testing.soak import SoakConfig, run_soak

    configure_logging(json=True, stream=sys.stderr)  # stdout stays the table or the JSON object
    result = run_soak(SoakConfig(num_versions=args.versions, window=args.window, idle_s=args.idle,
                                 timeout_s=args.timeout, reference=args.reference, block=args.block,
                                 etcd_compaction=_compaction(args.etcd_compaction)),
                      progress=progress)
    ok = result["verified"] == result["versions"] and result.get("reference_verified", 0) == result.get(
        "reference_versions", 0)
    if args.json:
        print_json(result)
        return 0 if ok else 1
    w = result["window"]
    rows = [
        ("per-version overhead", format_seconds(result["first_overhead_s"]), format_seconds(result["last_overhead_s"]),
         f"{result['overhead_ratio']:.2f}"),
        ("CPU per version (members, etcd)", _seconds_or_dash(result.get("first_cpu_s_per_version")),
         _seconds_or_dash(result.get("last_cpu_s_per_version")),
         "-" if result.get("cpu_ratio") is None else f"{result['cpu_ratio']:.2f}"),
        ("member memory (largest)", _mib(result["member_rss_first_bytes"]), _mib(result["member_rss_last_bytes"]), "-"),
        ("etcd db", _mib(result["etcd_db_bytes_first"]), _mib(result["etcd_db_bytes_last"]), "-"),
    ]
    if "reference_overhead_s" in result:
        rows += [
            ("per-version overhead, fresh job, same time", format_seconds(result["reference_overhead_s"]),
             format_seconds(result["last_overhead_s"]), f"{result['overhead_ratio_same_time']:.2f}"),
            ("CPU per version, fresh job, same time", _seconds_or_dash(result.get("reference_cpu_s_per_version")),
             _seconds_or_dash(result.get("last_cpu_s_per_version")),
             "-" if result.get("cpu_ratio_same_time") is None else f"{result['cpu_ratio_same_time']:.2f}"),
        ]
    print(f"soak: {result['versions']} versions, 2 trainers, 4 inference ranks "
          f"(overheads: mean of the first and last {w}; 'fresh job, same time': a new job's first {w}, "
          f"in turns with the last {w})")
    print(render_table(["", "first", "last", "last/first"], rows))
    print(f"etcd keys of the job: at most {result['etcd_keys_max']}, {result['etcd_keys_final']} at the end; "
          f"verified {result['verified']} of {result['versions']} versions, {result['problems']} problems")
    by_first, by_last = result["first_cpu_s_per_version_by_process"], result["last_cpu_s_per_version_by_process"]
    by_reference = result.get("reference_cpu_s_per_version_by_process", {})
    if by_last:
        print(render_table(["CPU per version", "first", "last", "fresh job, same time", "last/fresh"],
                           [(name, _seconds_or_dash(by_first.get(name)), _seconds_or_dash(rate),
                             _seconds_or_dash(by_reference.get(name)),
                             f"{rate / by_reference[name]:.2f}" if by_reference.get(name) else "-")
                            for name, rate in by_last.items()]))
    if "reference_versions" in result:
        print(f"reference job: verified {result['reference_verified']} of {result['reference_versions']} versions, "
              f"{result['reference_problems']} problems")
    slope = result.get("member_rss_second_half_slope_bytes_per_1000_versions")
    if slope is not None:
        print(f"member memory, second half (steepest member): {slope / 2**20:+.2f} MiB per 1,000 versions "
              f"({result['member_rss_second_half_growth'] * 100:+.1f}% from the middle to the end)")
    if "etcd_requests_per_version" in result:
        print(f"etcd requests: {result['etcd_requests_per_version']:.1f} per version (all members, the whole run); "
              f"etcd auto-compaction {result['etcd_compaction']}")
    if "idle_requests_per_member_s" in result:
        methods = ", ".join(f"{m} {r:.2f}" for m, r in result["idle_requests_by_method"].items())
        print(f"idle member: {result['idle_requests_per_member_s']:.2f} etcd requests/s over "
              f"{result['idle_seconds']:.0f} s ({methods or 'none'})")
    return 0 if ok else 1
