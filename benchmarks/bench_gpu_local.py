"""Single-device refit benchmark: the plan with all virtual ranks on one GPU, against the
gather-and-broadcast refit emulated on the same GPU, in the same run.

Every rank's buffers live on one device. The reshard packs each bucket with one kernel
launch, copies it once (the wire) and unpacks it; the baseline assembles every tensor whole
and copies it whole to every destination rank holding part of it. Both are verified
bit-exactly against the deterministic pattern. A plain device-to-device copy of the same
bytes is timed beside them as the bandwidth reference.

    python benchmarks/bench_gpu_local.py --model qwen3-30b-a3b --layers 8 \\
        --source tp=2,pp=2,ep=2 --destination tp=2,dp=2 --repeat 5 [--json] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic_refit.cli._output import format_bytes, format_seconds, render_table
from elastic_refit.layout.refit import model_refit_spec
from elastic_refit.plan import PlanOptions, make_plan
from elastic_refit.testing.local_transport import GatherBroadcastLocal, LocalTransport
from elastic_refit.testing.pattern import allocate, byte_view, check_pieces, fill_pieces


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeat: int) -> list[float]:
    fn()  # warm-up: kernel compilation, allocator
    _sync(device)
    out = []
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--source", default="tp=2,pp=2,ep=2")
    parser.add_argument("--destination", default="tp=2,dp=2")
    parser.add_argument("--domain-size", type=int, default=4)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--direct-min-kib", type=int, default=None,
                        help="runs contiguous on both sides and at least this large are copied directly "
                             "(default: 16384 on GPU, where launches cost more than small copies; 256 on CPU)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--pack-backend", default="auto")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    spec = model_refit_spec(args.model, args.source, args.destination, domain_size=args.domain_size,
                            num_layers=args.layers)
    direct_kib = args.direct_min_kib if args.direct_min_kib is not None else (16384 if device.type == "cuda" else 256)
    plan = make_plan(spec.source, spec.destination, spec.topology,
                     PlanOptions(bucket_bytes=args.bucket_mib << 20, direct_min_bytes=direct_kib << 10))
    ranks = sorted(set(plan.source.ranks) | set(plan.destination.ranks))
    print(f"allocating {format_bytes(plan.source.nbytes + plan.destination.nbytes)} on {device} ...",
          file=sys.stderr, flush=True)
    buffers = {}
    for r in ranks:
        src = allocate(plan.source, r, fill=0, device=device)
        fill_pieces(plan.source, r, src, seed=11)
        buffers[r] = (src, allocate(plan.destination, r, fill=0x5A, device=device))

    def verify() -> bool:
        ok = all(not check_pieces(plan.destination, r, dst, seed=11, limit=1) for r, (_, dst) in buffers.items())
        for _, dst in buffers.values():  # reset so the next method starts from scratch
            for t in dst.values():
                byte_view(t).fill_(0x5A)
        return ok

    print("building the local transport ...", file=sys.stderr, flush=True)
    reshard = LocalTransport(plan, device, pack_backend=args.pack_backend)
    baseline = GatherBroadcastLocal(plan, device)
    results = {}
    for name, runner in (("reshard", reshard), ("gather_broadcast", baseline)):
        print(f"timing {name} ...", file=sys.stderr, flush=True)
        times = _time(lambda runner=runner: runner.run(buffers), device, args.repeat)
        results[name] = {"seconds": statistics.median(times), "min_seconds": min(times),
                         "bytes": runner.bytes_moved, "verified": verify()}
    copy_bytes = reshard.bytes_moved
    src_bytes = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst_bytes = torch.empty_like(src_bytes)
    copy_times = _time(lambda: dst_bytes.copy_(src_bytes), device, args.repeat)
    copy_seconds = statistics.median(copy_times)

    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": args.model, "layers": args.layers, "source": args.source, "destination": args.destination,
        "num_ranks": len(ranks), "model_bytes": plan.stats.model_bytes, "dst_bytes": plan.stats.dst_bytes,
        "reshard": results["reshard"], "gather_broadcast": results["gather_broadcast"],
        "copy_GBps": copy_bytes / copy_seconds / 1e9,
        "reshard_GBps": results["reshard"]["bytes"] / results["reshard"]["seconds"] / 1e9,
        "gather_broadcast_GBps": results["gather_broadcast"]["bytes"] / results["gather_broadcast"]["seconds"] / 1e9,
        "speedup": results["gather_broadcast"]["seconds"] / results["reshard"]["seconds"],
        "num_transfers": len(reshard.transfers),
        "num_direct_transfers": sum(t.direct is not None for t in reshard.transfers),
        "direct_min_bytes": plan.options.direct_min_bytes,
        "verified": results["reshard"]["verified"] and results["gather_broadcast"]["verified"],
    }
    summary["reshard_fraction_of_copy"] = summary["reshard_GBps"] / summary["copy_GBps"]
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    rows = []
    for name in ("reshard", "gather_broadcast"):
        r = results[name]
        rows.append((name, format_seconds(r["seconds"]), format_bytes(r["bytes"]),
                     f"{r['bytes'] / r['seconds'] / 1e9:.1f}", "yes" if r["verified"] else "NO"))
    rows.append(("d2d copy (reshard bytes)", format_seconds(copy_seconds), format_bytes(copy_bytes),
                 f"{summary['copy_GBps']:.1f}", "-"))
    print(f"{summary['device']}: {args.model} {args.layers} layers, {args.source} -> {args.destination}, "
          f"{len(ranks)} virtual ranks, model {format_bytes(plan.stats.model_bytes)}")
    print(render_table(("method", "median", "bytes", "GB/s", "verified"), rows))
    print(f"speedup {summary['speedup']:.2f}x; reshard at {summary['reshard_fraction_of_copy']:.0%} of copy bandwidth")
    return 0


if __name__ == "__main__":
    sys.exit(main())
