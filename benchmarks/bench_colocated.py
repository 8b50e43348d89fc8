"""Colocated refit on one GPU: 4 trainer and 4 inference processes share GPU 0 (it stands for
the GPUs of one host), a Qwen3-30B-A3B cut refit tp2/pp2/ep2 -> tp2/dp2 over CUDA IPC direct
reads, against the same plan over nccl4py and against gather-and-broadcast over nccl4py, in
one run, every byte verified (first run against the pattern, later runs by digest); a plain
device-to-device copy is the ceiling. ``--hosts 2`` runs the hierarchical case: two "hosts"
of 4 processes (2 trainers + 2 inference each), IPC within a host, nccl4py between, and
checks that the bytes each route carried equal the plan's intra / network split.

    python benchmarks/bench_colocated.py --layers 8 --repeat 3 [--hosts 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic_refit.testing.colocated import ColocatedCase, colocated_plan, colocated_rank, summarise
from elastic_refit.testing.processes import nccl_rank_env, run_local_world


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline-repeat", type=int, default=None,
                        help="timed runs of nccl4py and gather_broadcast (default: --repeat); each is slow over "
                             "the socket transport")
    parser.add_argument("--hosts", type=int, default=1, choices=(1, 2))
    parser.add_argument("--methods", default="ipc,nccl4py,gather_broadcast")
    parser.add_argument("--timeout", type=float, default=400.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    # Trainers 0-3, inference 4-7; with two hosts each holds two of each.
    hosts = ("h0",) * 8 if args.hosts == 1 else ("h0", "h0", "h1", "h1", "h0", "h0", "h1", "h1")
    case = ColocatedCase(num_layers=args.layers, hosts=hosts, repeat=args.repeat, baseline_repeat=args.baseline_repeat,
                         methods=tuple(args.methods.split(",")))
    plan = colocated_plan(case)
    print(f"plan: {plan.stats.dst_bytes / 1e9:.2f} GB into destinations, {len(set(hosts))} host(s)",
          file=sys.stderr, flush=True)
    results = run_local_world(colocated_rank, 8, (case,), timeout_s=args.timeout, rank_env=nccl_rank_env)
    failed = [r for r in results if not r.ok]
    if failed:
        for r in failed:
            print(f"rank {r.rank}: {r.error_type} {r.error[:2000]} (exit {r.exitcode})", file=sys.stderr)
        return 1
    summary = summarise(plan, [r.value for r in results])
    summary.update(layers=args.layers, hosts=args.hosts)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"Qwen3-30B-A3B {args.layers} layers tp2pp2ep2 -> tp2dp2, 8 processes on one GPU, "
              f"{args.hosts} host(s): {summary['moved_bytes'] / 1e9:.2f} GB received per refit")
        for m, e in summary["methods"].items():
            verdict = "verified" if not e["problems"] else f"PROBLEMS {e['problems'][:2]}"
            print(f"  {m:18s} {e['seconds'] * 1e3:9.1f} ms  {e['GBps']:8.1f} GB/s  {verdict}")
        if "copy_GBps" in summary:
            print(f"  {'d2d copy':18s} {'':9s}     {summary['copy_GBps']:8.1f} GB/s  (ceiling)")
        if "ipc_fraction_of_copy" in summary:
            print(f"  ipc at {summary['ipc_fraction_of_copy']:.0%} of the copy's bandwidth")
        ipc = summary["methods"].get("ipc", {})
        if "direct_bytes" in ipc:
            print(f"  bytes by route: IPC {ipc['direct_bytes']} (plan intra {summary['plan_intra_recv_bytes']}), "
                  f"nccl4py {ipc['base_bytes']} (plan network {summary['plan_network_recv_bytes']})")
        print(f"  open mappings after close, per rank: {summary['open_mappings_after_close']}")
    ok = all(not e["problems"] for e in summary["methods"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
