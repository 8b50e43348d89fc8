"""`elastic-refit bench --spec FILE | --model NAME ...`: reshard vs gather-and-broadcast.

One process per rank on this machine (gloo on CPU; NCCL when there is a GPU per rank),
pattern data in every source piece, raw send/recv bandwidth measured first, then the
reshard refit (the executor) and the classic gather-and-broadcast (the baseline) K times
each, alternating which goes first, every destination byte checked after every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from elastic_refit.cli._output import (
    format_bytes,
    format_seconds,
    print_json,
    progress,
    render_table,
)

__all__ = ["LABELS", "METHODS", "add_arguments", "run", "summarize"]

METHODS = ("reshard", "reshard_checked", "reshard_fp8", "gather_broadcast")
LABELS = {"reshard": "reshard (plan)", "reshard_checked": "reshard + source checks",
          "reshard_fp8": "reshard, FP8 destination", "gather_broadcast": "gather-and-broadcast"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The refit benchmark's arguments, on the `bench` parser itself (next to its targets)."""
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--spec", help="layout spec file (JSON)")
    from elastic_refit.cli.plan_cmd import model_help

    what.add_argument("--model", help=model_help())
    parser.add_argument("--source", help="training parallelism, e.g. tp=2,pp=2,ep=2")
    parser.add_argument("--destination", help="inference parallelism, e.g. tp=2,dp=2")
    parser.add_argument("--layers", type=int, default=None, help="cut the model to its first N layers")
    parser.add_argument("--domain-size", type=int, default=None, help="ranks per NVLink domain (default 8)")
    parser.add_argument("--colocate", action="store_true",
                        help="destination ranks start at 0 and share devices with the source")
    parser.add_argument("--bucket-mib", type=int, default=64, help="reshard bucket size in MiB (default 64)")
    parser.add_argument("--concurrent-rounds", type=int, default=1,
                        help="rounds of a phase in flight at once in the reshard (default 1); staging "
                             "grows to 4 buckets per round")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each method (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of each method first (default 1)")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl", "nccl4py"), default="auto",
                        help="auto: nccl when there is a GPU per rank, else gloo")
    parser.add_argument("--verify", action="store_true",
                        help="also send per-box digests with the reshard data (destinations are always "
                             "checked bit-exactly against the pattern)")
    parser.add_argument("--snapshot-digests", action="store_true",
                        help="also time the reshard with the runtime's source checks (digests of every source "
                             "buffer and replica region before, and of every buffer after the sends), "
                             "beside the plain reshard in the same run")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch intra-op threads per rank (default 0: torch's own, one per core)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="per-operation timeout in seconds (default: from the work, a few times the "
                             "slowest run and its check as estimated from the plan; at least 60)")
    parser.add_argument("--chunk-mib", type=float, default=8.0, help="baseline broadcast chunk in MiB (default 8)")
    parser.add_argument("--p2p-mib", type=int, default=128, help="raw send/recv message in MiB (default 128)")
    from elastic_refit.cli.plan_cmd import add_format_argument

    add_format_argument(parser)  # a quantized format adds the reshard into it (reshard_fp8)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _child_progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def _rank_entry(rank: int, world_size: int, store, case, options):
    """A rank of the benchmark; its per-refit log lines go to stderr at warning level so
    that stdout stays one JSON object."""
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    from elastic_refit.testing.world import bench_rank

    return bench_rank(rank, world_size, store, case, options, progress=_child_progress)


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _methods(case, args: argparse.Namespace) -> list[str]:
    """The methods this run times, in ``METHODS`` order."""
    chosen = {"reshard", "gather_broadcast"} | ({"reshard_checked"} if args.snapshot_digests else set())
    return [m for m in METHODS if m in chosen or (m == "reshard_fp8" and case.formats_json)]


def _budget(case, args: argparse.Namespace, backend: str, *, staging: int, chunk: int, p2p: int, gpus: int):
    """The benchmark's memory and time (``bench_budget.estimate``) for every method it runs;
    ``ValueError`` when the memory it needs is not there (host memory for gloo; on GPUs, the
    free memory of each device its ranks share), or for layouts that cast a tensor."""
    import os

    from elastic_refit.cli.bench_budget import estimate

    plan, fp8 = case.plan(), case.plan_quantized()
    if plan.cast is not None:  # its pattern checks and gather-and-broadcast move the source's bytes as they are
        raise ValueError(f"the bench runs layouts of one dtype per tensor; this spec casts ({plan.cast.describe()}): "
                         f"give the destination the source's dtype (tests/integration/test_runtime_casts.py runs casts)")
    device = "cpu" if backend == "gloo" else "cuda"
    budget = estimate(plan, fp8, methods=_methods(case, args), staging_bytes=staging, chunk_bytes=chunk,
                      p2p_bytes=p2p, runs=args.warmup + args.repeat, cores=os.cpu_count() or 1, device=device)
    host = budget.memory if device == "cpu" else sum(r.process for r in budget.ranks)
    if (avail := _mem_available()) is not None and host > avail:
        raise ValueError(f"the benchmark needs {budget.describe_memory()} of memory, {format_bytes(avail)} is "
                         f"available; cut the model (--layers), use fewer ranks, a smaller --bucket-mib, or no "
                         f"--destination-format")
    if device == "cuda":
        import torch

        need: dict[int, int] = {}
        for r in budget.ranks:  # nccl_rank_env: rank r on GPU r % gpus
            need[r.rank % gpus] = need.get(r.rank % gpus, 0) + r.device
        for d, nbytes in sorted(need.items()):
            free = torch.cuda.mem_get_info(d)[0]
            if nbytes > free:
                raise ValueError(f"the ranks on GPU {d} need about {format_bytes(nbytes)}, {format_bytes(free)} is "
                                 f"free there; cut the model (--layers) or use fewer ranks")
    return budget


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(values: list[dict[str, Any]], world_size: int, backend: str) -> dict[str, Any]:
    """Fold the ranks' results into the benchmark's JSON object."""
    out: dict[str, Any] = {"num_ranks": world_size, "backend": backend}
    methods = [m for m in METHODS if m in values[0]]
    problems = [p for v in values for m in methods for p in v[m]["problems"]]
    for m in methods:
        runs = len(values[0][m]["seconds"])
        # A run lasts until its slowest rank finishes (the closing vote aligns them anyway).
        per_run = [max(v[m]["seconds"][i] for v in values) for i in range(runs)]
        nbytes = sum(v[m]["recv_bytes"] for v in values)
        seconds = _median(per_run)
        out[m] = {
            "seconds": seconds,
            "seconds_min": min(per_run),
            "seconds_all": per_run,
            "bytes": nbytes,
            "send_bytes": sum(v[m]["send_bytes"] for v in values),
            "GBps": nbytes / seconds / 1e9 if seconds > 0 else None,
            "max_staging_bytes": max(v[m]["staging_bytes"] for v in values),
        }
    p2p_bytes = values[0]["p2p_bytes"]
    pair = [max(values[r]["p2p_pair_seconds"][i] for r in (0, 1)) for i in range(len(values[0]["p2p_pair_seconds"]))]
    every = [max(v["p2p_all_seconds"][i] for v in values) for i in range(len(values[0]["p2p_all_seconds"]))]
    out["p2p_GBps"] = p2p_bytes / _median(pair) / 1e9 if pair else None
    out["p2p_all_pairs_GBps"] = values[0]["p2p_pairs"] * p2p_bytes / _median(every) / 1e9 if every else None
    out["p2p_message_bytes"] = p2p_bytes
    out["plan_gather_broadcast_bytes"] = values[0]["gather_broadcast_bytes"]
    out["speedup"] = out["gather_broadcast"]["seconds"] / out["reshard"]["seconds"]
    if "reshard_fp8" in out:
        # the same refit into the quantized destination: bytes and time beside the BF16 reshard
        out["fp8_bytes_vs_bf16"] = out["reshard_fp8"]["bytes"] / max(out["reshard"]["bytes"], 1)
        out["fp8_seconds_vs_bf16"] = out["reshard_fp8"]["seconds"] / out["reshard"]["seconds"]
    if "reshard_checked" in out:
        out["speedup_checked"] = out["gather_broadcast"]["seconds"] / out["reshard_checked"]["seconds"]
        out["checks_seconds"] = out["reshard_checked"]["seconds"] - out["reshard"]["seconds"]
        # The digests and checks alone, timed inside the ranks: per run the busiest rank's.
        runs = len(values[0]["reshard_checked"].get("checks_seconds", []))
        out["checks_digest_seconds"] = _median([max(v["reshard_checked"]["checks_seconds"][i] for v in values)
                                                for i in range(runs)]) if runs else None
    out["reshard_fraction_of_p2p"] = (out["reshard"]["GBps"] / out["p2p_GBps"]) if out["p2p_GBps"] else None
    out["max_rss_bytes"] = [v.get("max_rss_bytes") for v in values]  # per rank, measured
    out["verified"] = not problems
    out["problems"] = problems[:10]
    return out


def run(args: argparse.Namespace) -> int:
    """Run the side-by-side refit benchmark; exit status 1 when a byte did not verify."""
    import torch

    from elastic_refit.cli.plan_cmd import load_case
    from elastic_refit.testing.processes import nccl_rank_env, run_local_world
    from elastic_refit.testing.world import BenchOptions, RefitCase

    for flag, value in (("--repeat", args.repeat), ("--bucket-mib", args.bucket_mib), ("--p2p-mib", args.p2p_mib),
                        ("--concurrent-rounds", args.concurrent_rounds)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.torch_threads < 0:
        raise ValueError(f"--torch-threads must be >= 0, got {args.torch_threads}")
    if args.warmup < 0 or not 0 < args.chunk_mib < math.inf or not (args.timeout is None or 0 < args.timeout < math.inf):
        raise ValueError(f"--warmup must be >= 0, --chunk-mib and --timeout > 0; got {args.warmup}, "
                         f"{args.chunk_mib}, {'auto' if args.timeout is None else args.timeout}")
    spec, description = load_case(args)
    world_size = spec.topology.num_ranks
    if world_size < 2:
        raise ValueError(f"the refit needs at least 2 ranks, the layouts use {world_size}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend if args.backend != "auto" else ("nccl" if gpus >= world_size else "gloo")
    if backend != "gloo" and gpus == 0:
        raise ValueError(f"--backend {backend} needs a GPU, and this machine has none")
    # Fewer GPUs than ranks: the ranks share them, each a host of its own to NCCL, and every
    # byte crosses NCCL's socket transport (as between the nodes of a cluster).
    rank_env = nccl_rank_env if backend != "gloo" else None
    bucket = args.bucket_mib << 20
    if args.spec:
        case = RefitCase(spec_json=Path(args.spec).read_text(), bucket_bytes=bucket,
                         concurrent_rounds=args.concurrent_rounds)
    else:
        case = RefitCase(model=args.model, source=args.source, destination=args.destination, num_layers=args.layers,
                         domain_size=args.domain_size or 8, colocate=args.colocate, bucket_bytes=bucket,
                         concurrent_rounds=args.concurrent_rounds)
    if spec.destination_formats:
        case = dataclasses.replace(case, formats_json=spec.destination_formats.to_json())
    chunk = max(1, int(args.chunk_mib * (1 << 20)))
    p2p = args.p2p_mib << 20
    staging = 4 * bucket * args.concurrent_rounds
    budget = _budget(case, args, backend, staging=staging, chunk=chunk, p2p=p2p, gpus=gpus)
    timeout = budget.timeout_s if args.timeout is None else args.timeout
    if timeout < budget.timeout_s:
        progress(f"warning: --timeout {args.timeout:g} is below the {budget.timeout_s:.0f} s this work may need "
                 f"(a rank may wait that long for the slowest one)")
    options = BenchOptions(backend=backend, timeout_s=timeout, staging_bytes=staging, verify=args.verify,
                           repeat=args.repeat, warmup=args.warmup, chunk_bytes=chunk, p2p_bytes=p2p,
                           snapshot_digests=args.snapshot_digests, torch_threads=args.torch_threads)
    progress(f"{description}: {world_size} ranks on {backend}, model {format_bytes(spec.source.model_nbytes)}; "
             f"{args.warmup} warm-up + {args.repeat} timed runs of {', '.join(_methods(case, args))}")
    progress(f"memory: {budget.describe_memory()}; {budget.describe_time()}")
    deadline = max(budget.total_s, 2 * timeout + 120)
    results = run_local_world(_rank_entry, world_size, (case, options), timeout_s=deadline, rank_env=rank_env)
    failed = [r for r in results if not r.ok]
    if failed:
        for r in failed[:4]:
            progress(f"rank {r.rank}: {r.error_type}: {r.error.strip().splitlines()[0] if r.error else ''}")
        if args.json:
            print_json({"verified": False, "num_ranks": world_size, "backend": backend,
                        "errors": [f"rank {r.rank}: {r.error_type}: {r.error}" for r in failed]})
        return 1
    out = summarize([r.value for r in results], world_size, backend)
    out["case"] = description
    out["estimate"] = budget.as_dict()
    out["timeout_s"] = timeout
    out["snapshot_digests"] = args.snapshot_digests
    out["concurrent_rounds"] = args.concurrent_rounds
    out["torch_threads"] = args.torch_threads
    if args.json:
        print_json(out)
    else:
        _print_table(out, args, description, p2p)
    return 0 if out["verified"] else 1


def _print_table(out: dict[str, Any], args: argparse.Namespace, description: str, p2p: int) -> None:
    """The benchmark's readable output: a row per method, then the raw bandwidth and verdict."""
    world_size, backend = out["num_ranks"], out["backend"]
    p2p_gbps = out["p2p_GBps"]
    rows = []
    for m in (m for m in METHODS if m in out):
        f = out[m]
        rows.append((LABELS[m], format_seconds(f["seconds"]), format_seconds(f["seconds_min"]), format_bytes(f["bytes"]),
                     f"{f['GBps']:.2f}", f"{f['GBps'] / p2p_gbps:.0%}" if p2p_gbps else "-",
                     f"{f['seconds'] / out['reshard']['seconds']:.2f}x"))
    checks = ", reshard also with the source checks" if args.snapshot_digests else ""
    rounds = f", {args.concurrent_rounds} rounds at once" if args.concurrent_rounds > 1 else ""
    print(f"{description}  |  {world_size} ranks, {backend}, {args.repeat} runs each (median){checks}{rounds}")
    print(render_table(("method", "seconds", "min", "bytes moved", "GB/s", "of p2p", "time vs reshard"), rows))
    print(f"raw send/recv: {p2p_gbps:.2f} GB/s one pair ({format_bytes(p2p)} messages), "
          f"{out['p2p_all_pairs_GBps']:.2f} GB/s all {world_size // 2} pairs at once")
    checked = (f" ({out['speedup_checked']:.2f}x with the source checks, which add "
               f"{format_seconds(out['checks_seconds'])})") if "speedup_checked" in out else ""
    if "fp8_bytes_vs_bf16" in out:
        print(f"fp8 destination: {out['fp8_bytes_vs_bf16']:.3f}x the bytes of the bf16 reshard, "
              f"{out['fp8_seconds_vs_bf16']:.2f}x its time (quantized on the senders, CPU torch reference)")
    print(f"speedup {out['speedup']:.2f}x{checked}; reshard at {out['reshard_fraction_of_p2p']:.0%} of one-pair send/recv; "
          f"verified: {'yes, every destination byte' if out['verified'] else 'NO'}")
    for p in out["problems"]:
        print(f"  {p}")
