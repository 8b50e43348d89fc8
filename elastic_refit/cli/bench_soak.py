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


def _run(args: argparse.Namespace) -> int:
    import sys

    from elastic_refit.log import configure_logging
    from elastic_refit.testing.soak import SoakConfig, run_soak

    configure_logging(json=True, stream=sys.stderr)  # stdout stays the table or the JSON object
    result = run_soak(SoakConfig(num_versions=args.versions, window=args.window, idle_s=args.idle,
                                 timeout_s=args.timeout),
                      progress=progress)
    if args.json:
        print_json(result)
        return 0 if result["verified"] == result["versions"] else 1
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
    print(f"soak: {result['versions']} versions, 2 trainers, 4 inference ranks "
          f"(overheads: mean of the first and last {w})")
    print(render_table(["", "first", "last", "last/first"], rows))
    print(f"etcd keys of the job: at most {result['etcd_keys_max']}, {result['etcd_keys_final']} at the end; "
          f"verified {result['verified']} of {result['versions']} versions, {result['problems']} problems")
    if result.get("machine_slowdown") is not None:
        print(f"the machine itself, last window against first: {result['machine_slowdown']:.2f}x "
              f"(calibration workload); overhead ratio net of it "
              f"{result['overhead_ratio_machine_adjusted']:.2f}")
    slope = result.get("member_rss_second_half_slope_bytes_per_1000_versions")
    if slope is not None:
        print(f"member memory, second half (steepest member): {slope / 2**20:+.2f} MiB per 1,000 versions "
              f"({result['member_rss_second_half_growth'] * 100:+.1f}% from the middle to the end)")
    if "etcd_requests_per_version" in result:
        print(f"etcd requests: {result['etcd_requests_per_version']:.1f} per version (all members, the whole run)")
    if "idle_requests_per_member_s" in result:
        methods = ", ".join(f"{m} {r:.2f}" for m, r in result["idle_requests_by_method"].items())
        print(f"idle member: {result['idle_requests_per_member_s']:.2f} etcd requests/s over "
              f"{result['idle_seconds']:.0f} s ({methods or 'none'})")
    return 0 if result["verified"] == result["versions"] else 1
