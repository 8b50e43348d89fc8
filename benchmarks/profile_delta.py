"""Where a delta refit's time goes, op by op: the bench_delta layout (8 ranks, Qwen3-MoE
tp1,pp2,dp2,ep2 -> tp2,dp2), synthetic versions at ``--density``, a few delta refits to
warm up, then one under ``torch.profiler`` per rank. Writes, per rank, the profiler's
table (self CPU time, calls; CUDA time on a GPU) and the executor's phases, and a Chrome
trace of a sender and a receiver, into ``--out``.

Run: ``python benchmarks/profile_delta.py --out DIR [--device cuda --backend nccl4py]``.
A diagnostic (issue 35: per-message work of the delta path), not a benchmark of record.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
from bench_delta import refit_case

from elastic_refit.testing.pattern import allocate
from elastic_refit.testing.processes import nccl_rank_env, run_local_world
from elastic_refit.testing.versions import version_buffers
from elastic_refit.testing.world import RefitCase, make_transport
from elastic_refit.transport.executor import DeltaInputs, Executor, ExecutorOptions


def _rank(rank: int, world: int, store: dist.Store, case: RefitCase, args: dict) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    plan = case.plan()
    transport = make_transport(dist.PrefixStore("profile", store), rank, world, args["backend"], 300.0)
    device = transport.device
    executor = Executor(plan, transport, ExecutorOptions(verify=True, delta=True, staging_bytes=256 << 20))
    receivers = frozenset(plan.destination.ranks)
    dst = allocate(plan.destination, rank, fill=0, device=device)
    src = version_buffers(plan.source, rank, 0, density=args["density"], device=device)
    executor.run(src, dst)
    seconds = []
    for v in range(1, args["warmup"] + 2):
        base, src = src, version_buffers(plan.source, rank, v, density=args["density"], device=device)
        transport.vote(True)
        last = v == args["warmup"] + 1
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) if last else contextlib.nullcontext() as prof:
            t = time.perf_counter()
            result = executor.run(src, dst, delta=DeltaInputs(base, receivers))
            seconds.append(time.perf_counter() - t)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45)
    table_dev = prof.key_averages().table(sort_by=sort, row_limit=25) if device.type == "cuda" else ""
    if rank in (min(plan.source.ranks), min(plan.destination.ranks)):
        prof.export_chrome_trace(os.path.join(args["out"], f"trace_rank{rank}.json"))
    with open(os.path.join(args["out"], f"rank{rank}.txt"), "w") as f:
        f.write(f"seconds per delta refit: {[round(s, 4) for s in seconds]}\n")
        f.write(json.dumps({k: getattr(result, k) for k in ("seconds", "num_delta_buckets")}, default=str) + "\n")
        f.write(table + "\n" + table_dev + "\n")
    transport.abort()
    return {"seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--backend", default=None, help="gloo on cpu, nccl4py on cuda by default")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--density", type=float, default=0.02)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    backend = args.backend or ("nccl4py" if args.device == "cuda" else "gloo")
    os.makedirs(args.out, exist_ok=True)
    case = refit_case(args.hidden, args.layers, experts=8)
    results = run_local_world(_rank, case.plan().topology.num_ranks,
                              (case, {"backend": backend, "density": args.density, "warmup": args.warmup,
                                      "out": args.out}),
                              timeout_s=900, rank_env=None if backend == "gloo" else nccl_rank_env)
    for r in results:
        print(f"rank {r.rank}: " + (str([round(s, 4) for s in r.value["seconds"]]) if r.ok else
                                     f"FAILED {r.error_type} {r.error[:800]}"))


if __name__ == "__main__":
    main()
