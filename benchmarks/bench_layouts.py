"""Time building the full-scale preset layouts (a benchmark, not a test).

    .venv/bin/python benchmarks/bench_layouts.py [--repeat 5] [--json]

Prints, per layout, pieces, buffers, ranks and the best / median build time of
``--repeat`` builds (a fresh build each time: presets keep no cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from elastic_refit.layout.presets import megatron_layout, vllm_layout

CASES = [
    ("qwen3-235b-a22b", "megatron", "tp=4,pp=8,ep=16,dp=4", 0),
    ("qwen3-235b-a22b", "vllm", "tp=8,dp=16", 128),
    ("deepseek-v3", "megatron", "pp=16,ep=16,dp=16", 0),
    ("deepseek-v3", "vllm", "tp=32,dp=8", 256),
]
BUILDERS = {"megatron": megatron_layout, "vllm": vllm_layout}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="builds per layout (default 5)")
    parser.add_argument("--json", action="store_true", help="one JSON object per layout")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    rows = []
    for model, framework, par, first_rank in CASES:
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            layout = BUILDERS[framework](model, par, first_rank=first_rank)
            times.append(time.perf_counter() - start)
        rows.append({
            "model": model, "framework": framework, "parallelism": par, "first_rank": first_rank,
            "num_ranks": len(layout.ranks), "num_tensors": len(layout.tensors), "num_buffers": layout.num_buffers,
            "num_pieces": layout.num_pieces, "best_seconds": min(times),
            "median_seconds": statistics.median(times),
        })
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(f"{'model':<16} {'framework':<9} {'parallelism':<22} {'ranks':>5} {'pieces':>8} "
          f"{'buffers':>8} {'best s':>7} {'median s':>8}")
    for r in rows:
        print(f"{r['model']:<16} {r['framework']:<9} {r['parallelism']:<22} {r['num_ranks']:>5} "
              f"{r['num_pieces']:>8} {r['num_buffers']:>8} {r['best_seconds']:>7.3f} {r['median_seconds']:>8.3f}")


if __name__ == "__main__":
    main()
