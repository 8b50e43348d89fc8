"""What the runtime's source checks cost (a benchmark, not a test).

    .venv/bin/python benchmarks/bench_digest.py [--mib 256] [--repeat 5] [--device cpu|cuda] [--json]

``publish`` digests every source buffer (and each replica region it shares) before any
byte moves, and a source digests its buffers again after its sends. This times that
digest on one buffer of ``--mib`` MiB against a plain copy of the same bytes (the cheapest
thing a real snapshot could be), side by side in one process, median of ``--repeat``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from elastic_refit.cli._output import render_table
from elastic_refit.transport.buffers import buffer_digests


def _time(fn, device: torch.device, repeat: int) -> float:
    fn()  # warm-up (allocations, kernels)
    out = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="buffer size in MiB (default 256)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs of each (default 5)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.mib < 1 or args.repeat < 1:
        parser.error("--mib and --repeat must be >= 1")
    device = torch.device(args.device)
    nbytes = args.mib << 20
    buffer = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=device).view(torch.bfloat16)
    spare = torch.empty_like(buffer)
    digest_s = _time(lambda: buffer_digests({"w": buffer}), device, args.repeat)
    copy_s = _time(lambda: spare.copy_(buffer), device, args.repeat)
    out = {"device": str(device), "bytes": nbytes, "repeat": args.repeat,
           "digest_seconds": digest_s, "digest_GBps": nbytes / digest_s / 1e9,
           "copy_seconds": copy_s, "copy_GBps": nbytes / copy_s / 1e9, "digest_vs_copy": digest_s / copy_s}
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    rows = [("digest (buffer_digests)", f"{digest_s * 1e3:.1f} ms", f"{out['digest_GBps']:.2f}", f"{digest_s / copy_s:.2f}x"),
            ("plain copy", f"{copy_s * 1e3:.1f} ms", f"{out['copy_GBps']:.2f}", "1.00x")]
    print(f"{args.mib} MiB on {device}, median of {args.repeat}")
    print(render_table(("operation", "time", "GB/s", "vs copy"), rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
