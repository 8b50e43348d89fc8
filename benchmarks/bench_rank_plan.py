"""One rank's layouts from symbolic rules (issue 40): build, fingerprint, derive the rank's
pieces, and the JSON size of the rules, at 8,192 and 65,536 GPUs of Kimi-K2.

    .venv/bin/python benchmarks/bench_rank_plan.py [--rank R] [--sizes 256,2048]

Each size runs in a fresh process (peak RSS is per process). The per-rank plan from
symbolic layouts is not built yet (next step of issue 40): ``plan --rank`` still plans from
explicit layouts.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import zlib


def one(dp: int, rank: int) -> dict:
    from elastic_refit.layout.symbolic_presets import megatron_symbolic, vllm_symbolic

    out: dict = {"gpus": 2 * 16 * dp, "rank": rank}
    t0 = time.perf_counter()
    src = megatron_symbolic("kimi-k2", f"pp=16,ep=64,dp={dp}")
    dst = vllm_symbolic("kimi-k2", f"tp=16,dp={dp}", first_rank=16 * dp)
    out["build_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out["fingerprints"] = [src.fingerprint, dst.fingerprint]
    out["fingerprint_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    mine = (src if rank < 16 * dp else dst).layout_of_ranks([rank])
    out["derive_seconds"] = time.perf_counter() - t0
    out["rank_pieces"] = mine.num_pieces
    for side, layout in (("source", src), ("destination", dst)):
        rules = json.dumps([[b.to_json() for b in layout.buffers], [r.to_json() for r in layout.rules]]).encode()
        out[f"{side}_rules_zlib_bytes"] = len(zlib.compress(rules, 6))
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=5000)
    parser.add_argument("--sizes", default="256,2048", help="dp of both sides (256: 8,192 GPUs; 2048: 65,536)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.rank)))
        return 0
    for dp in (int(s) for s in args.sizes.split(",")):
        result = subprocess.run([sys.executable, __file__, "--one", str(dp), "--rank", str(args.rank)],
                                capture_output=True, text=True, check=True)
        print(result.stdout.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
