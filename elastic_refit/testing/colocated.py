"""One rank of a same-host refit world on a GPU: direct reads over CUDA IPC against nccl4py
and gather-and-broadcast, every byte verified (``benchmarks/bench_colocated.py`` and the GPU
tests run it through :func:`~elastic_refit.testing.processes.run_local_world` with
:func:`~elastic_refit.testing.processes.nccl_rank_env`: every rank on GPU 0 when there is one).

The world is trainer ranks ``0..S-1`` and inference ranks ``S..`` (separate processes, as in
a hybrid engine whose inference server runs beside the trainer); ``hosts[r]`` says which
"host" rank r is on (the plan's domains follow the hosts). Methods:

- ``ipc``: the nccl4py transport routed by host (:func:`~elastic_refit.transport.factory.with_direct_reads`):
  same-host messages are read straight from the source's memory, the rest through nccl4py;
- ``nccl4py``: the same plan, every byte through nccl4py (NCCL's socket transport here);
- ``gather_broadcast``: the baseline over nccl4py.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import structlog
import torch
import torch.distributed as dist

from elastic_refit.layout.core import Topology
from elastic_refit.layout.models import ModelConfig
from elastic_refit.layout.refit import model_refit_spec
from elastic_refit.plan import Plan, PlanOptions, make_plan
from elastic_refit.testing.world import (
    SENTINEL,
    _padded_buffers,
    leave_together,
    padding_problems,
    pattern_pieces,
)
from elastic_refit.transport.buffers import buffer_digests, byte_view

__all__ = ["ColocatedCase", "colocated_plan", "colocated_rank", "summarise"]

log = structlog.get_logger("elastic_refit.testing")


@dataclass(frozen=True, slots=True)
class ColocatedCase:
    """A model refit on one "host" or several (``hosts``, one per rank, trainers first)."""

    model: str | ModelConfig = "qwen3-30b-a3b"
    source: str = "tp=2,pp=2,ep=2"
    destination: str = "tp=2,dp=2"
    num_layers: int | None = 8
    hosts: tuple[str, ...] = ("h0",) * 8
    methods: tuple[str, ...] = ("ipc", "nccl4py", "gather_broadcast")
    repeat: int = 3
    # Timed runs of the network methods (nccl4py, gather_broadcast; None: ``repeat``): over
    # the socket transport one gather-and-broadcast of a Qwen3-30B-A3B cut takes 26-30 s
    # (H100, 2 layers), so a model large enough for the IPC-to-copy ratio needs fewer.
    baseline_repeat: int | None = None
    warmup: int = 1
    bucket_bytes: int = 64 << 20
    timeout_s: float = 60.0
    seed: int = 7
    ceiling_bytes: int = 1 << 30  # the plain copy's buffer (timed over the refit's bytes)
    die_rank: int | None = None  # exits (as if killed) after the first ipc refit; the others must fail and unmap

    def __post_init__(self) -> None:
        unknown = set(self.methods) - {"ipc", "nccl4py", "gather_broadcast"}
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}")
        if self.repeat < 1 or self.warmup < 0 or (self.baseline_repeat is not None and self.baseline_repeat < 1):
            raise ValueError(f"repeat and baseline_repeat must be >= 1 and warmup >= 0, got {self.repeat}, "
                             f"{self.baseline_repeat}, {self.warmup}")

    def runs(self, method: str) -> int:
        """Runs of ``method``, the warm-up included."""
        timed = self.repeat if method == "ipc" or self.baseline_repeat is None else self.baseline_repeat
        return self.warmup + timed


def colocated_plan(case: ColocatedCase) -> Plan:
    """The case's plan: domains follow the hosts (relay off: forwards would not be IPC)."""
    spec = model_refit_spec(case.model, case.source, case.destination, num_layers=case.num_layers)
    names = sorted(set(case.hosts))
    if len(case.hosts) != spec.topology.num_ranks:
        raise ValueError(f"{len(case.hosts)} hosts for a world of {spec.topology.num_ranks} ranks")
    topology = Topology(tuple(names.index(h) for h in case.hosts), case.hosts)
    return make_plan(spec.source, spec.destination, topology,
                     PlanOptions(bucket_bytes=case.bucket_bytes, direct_min_bytes=256 << 10, relay="off"))


def _check(plan: Plan, rank: int, dst, padded, seed: int) -> list[str]:
    return (pattern_pieces(plan.destination, rank, dst, seed, write=False)
            + padding_problems(plan.destination, rank, padded, SENTINEL))


def colocated_rank(rank: int, world_size: int, store: dist.Store, case: ColocatedCase) -> dict[str, Any]:
    """This rank's seconds, bytes by route and problems per method (see the module)."""
    from elastic_refit.transport.baseline import BaselineOptions, GatherBroadcast
    from elastic_refit.transport.cuda_ipc import open_mappings
    from elastic_refit.transport.executor import Executor, ExecutorOptions
    from elastic_refit.transport.factory import create_transport, with_direct_reads

    torch.cuda.set_device(int(os.environ.get("ELASTIC_REFIT_CUDA_DEVICE", "0")))
    device = torch.device("cuda", torch.cuda.current_device())
    plan = colocated_plan(case)
    base = create_transport("nccl4py", dist.PrefixStore("nccl", store), rank, world_size, timeout_s=case.timeout_s)
    routed = with_direct_reads(base, dist.PrefixStore("ipc", store), case.hosts, device=device)
    src = {}
    if rank in plan.source.ranks:
        from elastic_refit.testing.pattern import allocate

        src = allocate(plan.source, rank, fill=0, device=device)
        pattern_pieces(plan.source, rank, src, case.seed, write=True)
    from elastic_refit.testing.pattern import allocate

    dst = allocate(plan.destination, rank, fill=SENTINEL, device=device) if rank in plan.destination.ranks else {}
    padded = _padded_buffers(plan.destination, rank, dst) if dst else {}
    options = ExecutorOptions(staging_bytes=256 << 20)
    runners = {}
    for m in case.methods:
        if m == "ipc":
            runners[m] = Executor(plan, routed, options).run
        elif m == "nccl4py":
            runners[m] = Executor(plan, base, options).run
        else:
            runners[m] = GatherBroadcast(plan, base, BaselineOptions(chunk_bytes=32 << 20)).run
    out: dict[str, Any] = {"rank": rank, "methods": {}}
    try:
        for m, run in runners.items():
            out["methods"][m] = res = {"seconds": [], "problems": []}
            reference = None
            for i in range(case.runs(m)):
                for t in dst.values():
                    byte_view(t).fill_(SENTINEL)
                torch.cuda.synchronize(device)
                base.vote(True)  # start together
                t0 = time.perf_counter()
                report = run(src, dst)
                torch.cuda.synchronize(device)
                seconds = time.perf_counter() - t0
                if i >= case.warmup:
                    res["seconds"].append(seconds)
                if reference is None:
                    res["problems"] += _check(plan, rank, dst, padded, case.seed)[:5]
                    reference = buffer_digests(dst)
                elif buffer_digests(dst) != reference:
                    res["problems"].append(f"rank {rank} run {i}: buffers differ from the verified first run")
                if m == "ipc" and case.die_rank is not None:
                    # Every rank is past the first refit's vote before the source dies (its
                    # proxy may still owe peers that vote's last message, see leave_together):
                    # the death falls between two refits, with the memory still mapped.
                    late = leave_together(store, rank, world_size, case.timeout_s, key="first-refit")
                    if late:
                        raise RuntimeError(f"rank {rank}: ranks {late} did not finish the first refit")
                    if rank == case.die_rank:
                        os._exit(17)  # a peer dies with its memory mapped by readers
                    return _after_death(rank, routed, run, src, dst, res, open_mappings, case.timeout_s)
            res["recv_bytes"] = getattr(report, "network_recv_bytes", 0) + getattr(report, "intra_recv_bytes", 0)
            if m == "ipc":
                res["direct_recv_bytes"] = report.direct_recv_bytes
                res["network_recv_bytes"] = report.network_recv_bytes
                res["intra_recv_bytes"] = report.intra_recv_bytes
                res["moved"] = {k: v // case.runs(m) for k, v in getattr(routed, "moved", {}).items()}  # summed over runs
        if rank == 0:
            out["ceiling"] = _copy_ceiling(device, case.ceiling_bytes)
    except BaseException as exc:
        leave_together(store, rank, world_size, case.timeout_s, outcome=f"failed: {type(exc).__name__}")
        raise
    else:
        late = leave_together(store, rank, world_size, case.timeout_s)  # nothing of the world in flight
        if late:
            out["late_ranks"] = late
    finally:
        routed.close()  # closes base too
        out["open_mappings_after_close"] = open_mappings()
    return out


def _after_death(rank, routed, run, src, dst, res, open_mappings, timeout_s: float) -> dict[str, Any]:
    """The refit after a peer died: it must fail (typed), then closing unmaps everything.

    The failed refit may leave a collective of the communicator stuck on the dead peer, and
    unmapping synchronises the device: the transport defers those mappings until that work
    ended. Here the harness owns the communicator, so it aborts it (as the runtime's
    communicator manager does on the epoch change), then the deferred mappings go."""
    from elastic_refit.transport.factory import release_deferred_mappings
    from elastic_refit.transport.protocol import abort_with_watchdog

    res["mapped_before"] = open_mappings()
    try:
        run(src, dst)
        res["second_refit"] = "passed"
    except Exception as exc:
        res["second_refit"] = type(exc).__name__
    comm = getattr(routed.base, "comm", None)  # before the close drops it
    routed.close()
    if comm is not None:
        abort_with_watchdog(comm, timeout_s, log, what="after_death")
    res["pending_after_abort"] = release_deferred_mappings(timeout_s)
    res["open_mappings_after_close"] = open_mappings()
    return {"rank": rank, "methods": {"ipc": res}, "open_mappings_after_close": open_mappings()}


def _copy_ceiling(device: torch.device, nbytes: int) -> dict[str, float]:
    """GB/s of a plain device-to-device copy (bytes counted once, as a refit counts them)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(10):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return {"bytes": nbytes, "seconds": statistics.median(times), "GBps": nbytes / statistics.median(times) / 1e9}


def summarise(plan: Plan, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: the slowest rank's seconds per run (median), GB/s over the bytes the
    destinations received, problems; the byte split by route against the plan's."""
    from elastic_refit.transport.schedule import build_rank_schedule

    ranks = range(len(results))
    kinds = [build_rank_schedule(plan, r).bytes_by_kind() for r in ranks]
    moved = sum(k["network_recv"] + k["intra_recv"] for k in kinds)
    out: dict[str, Any] = {"moved_bytes": moved, "plan_intra_recv_bytes": sum(k["intra_recv"] for k in kinds),
                           "plan_network_recv_bytes": sum(k["network_recv"] for k in kinds), "methods": {}}
    for m in results[0]["methods"]:
        per_run = [max(r["methods"][m]["seconds"][i] for r in results)
                   for i in range(len(results[0]["methods"][m]["seconds"]))]
        sec = statistics.median(per_run) if per_run else float("nan")
        entry = {"seconds": sec, "runs": per_run, "GBps": moved / sec / 1e9 if per_run else 0.0,
                 "problems": [p for r in results for p in r["methods"][m]["problems"]][:10]}
        if m == "ipc" and "moved" in results[0]["methods"][m]:
            entry["direct_bytes"] = sum(r["methods"][m]["moved"]["direct"] for r in results)
            entry["base_bytes"] = sum(r["methods"][m]["moved"]["base"] for r in results)
        out["methods"][m] = entry
    ceiling = results[0].get("ceiling")
    if ceiling:
        out["copy_GBps"] = ceiling["GBps"]
        if "ipc" in out["methods"]:
            out["ipc_fraction_of_copy"] = out["methods"]["ipc"]["GBps"] / ceiling["GBps"]
    out["open_mappings_after_close"] = [r.get("open_mappings_after_close") for r in results]
    return out
