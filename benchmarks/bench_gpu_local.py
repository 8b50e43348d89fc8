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


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    return parser.parse_args(argv)


def _make_plan(args: argparse.Namespace, device: torch.device):
    """The plan of the model's refit; direct copies from 16 MiB on GPU, 256 KiB on CPU unless asked."""
    spec = model_refit_spec(args.model, args.source, args.destination, domain_size=args.domain_size,
                            num_layers=args.layers)
    direct_kib = args.direct_min_kib if args.direct_min_kib is not None else (16384 if device.type == "cuda" else 256)
    return make_plan(spec.source, spec.destination, spec.topology,
                     PlanOptions(bucket_bytes=args.bucket_mib << 20, direct_min_bytes=direct_kib << 10))


def _allocate_buffers(plan, ranks: list[int], device: torch.device) -> dict:
    """Every rank's (source, destination) buffers: sources filled with the pattern, destinations 0x5A."""
    print(f"allocating {format_bytes(plan.source.nbytes + plan.destination.nbytes)} on {device} ...",
          file=sys.stderr, flush=True)
    buffers = {}
    for r in ranks:
        src = allocate(plan.source, r, fill=0, device=device)
        fill_pieces(plan.source, r, src, seed=11)
        buffers[r] = (src, allocate(plan.destination, r, fill=0x5A, device=device))
    return buffers


def _verify_and_reset(plan, buffers: dict) -> bool:
    """Whether every destination holds the pattern; then refill them so the next method starts from scratch."""
    ok = all(not check_pieces(plan.destination, r, dst, seed=11, limit=1) for r, (_, dst) in buffers.items())
    for _, dst in buffers.values():  # reset so the next method starts from scratch
        for t in dst.values():
            byte_view(t).fill_(0x5A)
    return ok


def _time_methods(plan, buffers: dict, device: torch.device, args: argparse.Namespace):
    """Time the reshard and the gather-and-broadcast baseline, each verified; returns the
    reshard transport and both results."""
    print("building the local transport ...", file=sys.stderr, flush=True)
    reshard = LocalTransport(plan, device, pack_backend=args.pack_backend)
    baseline = GatherBroadcastLocal(plan, device)
    results = {}
    for name, runner in (("reshard", reshard), ("gather_broadcast", baseline)):
        print(f"timing {name} ...", file=sys.stderr, flush=True)
        times = _time(lambda runner=runner: runner.run(buffers), device, args.repeat)
        results[name] = {"seconds": statistics.median(times), "min_seconds": min(times),
                         "bytes": runner.bytes_moved, "verified": _verify_and_reset(plan, buffers)}
    return reshard, results


def _time_copy(copy_bytes: int, device: torch.device, repeat: int) -> float:
    """Median seconds of a plain device-to-device copy of ``copy_bytes``."""
    src_bytes = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst_bytes = torch.empty_like(src_bytes)
    copy_times = _time(lambda: dst_bytes.copy_(src_bytes), device, repeat)
    return statistics.median(copy_times)


def _summary(args, device, plan, ranks, reshard, results, copy_bytes: int, copy_seconds: float) -> dict:
    """The figures of the run (the JSON printed with --json)."""
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
    return summary


def _print_report(args, summary: dict, results: dict, copy_bytes: int, copy_seconds: float) -> None:
    """The headline, the table of methods and the speedup line."""
    rows = []
    for name in ("reshard", "gather_broadcast"):
        r = results[name]
        rows.append((name, format_seconds(r["seconds"]), format_bytes(r["bytes"]),
                     f"{r['bytes'] / r['seconds'] / 1e9:.1f}", "yes" if r["verified"] else "NO"))
    rows.append(("d2d copy (reshard bytes)", format_seconds(copy_seconds), format_bytes(copy_bytes),
                 f"{summary['copy_GBps']:.1f}", "-"))
    print(f"{summary['device']}: {args.model} {args.layers} layers, {args.source} -> {args.destination}, "
          f"{summary['num_ranks']} virtual ranks, model {format_bytes(summary['model_bytes'])}")
    print(render_table(("method", "median", "bytes", "GB/s", "verified"), rows))
    print(f"speedup {summary['speedup']:.2f}x; reshard at {summary['reshard_fraction_of_copy']:.0%} of copy bandwidth")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    device = torch.device(args.device)
    plan = _make_plan(args, device)
    ranks = sorted(set(plan.source.ranks) | set(plan.destination.ranks))
    buffers = _allocate_buffers(plan, ranks, device)
    reshard, results = _time_methods(plan, buffers, device, args)
    copy_bytes = reshard.bytes_moved
    copy_seconds = _time_copy(copy_bytes, device, args.repeat)
    summary = _summary(args, device, plan, ranks, reshard, results, copy_bytes, copy_seconds)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    _print_report(args, summary, results, copy_bytes, copy_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
