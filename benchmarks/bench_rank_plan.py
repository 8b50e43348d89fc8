"""One rank's layouts and plan from symbolic rules (issue 40), Kimi-K2 at 8,192 and 65,536 GPUs.

    .venv/bin/python benchmarks/bench_rank_plan.py [--ranks 100,5000,40000] [--sizes 256,2048] [--check]

Training ``pp=16,ep=64,dp=D``, inference ``tp=16,dp=D`` from rank ``16 D`` (D = 256: 8,192
GPUs; 2,048: 65,536), domains of 8. Per (size, rank), in a fresh process (peak RSS is per
process): build both sides' rules, fingerprint them, derive the rank's own pieces, and plan
the rank's view from the rules (``plan.rank_rules``), wall and CPU seconds, peak RSS, the
view's rows and messages, and the rules' encoded sizes (ERL3). ``--check`` also plans the
rank from explicit layouts (``make_rank_plan``: seconds and a gigabyte or more at 8,192 GPUs)
and compares every row, piece by piece.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def one(dp: int, rank: int, check: bool) -> dict:
    from elastic_refit.layout import Topology
    from elastic_refit.layout.encoding import encode_symbolic
    from elastic_refit.layout.symbolic_presets import megatron_symbolic, vllm_symbolic
    from elastic_refit.plan import PlanOptions
    from elastic_refit.plan.rank_rules import make_rank_plan_from_rules

    out: dict = {"gpus": 2 * 16 * dp, "rank": rank}
    c0, t0 = time.process_time(), time.perf_counter()
    src = megatron_symbolic("kimi-k2", f"pp=16,ep=64,dp={dp}")
    dst = vllm_symbolic("kimi-k2", f"tp=16,dp={dp}", first_rank=16 * dp)
    topology = Topology.uniform(32 * dp, 8)
    out["build_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    view = make_rank_plan_from_rules(src, dst, topology, PlanOptions(), rank=rank)
    out["plan_seconds"] = time.perf_counter() - t0  # fingerprints, the pieces it needs, its rows
    out["layouts_plus_plan_cpu_seconds"] = time.process_time() - c0
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.update(rows=len(view.transfers), view_source_pieces=view.source.num_pieces,
               view_destination_pieces=view.destination.num_pieces, fingerprint=view.fingerprint)
    t0 = time.perf_counter()
    mine = (src if rank < 16 * dp else dst).layout_of_ranks([rank])
    out["own_pieces_seconds"], out["own_pieces"] = time.perf_counter() - t0, mine.num_pieces
    out["source_erl3_bytes"], out["destination_erl3_bytes"] = len(encode_symbolic(src)), len(encode_symbolic(dst))
    if check:
        out.update(_check(src, dst, topology, view, rank))
    return out


def _check(src, dst, topology, view, rank: int) -> dict:
    """The rank's plan from explicit layouts, compared row by row (pieces by what they are)."""
    import numpy as np

    from elastic_refit.plan import PlanOptions, make_rank_plan

    t0 = time.perf_counter()
    want = make_rank_plan(src.to_layout(), dst.to_layout(), topology, PlanOptions(), rank=rank)
    seconds = time.perf_counter() - t0
    got_t, want_t = view.transfers, want.transfers
    same = len(got_t) == len(want_t) and view.fingerprint == want.fingerprint
    for name, column in want_t.columns().items():
        if name in ("src_piece", "dst_piece"):
            continue
        same = same and bool(np.array_equal(getattr(got_t, name), column))

    def identity(layout, pieces):
        return [(int(layout.piece_tensor[p]), int(layout.piece_rank[p]), layout.piece_offsets[p].tobytes(),
                 layout.piece_local_offsets[p].tobytes()) if p >= 0 else None for p in pieces.tolist()]

    from_source = want_t.src_side == 0
    for got_side, want_side, column, rows in ((view.source, want.source, "src_piece", from_source),
                                              (view.destination, want.destination, "src_piece", ~from_source),
                                              (view.destination, want.destination, "dst_piece", ...)):
        same = same and identity(got_side, getattr(got_t, column)[rows]) == identity(want_side,
                                                                                     getattr(want_t, column)[rows])
    return {"explicit_seconds": seconds, "equal_to_explicit": bool(same)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="100,5000,40000", help="ranks to plan (those outside a size are skipped)")
    parser.add_argument("--sizes", default="256,2048", help="dp of both sides (256: 8,192 GPUs; 2048: 65,536)")
    parser.add_argument("--check", action="store_true", help="also plan from explicit layouts and compare")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, int(args.ranks), args.check)))
        return 0
    for dp in (int(s) for s in args.sizes.split(",")):
        for rank in (int(r) for r in args.ranks.split(",")):
            if rank >= 32 * dp:
                continue
            command = [sys.executable, __file__, "--one", str(dp), "--ranks", str(rank)] + (["--check"] if args.check
                                                                                             else [])
            print(subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
